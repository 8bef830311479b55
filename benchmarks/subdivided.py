"""Joint replay against naive micro-batch 1 in memory (``make bench``'s ``subdivided``:
benchmarks/results/subdivided.*).

The baseline a memory-bound Megatron user runs: naive training with one response per
microbatch (gradient accumulation over the G responses), at the same recompute setting. For
workloads A and B (benchmarks/run.py's model and groups, CPU fp32), without recompute and
with MCore's full recompute (``uniform``, 1 layer per chunk), per schedule: the peak of
``SavedTensorProbe`` (saved activations), the prefix adjoints beside it (gradients of the K/V
leaves, which the probe does not see; 0 for naive), their sum (the peak judged), its ratio to
naive micro-batch 1's, and the wall time of a step (median of ``REPS`` after a warm-up,
round-robin). Schedules: naive micro-batch 1; joint replay at the workload's wave size with
the prompt recomputed (one segment: the whole prompt's graph and the last wave's in one
backward); the same with the prompt replayed in 4 segments; waves of 1 in 4 and 8 segments;
the 4- and 8-segment ones with prefix states of layer inputs (``GroupPlan.state_kind``);
and ``planned``: the plan the planner picks itself for a budget of naive micro-batch 1's
measured peak (or, where none fits, the planner's refusal naming its smallest plan's need).
Every schedule's loss and gradients agree with naive micro-batch 1's (1e-5).

``python -m benchmarks.subdivided [--out DIR] [--only A,B]`` writes DIR/subdivided.{json,md}.
"""

import argparse
import json
import os
import time
import warnings
from dataclasses import asdict, replace

import torch

from .measure import check_agreement, median, peak_saved_bytes, time_round_robin
from .run import HEADLINE
from .workloads import attach_old_logprobs, build_model, make_group, objective

REPS = 3
SETTINGS = {"none": {}, "full": dict(recompute_granularity="full", recompute_method="uniform",
                                     recompute_num_layers=1)}


def plans(wl) -> dict:
    """Schedule name -> GroupPlan (None: naive micro-batch 1; "planned": the planner's)."""
    from scalerlt_mcore.shared_prefix.planner import GroupPlan

    W = wl.wave_size
    return {"naive_mb1": None, f"joint W{W}": GroupPlan(W),
            f"joint W{W}, 4 segments": GroupPlan(W, prompt_segments=4),
            "joint W1, 4 segments": GroupPlan(1, prompt_segments=4),
            "joint W1, 8 segments": GroupPlan(1, prompt_segments=8),
            f"joint W{W}, 4 segments, inputs": GroupPlan(W, prompt_segments=4, state_kind="inputs"),
            "joint W1, 8 segments, inputs": GroupPlan(1, prompt_segments=8, state_kind="inputs"),
            "planned": "planned"}


def _step(model, group, obj, plan):
    from scalerlt_mcore.rl.objective import rl_forward_step
    from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func, naive_step

    def run():
        model.zero_grad(set_to_none=True)
        if plan is None:
            out = naive_step([model], [group], rl_forward_step(obj), micro_batch_size=1)
            return sum(o["loss"] for o in out)
        schedule = get_shared_prefix_forward_backward_func(plan.wave_size,
                                                           chooser=lambda g, m: plan)
        out = schedule(forward_step_func=rl_forward_step(obj), data_iterator=iter([group]),
                       model=model, num_microbatches=1, seq_length=0, micro_batch_size=1)
        return out[0]["loss"].detach()
    return run


def run_setting(wl, setting: str, seed: int = 0, reps: int = REPS) -> dict:
    """One workload at one recompute setting: every schedule's peak, ratio and wall."""
    from scalerlt_mcore.shared_prefix.planner import (
        ModelShape,
        Planner,
        adjoint_bytes,
        plan_memory,
    )

    torch.manual_seed(seed)
    model = build_model(wl, **SETTINGS[setting])
    group = attach_old_logprobs(model, make_group(wl, seed), seed)
    obj, m = objective(), ModelShape.from_model(model)
    P, S, G = wl.prompt_length, wl.response_length, wl.group_size
    chosen = plans(wl)
    naive = _step(model, group, obj, None)
    baseline = peak_saved_bytes(naive, model)
    budget = Planner("auto", "auto", baseline, loss_per_position=obj.saved_per_position)
    try:
        chosen["planned"] = budget(group, model)
    except ValueError as e:  # no joint plan fits naive micro-batch 1's peak
        del chosen["planned"]
        refused = str(e)
    else:
        refused = None
    steps = {name: _step(model, group, obj, plan) for name, plan in chosen.items()}
    agreement = check_agreement(steps, model, reference="naive_mb1",
                                loss_scale=float(group.advantages.abs().mean()))
    walls = time_round_robin(steps, reps)  # after a warm-up round, garbage collection paused
    rows = {}
    for name, plan in chosen.items():
        saved = peak_saved_bytes(steps[name], model)
        predicted = None if plan is None else plan_memory(m, P, S, G, plan, False,
                                                          obj.saved_per_position).saved_bytes
        adjoints = 0 if plan is None else adjoint_bytes(replace(m, state_kind=plan.state_kind), P)
        rows[name] = {"plan": None if plan is None else asdict(plan), "saved_bytes": saved,
                      "adjoint_bytes": adjoints, "peak_bytes": saved + adjoints,
                      "predicted_saved_bytes": predicted, "wall_s": median(walls[name]),
                      "max_grad_error": agreement.get(name, {}).get("grad", 0.0)}
    for row in rows.values():
        row["peak_over_naive_mb1"] = row["peak_bytes"] / rows["naive_mb1"]["peak_bytes"]
        row["wall_over_naive_mb1"] = row["wall_s"] / rows["naive_mb1"]["wall_s"]
    return {"setting": setting, "budget_bytes": baseline, "rows": rows, "planned_refused": refused}


def markdown(results: dict) -> str:
    lines = ["| workload | recompute | schedule | plan | saved MiB | + adjoints MiB | peak / naive "
             "mb1 | wall s | wall / naive mb1 |", "|---|---|---|---|---|---|---|---|---|"]
    for name, per_setting in results.items():
        for setting, r in per_setting.items():
            for sched, row in r["rows"].items():
                plan = row["plan"]
                words = "-" if plan is None else (
                    f"W{plan['wave_size']}, {plan['prompt_segments']} seg."
                    + (", inputs" if plan["state_kind"] == "inputs" else ""))
                lines.append(f"| {name} | {setting} | {sched} | {words} | "
                             f"{row['saved_bytes'] / 2**20:.1f} | "
                             f"{row['adjoint_bytes'] / 2**20:.1f} | "
                             f"{row['peak_over_naive_mb1']:.2f} | {row['wall_s']:.3f} | "
                             f"{row['wall_over_naive_mb1']:.2f} |")
            if r["planned_refused"]:
                lines.append(f"| {name} | {setting} | planned | none fits: "
                             f"{r['planned_refused'].split('; ')[-1]} | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--only", default="A,B", help="comma-separated workloads of run.py")
    parser.add_argument("--reps", type=int, default=REPS)
    args = parser.parse_args(argv)
    for category in (UserWarning, DeprecationWarning, FutureWarning):  # MCore's import notes
        warnings.filterwarnings("ignore", category=category)
    from scalerlt_mcore.testing import model_parallel_context

    t0, results = time.perf_counter(), {}
    workloads = [w for w in HEADLINE if w.name in args.only.split(",")]
    with model_parallel_context(seed=0):
        for wl in workloads:
            results[wl.name] = {s: run_setting(replace(wl), s, reps=args.reps)
                                for s in SETTINGS}
            print(f"[{wl.name}] done at {time.perf_counter() - t0:.0f}s", flush=True)
    table = markdown(results)
    os.makedirs(args.out, exist_ok=True)
    meta = {"seconds": time.perf_counter() - t0, "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    with open(os.path.join(args.out, "subdivided.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(args.out, "subdivided.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
