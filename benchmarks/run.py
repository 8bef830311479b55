"""CPU benchmark: naive (one microbatch of G; G microbatches of one) vs packed tree mask vs
joint replay, one process, same model and data.

``python -m benchmarks.run [--only A,B,rl_step] [--no-sweep] [--no-prompt-sweep] [--no-rl-step]
[--out ...]``
Writes cpu.json, cpu.md and cpu.png, and prints the table. Aborts (non-zero exit) if any
schedule's loss or gradients differ from naive training's by more than 1e-5 (fp32, relative
to each tensor's max). ``rl_step`` (benchmarks/rl_step.py): the main job's whole RL step,
naive vs joint, on the long-prompt task; stored under ``rl_step`` in cpu.json. ``host_syncs``
(benchmarks/decode.py): host syncs per decoded token and training step, decode tokens/s
against transformers; stored under ``host_syncs``.
"""

import argparse
import os
import platform
import sys
import time
import warnings

import torch

from .workloads import Workload

HEADLINE = (
    Workload("A", group_size=8, prompt_length=512, response_length=128, wave_size=2,
             repetitions=7),
    Workload("B", group_size=16, prompt_length=512, response_length=64, wave_size=4,
             repetitions=7),
)
# The shipped demo config's model and a group like its rollouts (bos + 2-3 letters, answers of
# <= 4 tokens, 16 responses, waves of 8): ``auto`` must not be slower than naive there.
DEMO = Workload("demo", group_size=16, prompt_length=4, response_length=4, wave_size=8,
                num_loops=2, core_layers=2, hidden=64, heads=2, repetitions=15)
SWEEP_RESPONSE, SWEEP_HIDDEN, SWEEP_REPS = 32, 128, 3


def sweep_workloads() -> list:
    """G in {2, 4, 8, 16} x prompt:response in {1, 4, 8}, small so that it is fast."""
    out = []
    for ratio in (1, 4, 8):
        for G in (2, 4, 8, 16):
            out.append(Workload(f"sweep_G{G}_r{ratio}", group_size=G,
                                prompt_length=ratio * SWEEP_RESPONSE,
                                response_length=SWEEP_RESPONSE, wave_size=max(1, G // 4),
                                hidden=SWEEP_HIDDEN, heads=2, repetitions=SWEEP_REPS,
                                variants=False))
    return out


NOTES = [
    "Model: looped GPT (local MCore layer spec, fp32), no prelude/coda, learned absolute "
    "positions; A/B hidden 256, 4 heads (head dim 64), 2 core layers x 4 loops; sweep hidden "
    "128, 2 heads, response 32.",
    "Vocabulary 64 on purpose, so the readout (every loop reads out) does not dominate the "
    "layer work; with a real vocabulary the readout adds the same per-token cost to every "
    "schedule's response tokens, and naive also reads out every prompt position G times.",
    "Loss: PPO-clipped, token-mean over the whole group, progressive loop credit (all R "
    "readouts train); old log-probs = current policy + N(0, 0.05) noise.",
    "Naive baselines: `naive` runs all G full sequences in one microbatch; `naive_mb1` runs "
    "them as G microbatches of one (MCore's usual gradient accumulation): the same FLOPs, "
    "one sequence's activations held at a time.",
    "FLOPs: torch.utils.flop_counter.FlopCounterMode over one step (forward + backward), "
    "the no-grad prompt forward of joint replay included. PyTorch has no formula for the CPU "
    "SDPA kernel (it would count that attention as zero); the benchmark registers one. The "
    "primary figure, `flops_causal`, counts only the causal triangle of is_causal calls: the "
    "work a causal kernel does. `flops` (in brackets) is PyTorch's convention for its other "
    "SDPA kernels, the full score square, causal or not; targets are checked against the "
    "causal count. The tree mask is an explicit mask, counted in full by both. The cost table "
    "counts token-layer (linear) work only; every response token's attention to all P prompt "
    "keys (G*S*P pairs) is the same in every schedule, so with the causal count attention "
    "narrows the naive/joint gap below the table's ratio.",
    "Saved bytes: SavedTensorProbe peak (autograd-saved tensors, parameters excluded). The "
    "probe does not see activations recomputed in backward, so joint_ckpt's figure is a lower "
    "bound (its true peak adds one wave's recomputed activations); joint replay's prefix "
    "adjoints (gradients, not saved tensors) are reported apart as "
    "joint_prefix_adjoint_bytes.",
    "Wall: median of the timed repetitions after one warm-up; all schedules of a workload "
    "interleaved round-robin in one process, default torch threads; Python's garbage collection "
    "runs before each timed step and is off during it, for every schedule (Megatron-LM's "
    "`--manual-gc --manual-gc-interval 1`; the main job has the same flags). The host is "
    "shared: other "
    "jobs inflate single repetitions (wall_all_s holds them all; `wall_min` ratios, from the "
    "fastest repetitions, are given beside the median ones in the JSON). Joint replay runs "
    "n + 2 "
    "forward and n + 1 backward passes through the layer stack (n waves, the prompt twice) "
    "against naive's one each, on smaller matrices: at the sweep's small sizes the per-call "
    "cost dominates and its wall time can trail naive's even "
    "where its FLOPs are several times lower.",
    "Theory: docs/design.md cost table, token-layer forward = 1, backward = 2: naive 3G(P+S), "
    "tree 3P+3GS, joint 4P+3GS (+GS with checkpointed waves); held tokens naive G(P+S), "
    "naive_mb1 P+S, tree P+GS, joint P+WS (prompt replay + one wave).",
    "joint_retain: the prompt producer keeps its graph and the joint replay backpropagates "
    "through it (3P+3GS, the tree mask's FLOP limit). naive_over_joint compares naive with the "
    "joint-replay variant with the fewest FLOPs (causal count), then the fewest saved bytes "
    "(`joint_variant`): figures that are the same in every run; picking by wall time would "
    "pick whichever variant the host's noise favoured; "
    "naive_over_joint_recompute keeps the recomputed-prompt figures. `auto`: the planner picks "
    "joint replay (retain) or naive (all G in one microbatch) per group from a cost model "
    "calibrated on the model at the start (fixed cost per layer call + cost per FLOP); "
    "auto_over_fastest_wall is its wall time over the faster of naive and the best joint "
    "variant. Wall ratios are noisy on this shared host.",
    "Prompt-length sweep: G=8, S=32, W=4, hidden 128, 2 heads, 2 core layers x 4 loops; "
    "recompute vs retain (saved bytes measured, planner prediction in brackets) and the plan "
    "(largest wave, retain unless only recompute fits) per memory budget (activations + "
    "prefix adjoints).",
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated workload names")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-prompt-sweep", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-rl-step", action="store_true",
                        help="skip the whole-RL-step benchmark (benchmarks/rl_step.py)")
    parser.add_argument("--no-decode", action="store_true",
                        help="skip the host-sync and decode benchmark (benchmarks/decode.py)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    for category in (UserWarning, DeprecationWarning, FutureWarning):  # MCore's import notes
        warnings.filterwarnings("ignore", category=category)
    from scalerlt_mcore.testing import model_parallel_context

    from .harness import run_workload
    from .measure import AgreementError
    from .prompt_sweep import run_sweep

    workloads = list(HEADLINE) + [DEMO] + ([] if args.no_sweep else sweep_workloads())
    rl_step, decode = not args.no_rl_step, not args.no_decode
    if args.only:
        keep = set(args.only.split(","))
        workloads = [w for w in workloads if w.name in keep]
        rl_step = rl_step and "rl_step" in keep
        decode = decode and "host_syncs" in keep
    results, extra, prompt_sweep = {}, {}, []
    with model_parallel_context(seed=args.seed):
        for wl in workloads:
            try:
                results[wl.name] = run_workload(wl, seed=args.seed)
            except AgreementError as err:
                return _abort(args.out, wl.name, "schedules disagree with naive training", err)
        if not args.no_prompt_sweep:
            try:
                prompt_sweep = run_sweep(seed=args.seed)
            except AgreementError as err:
                return _abort(args.out, "prompt sweep", "retain disagrees with recompute", err)
        if rl_step:
            from .rl_step import run_rl_step

            extra["rl_step"] = run_rl_step(seed=args.seed)
        if decode:
            from .decode import run_decode_bench

            extra["host_syncs"] = run_decode_bench()
    total = time.perf_counter() - t0
    return _write(args.out, results, total, extra, prompt_sweep)


def _abort(out: str, name: str, what: str, err) -> int:
    """A disagreement: cpu.json holds the error and every schedule's measured errors (as
    benchmarks/gpu.py writes them), no table or plot is written; exit status 2."""
    from .measure import TOLERANCE
    from .report import write_json

    error = f"{name}: {what}: {err}"
    print(f"ABORT [{error}]", file=sys.stderr)
    meta = {"device": "cpu", "torch": torch.__version__, "dtype": "float32",
            "tolerance": TOLERANCE, "status": "failed", "error": error}
    write_json(os.path.join(out, "cpu.json"),
               {name: {"error": f"{what}: {err}", "agreement": err.errors}}, meta)
    return 2


def _write(out: str, results: dict, total: float, extra: dict = None,
           prompt_sweep: list = ()) -> int:
    """``extra``: entries beside the workloads (``rl_step``), stored and reported apart;
    ``prompt_sweep``: the prompt-length sweep's rows (``prompt_sweep`` in cpu.json)."""
    from .measure import TOLERANCE
    from .report import (
        check_targets,
        markdown_table,
        plot,
        prompt_sweep_table,
        retain_table,
        targets_table,
        write_json,
        write_markdown,
    )

    extra = extra or {}
    notes = NOTES + (extra["rl_step"]["notes"] if "rl_step" in extra else [])
    meta = {"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "dtype": "float32", "tolerance": TOLERANCE, "bench_seconds": total, "notes": notes}
    targets = check_targets({**results, **extra})
    meta["targets"] = targets
    os.makedirs(out, exist_ok=True)
    sweep = {"prompt_sweep": list(prompt_sweep)} if prompt_sweep else {}
    write_json(os.path.join(out, "cpu.json"), {**results, **extra, **sweep}, meta)
    preamble = (f"# CPU benchmark: naive vs packed tree mask vs joint replay\n\n"
                f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; "
                f"whole run {total:.0f} s.\n\n" + "\n".join(f"- {n}" for n in notes))
    write_markdown(os.path.join(out, "cpu.md"), results, targets, preamble, prompt_sweep)
    if "rl_step" in extra:
        from .rl_step import MD_HEADING
        from .rl_step import markdown as rl_step_markdown

        with open(os.path.join(out, "cpu.md"), "a") as f:
            f.write(f"\n{MD_HEADING}\n\n{rl_step_markdown(extra['rl_step'])}\n")
    plot(os.path.join(out, "cpu.png"), results, "CPU: naive / joint replay")
    print(markdown_table(results))
    print()
    print(retain_table(results))
    if prompt_sweep:
        print()
        print(prompt_sweep_table(prompt_sweep))
    print()
    print(targets_table(targets))
    print(f"\nwhole benchmark: {total:.0f} s; results in {out}/cpu.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
