"""One workload end to end: build, check agreement with naive, count, probe, time."""

import time
from dataclasses import asdict

import torch

from .measure import check_agreement, count_flops, peak_saved_bytes, time_round_robin
from .report import workload_result
from .schedules import auto_planner, step_functions
from .workloads import attach_old_logprobs, build_model, make_group, objective


def run_workload(wl, seed: int = 0, log=print) -> dict:
    """CPU fp32: agreement (aborts on mismatch), FLOPs, saved bytes, round-robin wall time."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = build_model(wl)
    group = attach_old_logprobs(model, make_group(wl, seed), seed)
    planner = auto_planner(model, group, wl.wave_size) if wl.variants else None
    steps = step_functions(model, group, objective(), wl.wave_size, planner=planner,
                           variants=wl.variants)
    # raises AgreementError: nothing is timed
    agreement = check_agreement(steps, model, loss_scale=float(group.advantages.abs().mean()))
    counted = {n: count_flops(s) for n, s in steps.items()}
    saved = {n: peak_saved_bytes(s, model) for n, s in steps.items()}
    times = time_round_robin(steps, wl.repetitions)
    result = workload_result(wl, counted, saved, times, agreement)
    if planner is not None:
        result["auto_plan"] = asdict(planner(group, model))
        result["auto_cost_model"] = asdict(planner.cost_model)
    result["bench_seconds"] = time.perf_counter() - t0
    nj, auto = result["naive_over_joint"], result.get("auto_over_fastest_wall", float("nan"))
    log(f"[{wl.name}] {result['bench_seconds']:.0f}s  naive/{result['joint_variant']} flops "
        f"(causal) {nj['flops_causal'] or float('nan'):.2f} saved {nj['saved_bytes']:.2f} "
        f"wall {nj['wall']:.2f} auto/fastest {auto:.2f}"
        f"  | max rel err {max((e['grad'] for e in agreement.values()), default=0):.1e}",
        flush=True)
    return result
