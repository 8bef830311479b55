"""Prompt-length sweep (P = 128 .. 2048 at fixed G, S): where the retained prompt beats the
recomputed one in wall time, its saved bytes beside recompute's (measured and predicted), and
the plan (wave size, prompt mode) the planner picks under each of several memory budgets."""

import time
from dataclasses import asdict

import torch

from scalerlt_mcore.shared_prefix.planner import GroupPlan, ModelShape, Planner, plan_memory

from .measure import check_agreement, median, peak_saved_bytes, time_round_robin
from .schedules import joint_step
from .workloads import Workload, attach_old_logprobs, build_model, make_group, objective

PROMPT_LENGTHS = (128, 256, 512, 1024, 2048)
GROUP, RESPONSE, WAVE, HIDDEN, REPS = 8, 32, 4, 128, 3
BUDGETS_MIB = (24, 48, 96, 192)


def workload(P: int) -> Workload:
    return Workload(f"prompt_P{P}", group_size=GROUP, prompt_length=P,
                    response_length=RESPONSE, wave_size=WAVE, hidden=HIDDEN, heads=2,
                    repetitions=REPS)


def run_point(wl: Workload, seed: int = 0) -> dict:
    """Recompute vs retain at the workload's wave size (agreement, saved bytes, wall), and the
    planner's choice per budget."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = build_model(wl)
    group = attach_old_logprobs(model, make_group(wl, seed), seed)
    obj = objective()

    def step(prompt):
        def run():
            model.zero_grad(set_to_none=True)
            return joint_step(model, group, obj, wl.wave_size, prompt=prompt)
        return run

    steps = {"recompute": step("recompute"), "retain": step("retain")}
    agreement = check_agreement(steps, model, reference="recompute",
                                loss_scale=float(group.advantages.abs().mean()))
    saved = {n: peak_saved_bytes(s, model) for n, s in steps.items()}
    times = time_round_robin(steps, wl.repetitions)
    shape = ModelShape.from_model(model)
    P, S, G = wl.prompt_length, wl.response_length, wl.group_size
    loss_bytes = obj.saved_per_position  # the RL loss's saved tensors per position
    predicted = {n: plan_memory(shape, P, S, G, GroupPlan(wl.wave_size, retain=n == "retain"),
                                loss_per_position=loss_bytes)
                 for n in steps}
    wall = {n: median(t) for n, t in times.items()}
    return {"prompt_length": P, "group_size": G, "response_length": S,
            "wave_size": wl.wave_size, "wall_s": wall, "wall_all_s": times,
            "recompute_over_retain_wall": wall["recompute"] / wall["retain"],
            "saved_bytes": saved,
            "predicted_saved_bytes": {n: e.saved_bytes for n, e in predicted.items()},
            "predicted_peak_bytes": {n: e.peak_bytes for n, e in predicted.items()},
            "plans": _plans(shape, group, model, loss_bytes),
            "agreement_max_rel_err": agreement,
            "bench_seconds": time.perf_counter() - t0}


def _plans(shape: ModelShape, group, model, loss_bytes: float) -> list:
    """Per budget: the planner's plan for this group (None: no plan fits) and its peak;
    ``loss_bytes``: the loss's saved tensors per position."""
    out = []
    P, G = group.prompt_length, group.group_size
    S = group.tokens.shape[1] - P
    for mib in BUDGETS_MIB:
        try:
            plan = Planner("auto", "auto", mib * 2**20,
                           loss_per_position=loss_bytes)(group, model)
        except ValueError:
            out.append({"budget_mib": mib, "plan": None, "peak_bytes": None})
            continue
        peak = plan_memory(shape, P, S, G, plan, loss_per_position=loss_bytes).peak_bytes
        out.append({"budget_mib": mib, "plan": asdict(plan), "peak_bytes": peak})
    return out


def run_sweep(seed: int = 0, log=print) -> list:
    rows = []
    for P in PROMPT_LENGTHS:
        row = run_point(workload(P), seed)
        log(f"[prompt P={P}] {row['bench_seconds']:.0f}s recompute/retain wall "
            f"{row['recompute_over_retain_wall']:.2f}, saved MiB "
            f"{row['saved_bytes']['recompute'] / 2**20:.1f} / "
            f"{row['saved_bytes']['retain'] / 2**20:.1f}; plans "
            + ", ".join(_plan_text(p) for p in row["plans"]), flush=True)
        rows.append(row)
    return rows


def _plan_text(p: dict) -> str:
    if p["plan"] is None:
        return f"{p['budget_mib']} MiB: none fits"
    mode = "retain" if p["plan"]["retain"] else "recompute"
    return f"{p['budget_mib']} MiB: W={p['plan']['wave_size']} {mode}"
