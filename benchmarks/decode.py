"""Host syncs and decode speed on CPU (``host_syncs`` in cpu.json).

- ``decode_per_token``: host syncs (``model/host_syncs.py``; on CPU the ops that *would* make
  the host wait on CUDA) per decoded token of a greedy rollout in steady state, per row and
  prompt once (``decode_modes``): the count of a rollout of ``LONG`` tokens minus one of ``SHORT``,
  over the difference, without the stop check (its one sync every ``stop_check_interval``
  tokens, default by device, is ``stop_check_per_token``).
- ``train_step``: host syncs of one joint-replay training step of one group at 2 and 8 waves.
- ``tokens_per_s``: per shape (``SHAPES``), greedy rollouts of a Llama imported at R = 1
  (``looped_gpt_from_hf``) against Hugging Face ``generate`` (static cache, greedy) on the
  same weights, the same batch, prompt and response lengths (prefill included in both), per
  row and prompt once (``decode_modes``; transformers has one way: N * G rows), and the project's
  two cache-attention paths: ``static`` (the whole preallocated cache under a mask: fixed
  shapes, CUDA-graphable) and ``sliced`` (the cache up to the host-known longest row).

``python -m benchmarks.decode [--out DIR]`` prints the JSON and merges it into cpu.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

import torch

N_PROMPTS, GROUP, PROMPT, RESPONSE = 2, 4, 32, 32
SHAPES = {"small": dict(n_prompts=2, group=4, prompt=32, response=32),
          "rl": dict(n_prompts=2, group=8, prompt=128, response=32)}
"""The tokens/s shapes: ``small`` (the host-sync counts' shape: decoding dominates) and ``rl``
(a GRPO-like group: more samples of a longer prompt, where prompt once reads and prefills
each prompt once)."""
SHORT, LONG = 4, 12
VOCAB = 256
HF_SHAPES = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
REPEATS = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository root (``cpu_times_across`` runs ``python -m benchmarks.decode`` there)."""

BEFORE = {
    "commit": "6190762",
    "decode_per_token": {"per_row": 5.0, "prompt_once": 7.0},
    "train_step": {"2": 35, "8": 65},
    "tokens_per_s": {"per_row": 2780, "prompt_once": 2370, "transformers": 4516},
}
"""The same measurements before the decode and replay checks went sync-free (main at
``commit``)."""


def tiny_llama(path: str):
    """A random tiny Llama (GQA, untied) saved to ``path``; returns the HF model (fp32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_SHAPES, rope_theta=10000.0, rms_norm_eps=1e-5,
                                         tie_word_embeddings=False,
                                         attn_implementation="sdpa"))
    model.save_pretrained(path)
    return model.eval()


def prompts(n_prompts: int = None, prompt: int = None) -> list:
    """``n_prompts`` random prompts of ``prompt`` tokens (default N_PROMPTS, PROMPT)."""
    gen = torch.Generator().manual_seed(1)
    shape = (n_prompts or N_PROMPTS, prompt or PROMPT)
    return torch.randint(1, VOCAB, shape, generator=gen).tolist()


def decode_modes(device) -> dict:
    """name -> ``generate`` arguments of the rollouts measured on ``device``: per row; prompt
    once as on ``device`` (``prompt_kv`` by device: on CPU each prompt's K/V copied into its
    rows' caches after the one prefill, elsewhere one shared copy); prompt once with the other
    ``prompt_kv`` (``prompt_once_shared`` on CPU), so that a run shows whether the device's
    default is the faster one."""
    from scalerlt_mcore.rl.rollout import PROMPT_KV, default_prompt_kv

    other = next(kv for kv in PROMPT_KV if kv != default_prompt_kv(device))
    return {"per_row": dict(prompt_once=False), "prompt_once": dict(prompt_once=True),
            f"prompt_once_{other}": dict(prompt_once=True, prompt_kv=other)}


def _rollout(model, batch: list, steps: int, mode: dict, group: int = None,
             stop_check_interval: int = None, **kwargs):
    """A greedy rollout of ``batch``; ``mode``: one of ``decode_modes``."""
    from scalerlt_mcore.rl.rollout import Sampling, generate

    sampling = Sampling(temperature=0.0, stop_check_interval=stop_check_interval)
    return generate(model, batch, group or GROUP, steps, eos_id=VOCAB, pad_id=0,
                    sampling=sampling, **mode, **kwargs)


def syncs_per_token(model, mode: dict, **kwargs) -> float:
    """Steady-state host syncs per decoded token of a greedy rollout."""
    from scalerlt_mcore.model.host_syncs import count_host_syncs

    batch = prompts()
    kwargs.setdefault("stop_check_interval", LONG + 1)  # counted apart (stop_check_per_token)
    counts = [count_host_syncs(_rollout, model, batch, n, mode, **kwargs)[1].total
              for n in (SHORT, LONG)]
    return (counts[1] - counts[0]) / (LONG - SHORT)


def tokens_per_s(runs: dict, tokens: int) -> dict:
    """name -> response tokens/s of each rollout function (``tokens`` response tokens a run),
    the best of ``REPEATS`` in wall time (``best_seconds``)."""
    return {name: tokens / s for name, s in best_seconds(runs, REPEATS).items()}


def best_seconds(runs: dict, repeats: int, clock=time.perf_counter) -> dict:
    """name -> the fewest seconds of ``clock`` one call of each function took, the best of
    ``repeats`` after a warm-up round, the functions interleaved (a shared host's load
    drifts)."""
    best = dict.fromkeys(runs, float("inf"))
    for rep in range(repeats + 1):
        for name, fn in runs.items():
            t0 = clock()
            fn()
            if rep:  # the first round is the warm-up
                best[name] = min(best[name], clock() - t0)
    return best


def hf_rollout(hf, n_prompts: int = None, group: int = None, prompt: int = None,
               response: int = None):
    """transformers ``generate``: greedy, static cache, exactly ``response`` new tokens for
    each of the N * G rows (it has no prompt-once mode, and greedy takes no
    ``num_return_sequences``: the G rows of a prompt are repeated). Defaults: the module's
    N_PROMPTS, GROUP, PROMPT, RESPONSE."""
    rows = torch.tensor(prompts(n_prompts, prompt)).repeat_interleave(group or GROUP, dim=0)
    response = response or RESPONSE
    kwargs = dict(max_new_tokens=response, min_new_tokens=response, do_sample=False,
                  cache_implementation="static", pad_token_id=0, eos_token_id=None)

    def run():
        with torch.no_grad():
            return hf.generate(rows, attention_mask=torch.ones_like(rows), **kwargs)

    return run


def greedy_agrees(model, hf) -> bool:
    """The project's greedy tokens equal transformers' on these weights (per row)."""
    ours = _rollout(model, prompts(), SHORT, dict(prompt_once=False)).responses.reshape(
        -1, SHORT)
    rows = torch.tensor(prompts()).repeat_interleave(GROUP, dim=0)
    with torch.no_grad():
        theirs = hf.generate(rows, attention_mask=torch.ones_like(rows), max_new_tokens=SHORT,
                             min_new_tokens=SHORT, do_sample=False, pad_token_id=0,
                             eos_token_id=None)[:, PROMPT:]
    return bool(torch.equal(ours, theirs))


def train_step_syncs(waves: int, device="cpu") -> int:
    """Host syncs of one joint-replay step of one group of ``waves`` waves of 2 on
    ``device``."""
    from scalerlt_mcore.model.host_syncs import count_host_syncs

    from .schedules import joint_step
    from .workloads import Workload, attach_old_logprobs, build_model, make_group, objective

    wl = Workload("syncs", group_size=2 * waves, prompt_length=8, response_length=4,
                  wave_size=2, num_loops=2, core_layers=1, hidden=32, heads=2)
    model = build_model(wl).to(device)
    group = attach_old_logprobs(model, make_group(wl, device=device))
    return count_host_syncs(joint_step, model, group, objective(), 2)[1].total


def _paths(model) -> dict:
    """Keyword arguments of ``generate`` that select each cache-attention path (empty when
    this version has no switch)."""
    import inspect

    from scalerlt_mcore.rl.rollout import generate

    if "static_cache" not in inspect.signature(generate).parameters:
        return {"default": {}}
    return {"static": {"static_cache": True}, "sliced": {"static_cache": False}}


def shape_speeds(model, hf, modes: dict, n_prompts: int, group: int, prompt: int,
                 response: int) -> dict:
    """mode -> {project path: tokens/s, "transformers": tokens/s} at one shape."""
    batch = prompts(n_prompts, prompt)
    runs = {"transformers": hf_rollout(hf, n_prompts, group, prompt, response)}
    for mode, kwargs in modes.items():
        for path, kw in _paths(model).items():
            runs[f"{mode}/project_{path}"] = partial(_rollout, model, batch, response, kwargs,
                                                     group, **kw)
    speeds = tokens_per_s(runs, n_prompts * group * response)
    return {m: {**{k.split("/")[1]: v for k, v in speeds.items() if k.startswith(m + "/")},
                "transformers": speeds["transformers"]}
            for m in modes}


def cpu_times(model, hf, repeats: int) -> dict:
    """shape -> {"transformers", each of ``decode_modes("cpu")``: ms}: process CPU time on
    one thread of one rollout (sliced cache), the best of ``repeats`` (``best_seconds``;
    steadier than wall time on a shared host; ``--cpu-time``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for name, sh in SHAPES.items():
            batch = prompts(sh["n_prompts"], sh["prompt"])
            runs = {"transformers": hf_rollout(hf, sh["n_prompts"], sh["group"], sh["prompt"],
                                               sh["response"])}
            for mode, kwargs in decode_modes("cpu").items():
                runs[mode] = partial(_rollout, model, batch, sh["response"], kwargs, sh["group"],
                                     static_cache=False)
            best = best_seconds(runs, repeats, time.process_time)
            out[name] = {key: round(s * 1e3, 1) for key, s in best.items()}
    finally:
        torch.set_num_threads(threads)
    return out


def cpu_times_across(processes: int, repeats: int) -> dict:
    """``cpu_times`` in ``processes`` fresh interpreters, one after another: shape -> path ->
    {"median", "min", "max"} of their bests (ms) and the speed ratios
    (``summarize_cpu_times``). On a shared host one process's times move by a third against the
    next one's (the allocator's layout, the neighbours' load), more than the paths differ;
    the median over processes is the figure (``--cpu-time N --processes K``)."""
    runs = []
    for _ in range(processes):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            done = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--cpu-time",
                                   str(repeats), "--json-to", f.name], capture_output=True,
                                  text=True, cwd=ROOT)
            if done.returncode:
                raise RuntimeError(f"cpu_times process failed (rc {done.returncode}):\n"
                                   f"{done.stderr[-2000:]}")
            runs.append(json.load(f))
    return {**summarize_cpu_times(runs), "processes": processes, "repeats": repeats}


def summarize_cpu_times(runs: list) -> dict:
    """``cpu_times`` results of several processes -> shape -> path -> {"median", "min",
    "max"} (ms), and ``speed_vs_transformers`` -> shape -> path: transformers' median time
    over the path's (above 1: the project is faster)."""
    out = {shape: {path: _spread([r[shape][path] for r in runs]) for path in runs[0][shape]}
           for shape in runs[0]}
    out["speed_vs_transformers"] = {
        shape: {path: round(paths["transformers"]["median"] / v["median"], 3)
                for path, v in paths.items() if path != "transformers"}
        for shape, paths in out.items()}
    return out


def _spread(values: list) -> dict:
    return {"median": round(statistics.median(values), 1), "min": min(values),
            "max": max(values)}


def _models(tmp: str) -> tuple:
    from scalerlt_mcore.model.hf_import import looped_gpt_from_hf

    hf = tiny_llama(tmp)
    return looped_gpt_from_hf(tmp, num_loops=1, max_sequence_length=256,
                              use_cpu_initialization=True).eval(), hf


def run_decode_bench() -> dict:
    from scalerlt_mcore.rl.rollout import default_stop_check_interval

    with tempfile.TemporaryDirectory() as tmp:
        model, hf = _models(tmp)
    modes = decode_modes("cpu")
    out = {
        "decode_per_token": {m: syncs_per_token(model, kw) for m, kw in modes.items()},
        "stop_check_per_token": {d: 1 / default_stop_check_interval(d) for d in ("cpu", "cuda")},
        "train_step": {str(w): train_step_syncs(w) for w in (2, 8)},
        "greedy_equals_transformers": greedy_agrees(model, hf),
        "tokens_per_s": {name: shape_speeds(model, hf, modes, **shape)
                         for name, shape in SHAPES.items()},
        "shape": dict(shapes=SHAPES, threads=torch.get_num_threads(), **HF_SHAPES),
        "before": BEFORE,
    }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--cpu-time", type=int, metavar="N", default=0,
                        help="only the one-thread process CPU times (ms) of transformers, "
                             "per row and prompt once, best of N (cpu_times)")
    parser.add_argument("--processes", type=int, metavar="K", default=0,
                        help="with --cpu-time: the median of K fresh processes' times, merged "
                             "into cpu.json under decode_cpu_ms (cpu_times_across)")
    parser.add_argument("--json-to", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpu_time and args.processes:
        result = cpu_times_across(args.processes, args.cpu_time)
        print(json.dumps(result, indent=1))
        if not args.no_write:
            merge_into(os.path.join(args.out, "cpu.json"), result, "decode_cpu_ms")
        return 0
    from scalerlt_mcore.testing import model_parallel_context

    with model_parallel_context(seed=0):
        if args.cpu_time:
            with tempfile.TemporaryDirectory() as tmp:
                times = cpu_times(*_models(tmp), args.cpu_time)
            if args.json_to:
                with open(args.json_to, "w") as f:
                    json.dump(times, f)
            print(json.dumps(times, indent=1))
            return 0
        result = run_decode_bench()
    print(json.dumps(result, indent=1))
    if not args.no_write:
        merge_into(os.path.join(args.out, "cpu.json"), result)
    return 0


def merge_into(path: str, result: dict, key: str = "host_syncs") -> None:
    """Store ``result`` under ``key`` in ``path`` (created when missing)."""
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[key] = result
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
