"""The main job's whole RL step on the long-prompt task: naive vs joint, rollout / score / train.

- ``naive``: per-row rollouts (every sample prefills its prompt) + naive training (every
  response a full sequence through stock MCore): ``--rl-rollout per_row
  --shared-prefix-schedule naive``;
- ``joint``: prompt-once rollouts + joint replay (the main job's defaults);
- ``joint_rollout_logprobs``: ``joint`` with ``--rl-old-logprobs rollout`` (the rollout's own
  log-probs are the old log-probs: no scoring pass of the policy).

Each variant is an ``RLTrainer`` built as the main job builds it, from the same seed (the same
initial weights) and drawing the same prompts; their steps run interleaved round-robin, and
the phase times are the trainer's own metrics (``time_{rollout,score,train,step}_s``). Apart,
rollouts alone, per row vs prompt once, on one batch of prompts: response tokens/s, peak
tensor memory, and KV cache bytes.

``python -m benchmarks.run`` (``make bench``) runs it and stores the result under ``rl_step`` in
cpu.json, its table in cpu.md. ``python -m benchmarks.rl_step [--steps 2] [--out DIR]`` runs it
alone and puts it into DIR/cpu.json and DIR/cpu.md beside the results already there.
"""

import argparse
import os
import statistics
import sys
import time

import torch

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "long_prompt_cpu.yaml")
"""The main job's config of the long-prompt task (kv_retrieval, prompt 512, response 16, G 16,
2 prompts per step; hidden 256, 2 core layers x 4 loops)."""
OVERRIDES = {"eval_interval": 0, "train_iters": 100}
"""Changes to the config for timing: no evaluation; the LR schedule of a longer run."""
VARIANTS = {
    "naive": {"rl_rollout": "per_row", "shared_prefix_schedule": "naive"},
    "joint": {"rl_rollout": "prompt_once", "shared_prefix_schedule": "joint_replay"},
    "joint_rollout_logprobs": {"rl_rollout": "prompt_once",
                               "shared_prefix_schedule": "joint_replay",
                               "rl_old_logprobs": "rollout"},
}
PHASES = ("step", "rollout", "score", "train")
NOTES = [
    "rl_step: the main job's RLTrainer.rl_step on kv_retrieval (prompt 512 tokens with bos, "
    "responses up to 16 tokens, G 16, 2 prompts per step), model hidden 256, 4 heads, 2 core "
    "layers x 4 loops, fp32, untrained (responses end at eos or 16 tokens). naive = per-row "
    "rollouts + naive training; joint = prompt-once rollouts + joint replay (wave 4); both "
    "score old log-probs through the shared-prefix schedule (forward only, prompt once). "
    "joint_rollout_logprobs takes the old log-probs from the rollout instead. Ratios: medians "
    "of the timed steps (after warm-up), variants interleaved; the host is shared, so wall "
    "figures are noisy.",
]


def _flags(values: dict) -> list:
    out = []
    for key, value in values.items():
        out += ["--" + key.replace("_", "-"), str(value)]
    return out


def build_trainer(config: str, values: dict):
    """An ``RLTrainer`` on the current MCore state, built as ``train.run`` builds it from the
    YAML file ``config`` and the flags ``values``."""
    from scalerlt_mcore.app import runtime
    from scalerlt_mcore.app.config import parse_args, validate
    from scalerlt_mcore.app.pretrained import run_vocab_size
    from scalerlt_mcore.app.trainer import RLTrainer

    cfg = parse_args(["--config", config] + _flags(values))
    validate(cfg, torch.distributed.get_world_size())
    config = runtime.model_config(cfg, "cpu")
    model = runtime.build_model(cfg, config, run_vocab_size(cfg), "cpu")
    return RLTrainer(cfg, model, *runtime.wrap_for_training(cfg, config, model))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def build_variants(config: str, overrides: dict, variants: dict, seed: int) -> dict:
    """name -> trainer; every variant starts from the same weights (checked)."""
    trainers = {}
    for name, extra in variants.items():
        torch.manual_seed(seed)
        trainers[name] = build_trainer(config, {**overrides, **extra})
    first = _flat(next(iter(trainers.values())).model)
    for name, tr in trainers.items():
        if not torch.equal(_flat(tr.model), first):
            raise RuntimeError(f"variant {name} does not start from the same weights")
    return trainers


def time_steps(trainers: dict, steps: int, warmup: int) -> dict:
    """name -> list of the timed steps' metrics; variants interleaved step by step."""
    records = {name: [] for name in trainers}
    for step in range(warmup + steps):
        for name, tr in trainers.items():
            metrics = tr.rl_step(step)
            if step >= warmup:
                records[name].append(metrics)
    return records


def summarise_steps(records: dict) -> dict:
    """Per variant: median (and all) phase times, response tokens/s, the rollout-vs-training
    log-prob difference; ratios naive / joint per phase."""
    out = {}
    for name, recs in records.items():
        times = {p: [r[f"time_{p}_s"] for r in recs] for p in PHASES}
        out[name] = {
            **{f"{p}_s": statistics.median(v) for p, v in times.items()},
            "all_s": times,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs),
            "rollout_logprob_max_diff": max(r["rollout_logprob_max_diff"] for r in recs),
            "reward_mean": statistics.mean(r["reward_mean"] for r in recs),
        }
    naive = out["naive"]

    def ratios(other: dict, skip: tuple = ()) -> dict:
        """naive's phase times over ``other``'s; None for the phases in ``skip``."""
        return {("wall" if p == "step" else p):
                naive[f"{p}_s"] / other[f"{p}_s"] if other[f"{p}_s"] > 0 and p not in skip
                else None for p in PHASES}

    result = {"variants": out, "naive_over_joint": ratios(out["joint"])}
    if "joint_rollout_logprobs" in out:  # no scoring pass: its score time is bookkeeping only
        result["naive_over_joint_rollout_logprobs"] = ratios(out["joint_rollout_logprobs"],
                                                             skip=("score",))
    return result


# ---- rollouts alone --------------------------------------------------------------------------

def peak_tensor_bytes(fn) -> int:
    """Peak bytes of tensors allocated during ``fn()`` above those live when it starts: CUDA's
    allocator statistics, on CPU the profiler's memory events."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def kv_cache_bytes(config, prompts: int, group_size: int, prompt_length: int,
                   new_tokens: int, element_bytes: int) -> dict:
    """Bytes of the decoding caches (keys + values of every depth): per row, the prompt and the
    response for each of the N * G samples; prompt once, the prompt for each of the N prompts
    and the response for each sample."""
    groups = config.num_query_groups or config.num_attention_heads
    per_token = 2 * config.looped_num_depths * groups * config.kv_channels * element_bytes
    rows = prompts * group_size
    return {"per_row": per_token * rows * (prompt_length + new_tokens),
            "prompt_once": per_token * (prompts * prompt_length + rows * new_tokens)}


def measure_rollouts(trainer, step: int = 0, repetitions: int = 2) -> dict:
    """Rollouts of one step's prompts, per row vs prompt once, on the trainer's model (warm:
    after its RL steps): median wall time, response tokens/s, peak tensor bytes (one more
    run), KV cache bytes; whether both sample the same tokens."""
    from scalerlt_mcore.app.trainer import step_seed

    cfg = trainer.cfg
    problems = trainer.task.sample(step_seed(cfg.training.seed, step, trainer.rank),
                                   trainer.groups_per_rank)
    G, configured = cfg.rl.grpo_group_size, cfg.rl.rl_rollout
    out, samples = {}, {}
    for mode in ("per_row", "prompt_once"):
        cfg.rl.rl_rollout = mode

        def run(mode=mode):
            samples[mode] = trainer.rollout(step, problems, G, cfg.rl.rl_temperature)

        times = []
        for _ in range(repetitions):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        wall = statistics.median(times)
        tokens = int(samples[mode].lengths.sum())
        out[mode] = {"wall_s": wall, "wall_all_s": times, "response_tokens": tokens,
                     "tokens_per_s": tokens / wall, "peak_tensor_bytes": peak_tensor_bytes(run)}
    cfg.rl.rl_rollout = configured
    prompt_len = 1 + len(problems[0].prompt)  # bos + the task's fixed-length prompt
    p = next(trainer.model.parameters())
    caches = kv_cache_bytes(trainer.model.config, len(problems), G, prompt_len,
                            cfg.rl.rl_max_response_length, p.element_size())
    for mode in out:
        out[mode]["kv_cache_bytes"] = caches[mode]
    a, b = samples["per_row"], samples["prompt_once"]
    out["same_samples"] = bool(torch.equal(a.responses, b.responses))
    out["max_logprob_diff"] = float((a.loop_logprobs - b.loop_logprobs).abs().max())
    out["prompt_once_over_per_row"] = {
        "tokens_per_s": out["prompt_once"]["tokens_per_s"] / out["per_row"]["tokens_per_s"]}
    out["per_row_over_prompt_once"] = {
        key: out["per_row"][key] / out["prompt_once"][key]
        for key in ("peak_tensor_bytes", "kv_cache_bytes")}
    return out


# ---- entry ---------------------------------------------------------------------------------

def run_rl_step(steps: int = 2, warmup: int = 1, config: str = CONFIG, overrides: dict = None,
                variants: dict = None, seed: int = 0, log=print) -> dict:
    """The whole benchmark on the current MCore state (``model_parallel_context``): the main
    job's ``config`` file with ``overrides`` (default ``OVERRIDES``) and each variant's flags."""
    t0 = time.perf_counter()
    overrides = OVERRIDES if overrides is None else overrides
    trainers = build_variants(config, overrides, variants or VARIANTS, seed)
    result = summarise_steps(time_steps(trainers, steps, warmup))
    result["rollouts"] = measure_rollouts(trainers["joint"])
    from scalerlt_mcore.app.config import to_dict

    result["config"] = {"file": os.path.relpath(config), "overrides": overrides,
                        "variants": variants or VARIANTS, "steps": steps, "warmup": warmup,
                        "resolved": to_dict(trainers["joint"].cfg)}
    result["notes"] = NOTES
    result["bench_seconds"] = time.perf_counter() - t0
    nj, ro = result["naive_over_joint"], result["rollouts"]
    log(f"[rl_step] {result['bench_seconds']:.0f}s  naive/joint wall {nj['wall']:.2f} (rollout "
        f"{nj['rollout']:.2f}, score {nj['score']:.2f}, train {nj['train']:.2f}) | rollouts "
        f"prompt-once/per-row tokens/s {ro['prompt_once_over_per_row']['tokens_per_s']:.2f}, "
        f"per-row/prompt-once peak bytes "
        f"{ro['per_row_over_prompt_once']['peak_tensor_bytes']:.2f}", flush=True)
    return result


def markdown(result: dict) -> str:
    """The rl_step section of cpu.md."""
    lines = ["| variant | step s | rollout s | score s | train s | tokens/s | max rollout-vs-"
             "training log-prob diff |", "|---|---|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        lines.append(f"| {name} | {v['step_s']:.2f} | {v['rollout_s']:.2f} | {v['score_s']:.2f} "
                     f"| {v['train_s']:.2f} | {v['tokens_per_s']:.0f} "
                     f"| {v['rollout_logprob_max_diff']:.1e} |")
    for key in ("naive_over_joint", "naive_over_joint_rollout_logprobs"):
        if key in result:
            r = result[key]
            score = "none (no scoring pass)" if r["score"] is None else _fmt(r["score"])
            lines.append(f"\n{key}: wall {_fmt(r['wall'])}, rollout {_fmt(r['rollout'])}, "
                         f"score {score}, train {_fmt(r['train'])}")
    ro = result["rollouts"]
    lines += ["", "| rollout | wall s | response tokens/s | peak tensor MiB | KV cache MiB |",
              "|---|---|---|---|---|"]
    for mode in ("per_row", "prompt_once"):
        m = ro[mode]
        mib = [m[k] / 2**20 for k in ("peak_tensor_bytes", "kv_cache_bytes")]
        lines.append(f"| {mode} | {m['wall_s']:.2f} | {m['tokens_per_s']:.0f} "
                     f"| {mib[0]:.1f} | {mib[1]:.1f} |")
    lines.append(f"\nsame samples: {ro['same_samples']}, max per-loop log-prob difference "
                 f"{ro['max_logprob_diff']:.1e}")
    return "\n".join(lines)


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed RL steps per variant")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from scalerlt_mcore.testing import model_parallel_context

    with model_parallel_context(seed=args.seed):
        result = run_rl_step(steps=args.steps, seed=args.seed)
    merge_into(args.out, result)
    print(markdown(result))
    return 0


MD_HEADING = "## Whole RL step (rl_step)"


def merge_into(out: str, result: dict) -> None:
    """Put ``result`` under ``rl_step`` in ``out``/cpu.json (its target row and notes in the
    meta) and its section into ``out``/cpu.md, keeping the other results there."""
    from .report import check_targets, merge_entry

    merge_entry(out, "rl_step", result, check_targets({"rl_step": result}), MD_HEADING,
                markdown(result), notes=tuple(NOTES))


if __name__ == "__main__":
    sys.exit(main())
