"""CPU benchmark: naive (one microbatch of G; G microbatches of one) vs packed tree mask vs
joint replay, one process, same model and data.

``python -m benchmarks.run [--only A,B,rl_step,host_syncs,tree] [--no-sweep] [--no-prompt-sweep]
[--no-rl-step] [--no-decode] [--no-tree] [--out ...]``
Writes cpu.json, cpu.md and cpu.png, and prints the table. Aborts (non-zero exit) if any
schedule's loss or gradients differ from naive training's by more than 1e-5 (fp32, relative
to each tensor's max). ``rl_step`` (benchmarks/rl_step.py): the main job's whole RL step,
naive vs joint, on the long-prompt task; stored under ``rl_step`` in cpu.json. ``host_syncs``
(benchmarks/decode.py): host syncs per decoded token and training step, decode tokens/s
against transformers; stored under ``host_syncs``. ``tree`` (benchmarks/tree.py): a depth-3
prefix tree, naive rows vs packed tree mask vs joint replay over the tree; stored under
``tree``.
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


METHOD = "docs/benchmarks.md"
"""Where the model, the loss, the FLOP and byte counts and the timing are described."""


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
    parser.add_argument("--no-tree", action="store_true",
                        help="skip the prefix-tree workload (benchmarks/tree.py)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    for category in (UserWarning, DeprecationWarning, FutureWarning):  # MCore's import notes
        warnings.filterwarnings("ignore", category=category)
    from scalerlt_mcore.testing import model_parallel_context

    from .harness import run_workload
    from .measure import AgreementError
    from .prompt_sweep import run_sweep

    workloads = list(HEADLINE) + [DEMO] + ([] if args.no_sweep else sweep_workloads())
    rl_step, decode, tree = not args.no_rl_step, not args.no_decode, not args.no_tree
    if args.only:
        keep = set(args.only.split(","))
        workloads = [w for w in workloads if w.name in keep]
        rl_step = rl_step and "rl_step" in keep
        decode = decode and "host_syncs" in keep
        tree = tree and "tree" in keep
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
        if tree:
            from . import tree as tree_bench

            try:
                extra["tree"] = tree_bench.run_tree_bench(tree_bench.TREE, seed=args.seed)
            except AgreementError as err:
                return _abort(args.out, "tree", "ways disagree with naive training", err)
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
    notes = extra["rl_step"]["notes"] if "rl_step" in extra else []
    meta = {"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "dtype": "float32", "tolerance": TOLERANCE, "bench_seconds": total, "method": METHOD,
            "notes": notes}
    targets = check_targets({**results, **extra}) + extra.get("tree", {}).get("targets", [])
    meta["targets"] = targets
    os.makedirs(out, exist_ok=True)
    sweep = {"prompt_sweep": list(prompt_sweep)} if prompt_sweep else {}
    write_json(os.path.join(out, "cpu.json"), {**results, **extra, **sweep}, meta)
    preamble = (f"# CPU benchmark: naive vs packed tree mask vs joint replay\n\n"
                f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; "
                f"whole run {total:.0f} s. How each figure is measured: {METHOD}.\n\n"
                + "\n".join(f"- {n}" for n in notes))
    write_markdown(os.path.join(out, "cpu.md"), results, targets, preamble, prompt_sweep)
    if "rl_step" in extra:
        from .rl_step import MD_HEADING
        from .rl_step import markdown as rl_step_markdown

        with open(os.path.join(out, "cpu.md"), "a") as f:
            f.write(f"\n{MD_HEADING}\n\n{rl_step_markdown(extra['rl_step'])}\n")
    if "tree" in extra:
        from .tree import MD_HEADING as TREE_HEADING
        from .tree import markdown as tree_markdown

        with open(os.path.join(out, "cpu.md"), "a") as f:
            f.write(f"\n{TREE_HEADING}\n\n{tree_markdown(extra['tree'])}\n")
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
