"""The subdivided replay (``GroupPlan.prompt_segments`` > 1, ``replay._train_subdivided``): the
prompt replayed in query segments, each in a backward of its own, is exact and holds less.

- Exact: loss and gradients of NAIVE training through stock MCore (tests/helpers/sp.py), fp64
  <= 1e-12 per tensor, for segment counts from 2 to one per prompt token x wave sizes, with
  checkpointed waves, loop credit and KL, two groups in one step; with truncated backprop, the
  exit gate and activation recompute (against a twin without recompute); at TP = 2. MCore DDP
  with overlapped reduction and the distributed optimizer:
  tests/shared_prefix/test_joint_replay_ddp.py.
- The step's sync-enabled part is still one backward call, and the prompt's segments run
  twice (producer and replay), the whole prompt never.
- It holds less: the ``SavedTensorProbe`` peak of a step falls below the one-segment replay's
  and below naive training with one response per microbatch.
- The planner's prediction (``planner.subdivided_memory``) is within 10% of the probe for the
  GPT layout and every public family, f32 and bf16, with and without activation recompute,
  with truncated backprop and the exit gate; with a budget that no whole-prompt plan fits, the
  planner subdivides (the fewest segments, the largest wave), the measured peak fits and the
  step is exact; a fixed segment count is refused with a retained prompt. A tree's root:
  tests/shared_prefix/test_tree_subdivided.py.
"""

import pytest
import torch
from helpers.calls import Calls
from helpers.exit_gate import _gated, _joint, _naive
from helpers.families import BUILDERS, SETTINGS
from helpers.sp import LossSpec, build_model, grads, joint_step, make_group, naive_step, rel_errors

from scalerlt_mcore.model.config import FieldError
from scalerlt_mcore.shared_prefix import SavedTensorProbe
from scalerlt_mcore.shared_prefix.planner import GroupPlan, ModelShape, Planner, plan_memory
from scalerlt_mcore.shared_prefix.replay import segment_bounds
from scalerlt_mcore.testing import run_distributed

TOL = 1e-12


def _plan(W: int, segments: int):
    return lambda group, model: GroupPlan(W, prompt_segments=segments)


def _naive_grads(model, groups, spec, per_mb=2):
    model.zero_grad(set_to_none=True)
    losses, _ = naive_step(model, groups, spec, per_mb)
    return losses, grads(model)


def _assert_exact(out, losses, got, ref):
    for k, loss in enumerate(losses):
        assert abs(float(out[k]["loss"]) - float(loss)) <= TOL * abs(float(loss)), k
    bad = {n: e for n, e in rel_errors(got, ref).items() if e > TOL}
    assert not bad, f"grads differ beyond {TOL:.0e}: {bad}"


def test_segment_bounds():
    assert segment_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert segment_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert segment_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]  # at most one per position


@pytest.mark.parametrize("segments", [2, 3, 9])
@pytest.mark.parametrize("W", [1, 2, 5])
@pytest.mark.parametrize("ck", [False, True], ids=["plain", "ckpt"])
def test_matches_naive_mcore(mcore_single, segments, W, ck):
    R = 3
    model = build_model(R=R, arch=True).double()
    group = make_group(5, 9, 4, R, seed=11 + W, kl=True, group_id=7)
    spec = LossSpec(normalization="seq_mean", clip_low=0.2, clip_high=0.28, kl_coef=0.1,
                    loop_weights="progressive")
    losses, ref = _naive_grads(model, [group], spec)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, W, checkpoint_waves=ck, chooser=_plan(W, segments))
    assert int(out[0]["num_waves"]) == -(-5 // W)
    _assert_exact(out, losses, grads(model), ref)


def test_two_groups_and_scoring(mcore_single):
    """Two groups in one step (the second's first segment the step's last backward); scoring
    under the plan gives the log-probs its training forward computes."""
    R = 2
    model = build_model(R=R, arch=True).double()
    groups = [make_group(5, 9, 4, R, seed=1, kl=True, group_id=3),
              make_group(4, 6, 6, R, seed=2, kl=True, group_id=4)]
    spec = LossSpec(normalization="token_mean", kl_coef=0.05, loop_weights="uniform")
    losses, ref = _naive_grads(model, groups, spec)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, groups, spec, 2, chooser=_plan(2, 3))
    _assert_exact(out, losses, grads(model), ref)
    scored = joint_step(model, groups, spec, 2, forward_only=True, chooser=_plan(2, 3))
    plain = joint_step(model, groups, spec, 2, forward_only=True, prompt="recompute")
    for a, b in zip(scored, plain):
        torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=1e-13, atol=1e-13)


def test_segments_run_twice_and_one_backward_syncs(mcore_single, monkeypatch):
    """P = 10 in 3 segments (4, 3, 3): each segment runs in the producer and in its replay, the
    whole prompt never; 3 waves and 2 segment replays backpropagate inside no_sync, the first
    segment's replay is the one synced backward."""
    R = 2
    model = build_model(R=R).double()
    group = make_group(5, 10, 6, R, seed=3)
    calls = Calls(model, monkeypatch)
    model.config.no_sync_func = calls.no_sync
    try:
        joint_step(model, [group], LossSpec(), 2, chooser=_plan(2, 3))
    finally:
        model.config.no_sync_func = None
    prompt = [n for n in calls.lengths if n != 5]  # the waves run S - 1 = 5 tokens
    assert prompt == [4, 3, 3, 3, 3, 4], calls.lengths
    assert (calls.unsynced, calls.synced) == (5, 1)


@pytest.mark.parametrize("k", [1, 2])
def test_truncated_backprop_matches_naive(mcore_single, k):
    """R = 3, the last k loops trained: the graph-free depths get no adjoint and are not
    replayed with grad."""
    R = 3
    model = build_model(R=R, arch=True, looped_backprop_loops=k).double()
    group = make_group(5, 9, 4, R, seed=21, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="uniform")
    losses, ref = _naive_grads(model, [group], spec)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, 2, chooser=_plan(2, 3))
    cut = set() if k > 1 else {n for n, g in ref.items() if not g.abs().max()}
    ref = {n: g for n, g in ref.items() if n not in cut}
    got = {n: g for n, g in grads(model).items() if n not in cut}
    _assert_exact(out, losses, got, ref)


def test_exit_gate_matches_naive(mcore_single):
    R = 3
    model = _gated(R=R, arch=True).double()
    group = make_group(5, 9, 4, R, seed=22, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05)
    naive_loss = _naive(model, [group], spec, "exit_pdf", 0.5, 0.1, per_mb=2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = _joint(model, [group], spec, "exit_pdf", 0.5, 0.1, 2, False, chooser=_plan(2, 4))
    assert abs(float(out[0]["loss"]) - naive_loss) <= TOL * abs(naive_loss)
    bad = {n: e for n, e in rel_errors(grads(model), ref).items() if e > TOL}
    assert not bad, bad


@pytest.mark.parametrize("setting", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="selective"),
], ids=["full", "selective"])
def test_recompute_matches_naive_without_recompute(mcore_single, setting):
    R = 3
    reference = build_model(R=R, arch=True).double()
    model = build_model(R=R, arch=True, **setting).double()
    model.load_state_dict(reference.state_dict())
    group = make_group(5, 9, 4, R, seed=23, kl=True)
    spec = LossSpec(normalization="token_mean", kl_coef=0.05, loop_weights="progressive")
    losses, ref = _naive_grads(reference, [group], spec)
    out = joint_step(model, [group], spec, 2, chooser=_plan(2, 3))
    _assert_exact(out, losses, grads(model), ref)


def _tp_worker(rank: int, world_size: int) -> dict:
    """TP = 2 (GQA, 2 K/V groups split over the ranks), with and without full recompute."""
    worst = {}
    for setting in ({}, SETTINGS["full-uniform-1"]):
        torch.manual_seed(0)
        reference = build_model(R=2, arch=True, hidden=16, heads=4, num_query_groups=2,
                                tensor_model_parallel_size=2).double()
        model = build_model(R=2, arch=True, hidden=16, heads=4, num_query_groups=2,
                            tensor_model_parallel_size=2, **setting).double()
        model.load_state_dict(reference.state_dict())
        group = make_group(5, 9, 4, 2, seed=8, kl=True)
        spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="uniform")
        naive_step(reference, [group], spec, 2)
        joint_step(model, [group], spec, 2, chooser=_plan(2, 3))
        worst[str(setting)] = max(rel_errors(grads(model), grads(reference)).values())
    return worst


def test_tensor_parallel_2_matches_naive():
    for rank, worst in enumerate(run_distributed(_tp_worker, 2, tensor_model_parallel_size=2,
                                                 timeout=300)):
        assert max(worst.values()) <= TOL, (rank, worst)


def test_holds_less_than_one_segment_and_naive_mb1(mcore_single):
    """fp32, P 48, S 12, G 4, waves of 1: the peak saved bytes of the subdivided replay (4
    segments) against the one-segment replay and naive training one response per
    microbatch (the last wave's graph and one segment's beside the K/V leaves)."""
    R = 2
    model = build_model(R=R, hidden=64, heads=4)
    group = make_group(4, 48, 12, R, seed=5, dtype=torch.float32)
    spec = LossSpec()

    def peak(fn) -> int:
        model.zero_grad(set_to_none=True)
        with SavedTensorProbe() as probe:
            fn()
        return probe.peak_bytes

    naive_mb1 = peak(lambda: naive_step(model, [group], spec, 1))
    one = peak(lambda: joint_step(model, [group], spec, 1, prompt="recompute"))
    four = peak(lambda: joint_step(model, [group], spec, 1, chooser=_plan(1, 4)))
    print(f"\n[subdivided] peak saved bytes: naive mb1 {naive_mb1}, one segment {one}, "
          f"four {four}")
    assert four < 0.75 * one and four < 0.75 * naive_mb1


def test_plan_refuses_segments_with_a_retained_prompt():
    with pytest.raises(ValueError, match="prompt_segments 2 replays a recomputed prompt"):
        GroupPlan(2, retain=True, prompt_segments=2)
    with pytest.raises(ValueError, match="prompt_segments must be an integer >= 1, got 0"):
        GroupPlan(2, prompt_segments=0)


# ---- the planner -----------------------------------------------------------------------------

PREDICTION_RTOL = 0.10
MEASURED = {}
PLAN_CASES = [("arch-f32", None), ("arch-f32", "full-uniform-1"), ("arch-f32", "selective"),
              ("arch-concat-bf16", None), ("arch-concat-bf16", "full-uniform-1"),
              ("truncated-arch-bf16", None), ("exit-gate-truncated-bf16", "full-block-1"),
              ("rms-gqa-f32", "full-uniform-2"), ("ouro-f32", None), ("ouro-bf16", "selective"),
              ("huginn-truncated-f32", None), ("huginn-bf16", "full-uniform-1"),
              ("retrofit-f32", "selective"), ("nanbeige-bf16", None)]
SEGMENT_PLANS = (GroupPlan(2, prompt_segments=2), GroupPlan(1, prompt_segments=4),
                 GroupPlan(8, prompt_segments=3))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if MEASURED:
        low, high = (f(MEASURED, key=MEASURED.get) for f in (min, max))
        print(f"\n[subdivided plan] predicted / measured over {len(MEASURED)} plans: "
              f"{MEASURED[low]:.4f} ({low}) .. {MEASURED[high]:.4f} ({high})")


def _peak(model, step) -> int:
    model.zero_grad(set_to_none=True)
    with SavedTensorProbe(model) as probe:
        step()
    return probe.peak_bytes


@pytest.mark.parametrize("name,setting", PLAN_CASES, ids=[f"{b}-{s}" for b, s in PLAN_CASES])
def test_predicted_saved_bytes_within_10_percent(mcore_single, name, setting):
    model = BUILDERS[name](**SETTINGS.get(setting, {}))
    shape = ModelShape.from_model(model)
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    R = model.config.looped_num_loops
    for kl, (G, P, S) in enumerate(((4, 16, 6), (5, 40, 9))):
        spec = LossSpec(kl_coef=0.1 * kl, entropy_weight=0.1 * kl)
        group = make_group(G, P, S, R, seed=G, dtype=dtype, kl=bool(kl), vocab=model.vocab_size)
        for plan in SEGMENT_PLANS:
            got = _peak(model, lambda: joint_step(  # noqa: B023
                model, [group], spec, plan.wave_size, chooser=lambda g, m: plan))  # noqa: B023
            pred = plan_memory(shape, P, S, G, plan, False,
                               spec.objective().saved_per_position).saved_bytes
            MEASURED[(name, setting, P, plan.wave_size, plan.prompt_segments)] = pred / got
            assert abs(pred / got - 1) <= PREDICTION_RTOL, (
                f"{name} {setting} G={G} P={P} S={S} {plan}: predicted {pred} B, measured "
                f"{got} B ({pred / got:.3f})")


@pytest.mark.parametrize("setting", [None, "full-uniform-1"])
def test_a_budget_below_every_whole_prompt_plan_is_subdivided(mcore_single, setting):
    """The budget: halfway between the smallest whole-prompt plan (waves of 1, the prompt
    recomputed) and 4 segments at waves of 1. The planner picks the fewest segments that fit,
    at the largest wave that fits with them; the step's measured peak (saved bytes plus the
    prefix adjoints) is within the budget, and it is exact (fp64, against naive training
    without recompute)."""
    R, G, P, S = 2, 4, 48, 8
    reference = build_model(R=R, arch=True).double()
    model = build_model(R=R, arch=True, **SETTINGS.get(setting, {})).double()
    model.load_state_dict(reference.state_dict())
    m, loss = ModelShape.from_model(model), LossSpec().objective().saved_per_position

    def need(plan) -> int:
        return plan_memory(m, P, S, G, plan, False, loss).peak_bytes

    whole = min(need(GroupPlan(1)), need(GroupPlan(1, retain=True)))
    budget = (whole + need(GroupPlan(1, prompt_segments=4))) / 2
    group = make_group(G, P, S, R, seed=9)
    plan = Planner("auto", "auto", budget, loss_per_position=loss)(group, model)
    fits = [(n, W) for n in (2, 4) for W in range(G, 0, -1)
            if need(GroupPlan(W, prompt_segments=n)) <= budget]
    assert plan.prompt_segments > 1 and (plan.prompt_segments, plan.wave_size) == fits[0], (
        plan, fits)
    losses, ref = _naive_grads(reference, [group], LossSpec())
    got = _peak(model, lambda: joint_step(model, [group], LossSpec(), "auto", prompt="auto",
                                          memory_budget=budget, loss_per_position=loss))
    assert got + plan_memory(m, P, S, G, plan, False, loss).adjoint_bytes <= budget
    bad = {n: e for n, e in rel_errors(grads(model), ref).items() if e > TOL}
    assert not bad, bad


def test_fixed_segments_are_checked(mcore_single):
    with pytest.raises(FieldError, match="cannot go with prompt 'retain'"):
        Planner(2, "retain", prompt_segments=2)
    with pytest.raises(FieldError, match="must be an integer >= 1 or 'auto', got 0"):
        Planner(2, prompt_segments=0)
    model = build_model(R=2).double()
    plan = Planner(2, "auto", prompt_segments=3)(make_group(3, 9, 3, 2, seed=1), model)
    assert plan == GroupPlan(2, prompt_segments=3)
