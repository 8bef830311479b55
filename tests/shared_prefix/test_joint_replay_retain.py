"""The retained prompt and per-group plans are exact: same loss and gradients as NAIVE training
through stock MCore (tests/helpers/sp.py), fp64 <= 1e-12 and fp32 <= 1e-6 per tensor.

- ``prompt="retain"``: the prompt producer keeps its graph; the joint replay backpropagates the
  last wave's loss and the prefix adjoints through it (no recompute): the grid of
  tests/shared_prefix/test_joint_replay_exact.py again, two groups in one step, loss scaling;
- the prompt runs once forward under retain (twice under recompute), and the sync-enabled part
  of a step is one backward call whatever the plans;
- a chooser's plans (wave size, retain, naive full sequences) mixed within one step; each
  group's result dict reports its plan.
"""

import pytest
import torch
from helpers.calls import Calls
from helpers.replay_exact import DTYPES, GRID, TOL, _assert_close_rel, _case_id
from helpers.sp import LossSpec, build_model, grads, joint_step, make_group, naive_step, rel_errors

from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func
from scalerlt_mcore.shared_prefix.planner import GroupPlan


def _naive_grads(model, groups, spec, per_mb):
    model.zero_grad(set_to_none=True)
    losses, _ = naive_step(model, groups, spec, per_mb)
    return losses, grads(model)


@pytest.mark.parametrize("row", GRID, ids=[_case_id(r) for r in GRID])
def test_retained_prompt_matches_naive_mcore(mcore_single, row):
    dt, G, W, R, arch, ck, norm, lw, kl, attn, mb = row
    dtype = DTYPES[dt]
    P, S = 7 + G % 4, 3 + G % 3
    model = build_model(R=R, arch=arch, attn=attn).to(dtype)
    group = make_group(G, P, S, R, seed=200 + G, dtype=dtype, kl=bool(kl), group_id=G)
    spec = LossSpec(normalization=norm, clip_low=0.2, clip_high=0.28, kl_coef=0.1 * kl,
                    loop_weights=lw, constant_length=11 if (norm, G) == ("constant", 1) else 0)
    wave = {"1": 1, "3": 3, "G": G}[W]
    losses, ref = _naive_grads(model, [group], spec, {"1": 1, "2": 2, "all": G}[mb])

    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, wave, checkpoint_waves=ck, prompt="retain")
    tol = TOL[dtype]
    assert int(out[0]["retain"]) == 1 and int(out[0]["num_waves"]) == -(-G // wave)
    _assert_close_rel(out[0]["loss"], losses[0], tol, "group loss")
    bad = {n: e for n, e in rel_errors(grads(model), ref).items() if e > tol}
    assert not bad, f"grads differ beyond {tol:.0e}: {bad}"


@pytest.mark.parametrize("ck", [False, True])
def test_two_groups_retained(mcore_single, ck):
    R = 2
    model = build_model(R=R, arch=True).double()
    groups = [make_group(5, 9, 4, R, seed=1, kl=True, group_id=3),
              make_group(4, 6, 6, R, seed=2, kl=True, group_id=4)]
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="progressive")
    losses, ref = _naive_grads(model, groups, spec, 2)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, groups, spec, 2, checkpoint_waves=ck, prompt="retain")
    for k in range(2):
        _assert_close_rel(out[k]["loss"], losses[k], 1e-12, f"group {k} loss")
    assert max(rel_errors(grads(model), ref).values()) <= 1e-12


@pytest.mark.parametrize("prompt,forwards", [("recompute", 2), ("retain", 1)])
def test_prompt_forwards_and_one_synced_backward(mcore_single, monkeypatch, prompt, forwards):
    """Per multi-wave group the prompt runs twice under recompute and once under retain; the
    step's sync-enabled part is one backward call (the earlier groups under no_sync)."""
    R, P = 2, 9
    model = build_model(R=R).double()
    groups = [make_group(5, P, 4, R, seed=s, group_id=s) for s in (1, 2, 3)]
    counter = Calls(model, monkeypatch)
    model.config.no_sync_func = counter.no_sync
    try:
        joint_step(model, groups, LossSpec(), 2, prompt=prompt)
    finally:
        model.config.no_sync_func = None
    assert counter.lengths.count(P) == forwards * len(groups)
    assert counter.synced == 1
    assert counter.unsynced == 3 * len(groups) - 1  # 3 waves per group, all but one backward


def test_mixed_plans_in_one_step_match_naive(mcore_single, monkeypatch):
    """A chooser's plans: naive full sequences, retain and recompute, in one step; the last
    group is naive (its last microbatch is the step's one sync-enabled backward)."""
    R = 2
    model = build_model(R=R, arch=True).double()
    groups = [make_group(5, 9, 4, R, seed=s, kl=True, group_id=s) for s in (1, 2, 3)]
    plans = {1: GroupPlan(2, retain=True), 2: GroupPlan(3), 3: GroupPlan(2, naive=True)}
    spec = LossSpec(normalization="token_mean", kl_coef=0.1, loop_weights="uniform")
    losses, ref = _naive_grads(model, groups, spec, 2)
    model.zero_grad(set_to_none=True)
    counter = Calls(model, monkeypatch)
    model.config.no_sync_func = counter.no_sync
    try:
        out = joint_step(model, groups, spec, 1, chooser=lambda g, m: plans[g.group_id])
    finally:
        model.config.no_sync_func = None
    assert counter.synced == 1
    for k, g in enumerate(groups):
        _assert_close_rel(out[k]["loss"], losses[k], 1e-12, f"group {k} loss")
        plan = plans[g.group_id]
        assert int(out[k]["wave_size"]) == plan.wave_size
        assert int(out[k]["retain"]) == plan.retain and int(out[k]["naive"]) == plan.naive
        assert int(out[k]["num_waves"]) == -(-5 // plan.wave_size)
    assert max(rel_errors(grads(model), ref).values()) <= 1e-12


def test_plan_arguments_are_checked(mcore_single):
    model = build_model(R=2).double()
    group = make_group(3, 6, 3, 2, seed=1)
    with pytest.raises(TypeError, match="chooser must return a GroupPlan, got tuple"):
        joint_step(model, [group], LossSpec(), 2, chooser=lambda g, m: (2, True))
    with pytest.raises(ValueError, match="wave_size must be >= 1, got 0"):
        get_shared_prefix_forward_backward_func(0)
    for bad in ("two", 1.5, True):
        with pytest.raises(ValueError, match="wave_size must be an integer >= 1 or 'auto'"):
            get_shared_prefix_forward_backward_func(bad)
    with pytest.raises(ValueError, match="prompt must be one of"):
        get_shared_prefix_forward_backward_func(2, prompt="keep")
    with pytest.raises(ValueError, match="memory_budget must be set when the wave size is 'auto'"):
        get_shared_prefix_forward_backward_func("auto")
    with pytest.raises(ValueError, match="GroupPlan.wave_size must be an integer >= 1"):
        GroupPlan(0)
    with pytest.raises(ValueError, match=r"a chooser replaces the schedule's planner: give "
                       r"\['memory_budget'\] to it"):
        get_shared_prefix_forward_backward_func(2, chooser=lambda g, m: GroupPlan(2),
                                                memory_budget=1.0)


# ---- the guards and bf16 hold under retain ----------------------------------------------------


@pytest.mark.parametrize("name", ["tokens", "labels", "advantages", "old_logprobs"])
def test_retained_step_verifies_inputs_before_the_final_backward(mcore_single, name):
    """A field changed after the waves is caught before the joint replay's backward through the
    retained prompt graph: no gradient of that backward arrives (as under recompute,
    tests/shared_prefix/test_joint_replay_inputs.py)."""
    from helpers.replay_inputs import GID, MUTATIONS, Recorder, W, _group

    from scalerlt_mcore.shared_prefix import ReplayInputError

    model = build_model(R=2, arch=True).double()
    rec = Recorder(model, at_wave=2, action=MUTATIONS[name])
    with pytest.raises(ReplayInputError) as info:
        joint_step(model, [_group()], LossSpec(kl_coef=0.1), W, prompt="retain",
                   phase_callback=rec)
    msg = str(info.value)
    assert f"'{name}'" in msg and f"group {GID}" in msg and "joint replay" in msg, msg
    assert "discard" in msg  # the refused-step contract
    assert rec.calls == ["prompt_producer", "wave", "wave"], rec.calls
    after = grads(model)
    for n, g in rec.grads_at_action.items():
        assert torch.equal(after[n], g), f"{n} changed after phase 2"


def test_retained_prompt_bf16_within_bf16_rounding(mcore_single):
    """bf16 model, fp32 adjoint leaves, retained bf16 prompt graph: the bounds of
    tests/shared_prefix/test_joint_replay_bf16.py against naive fp32 training through stock
    MCore."""
    from helpers.replay_bf16 import (
        BF16_TOL,
        CASES,
        L2_FACTOR,
        SCHEDULE_FACTOR,
        P,
        S,
        _l2_rel,
        _twin_models,
    )

    R, arch, attn, G, W, ck, spec, per_mb = CASES[0]
    fp32, bf16 = _twin_models(R=R, arch=arch, attn=attn)
    group = make_group(G, P, S, R, seed=3, dtype=torch.float32, kl=spec.kl_coef > 0)
    naive_step(fp32, [group], spec, per_mb=G)
    ref = grads(fp32)
    naive_step(bf16, [group], spec, per_mb=per_mb)
    naive = grads(bf16)
    bf16.zero_grad(set_to_none=True)
    naive_step(bf16, [group], spec, per_mb=W)
    naive_waves = grads(bf16)
    bf16.zero_grad(set_to_none=True)
    joint_step(bf16, [group], spec, W, checkpoint_waves=ck, prompt="retain")
    joint = grads(bf16)
    e_joint, e_naive = rel_errors(joint, ref), rel_errors(naive, ref)
    assert max(e_joint.values()) <= BF16_TOL, e_joint
    assert max(e_joint.values()) <= SCHEDULE_FACTOR * max(e_naive.values())
    assert _l2_rel(joint, ref) <= L2_FACTOR * _l2_rel(naive_waves, ref)
