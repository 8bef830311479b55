"""Prefix states of kind ``inputs`` (``GroupPlan.state_kind``, ``PrefixState.inputs``): each
depth keeps the attention's input instead of its K and V, and every suffix derives the prefix
K/V from it again (the layer's own projection, norms and RoPE).

- Exact: joint replay with such states (one-level and tree, waves, prompt segments, the prompt
  retained, checkpointed waves) has the loss and gradients of naive training through stock
  MCore's schedule of the same weights without recompute, fp64 <= 1e-12 relative per tensor,
  under no, full and selective recompute, with truncated backprop, with the exit gate, for
  the public families, and at TP = 2.
- Half the state with MHA: the state's numel and the planner's adjoint bytes.
- The planner's saved-bytes prediction for it is held within 10% in
  tests/shared_prefix/test_planner.py and test_recompute_plan.py; where no K/V plan fits the
  budget the planner picks one of inputs, which fits as measured and is exact.
- Bad kinds are refused by name. Recorded exit depths with this kind: test_exit_depths.py.
"""

import dataclasses

import pytest
import torch
from helpers.exit_gate import _gated, _joint, _naive
from helpers.families import BUILDERS
from helpers.sp import (
    LossSpec,
    build_model,
    grads,
    joint_step,
    make_group,
    naive_step,
    rel_errors_with_zeros,
)
from helpers.tree import DEPTH2, tree_group

from scalerlt_mcore.shared_prefix import SavedTensorProbe
from scalerlt_mcore.shared_prefix.planner import (
    GroupPlan,
    ModelShape,
    Planner,
    adjoint_bytes,
    plan_memory,
)
from scalerlt_mcore.testing import run_distributed

TOL = 1e-12
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"],
                      add_bias_linear=False),
}
PLANS = {
    "waves of 2": GroupPlan(2, state_kind="inputs"),
    "3 segments": GroupPlan(1, prompt_segments=3, state_kind="inputs"),
    "retained": GroupPlan(2, retain=True, state_kind="inputs"),
}


def _pair(build, setting: str) -> tuple:
    """(a model without recompute, its twin with ``setting`` and the same weights), fp64."""
    extra = dict(RECOMPUTE[setting])
    shape = {k: v for k, v in extra.items() if not k.startswith("recompute_")}
    reference = build(**shape).double()
    model = build(**extra).double()
    model.load_state_dict(reference.state_dict())
    return reference, model


def _group(shape: str, R: int, seed: int):
    return (tree_group(DEPTH2, R, seed=seed, kl=True) if shape == "tree"
            else make_group(5, 8, 4, R, seed=seed, kl=True))


def _worst(model, reference) -> float:
    """The largest relative gradient error; an exit gate the loss does not train (a family's
    gate under the plain RL loss) must have a zero gradient on both sides."""
    ref = grads(reference)
    gate = {n for n in ref if "exit_gate" in n and not ref[n].any()}
    return max(rel_errors_with_zeros(grads(model), ref, gate).values())


@pytest.mark.parametrize("shape", ["one-level", "tree"])
@pytest.mark.parametrize("setting", list(RECOMPUTE))
def test_matches_naive_without_recompute(mcore_single, setting, shape):
    """R = 3 with the last 2 loops trained; prelude, coda and injection."""
    R = 3
    reference, model = _pair(lambda **e: build_model(R=R, arch=True, looped_backprop_loops=2,
                                                     **e), setting)
    group = _group(shape, R, seed=5)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="uniform")
    naive = float(naive_step(reference, [group], spec, 2)[0][0])
    for name, plan in PLANS.items():
        for ck in (False, True):
            model.zero_grad(set_to_none=True)
            out = joint_step(model, [group], spec, plan.wave_size, checkpoint_waves=ck,
                             chooser=lambda g, m, plan=plan: plan)
            assert abs(float(out[0]["loss"]) - naive) <= TOL * abs(naive), (name, ck)
            assert _worst(model, reference) <= TOL, (name, ck)


@pytest.mark.parametrize("setting", ["none", "full"])
def test_exit_gate_matches_naive(mcore_single, setting):
    R = 3
    reference, model = _pair(lambda **e: _gated(R=R, arch=True, **e), setting)
    group = make_group(5, 8, 4, R, seed=6, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05)
    naive = _naive(reference, [group], spec, "exit_pdf", 0.5, 0.1, per_mb=2)
    plan = GroupPlan(2, state_kind="inputs")
    out = _joint(model, [group], spec, "exit_pdf", 0.5, 0.1, 2, False,
                 chooser=lambda g, m: plan)
    assert abs(float(out[0]["loss"]) - naive) <= TOL * abs(naive)
    assert _worst(model, reference) <= TOL


@pytest.mark.parametrize("family", ["ouro-f32", "huginn-truncated-f32", "retrofit-f32",
                                    "nanbeige-f32"])
def test_public_families_match_naive(mcore_single, family):
    """Each family's own attention (Ouro's sandwich norms, Huginn's query/key biases) derives
    the prefix K/V as the prompt did: fp64, one-level and tree, no and full recompute."""
    for setting in ("none", "full"):
        reference, model = _pair(lambda **e: BUILDERS[family](**e), setting)
        R = model.config.looped_num_loops
        spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="uniform")
        for shape in ("one-level", "tree"):
            group = (tree_group(DEPTH2, R, seed=7, kl=True) if shape == "tree"
                     else make_group(5, 8, 4, R, seed=7, kl=True, vocab=model.vocab_size))
            assert int(group.tokens.max()) < model.vocab_size
            reference.zero_grad(set_to_none=True)
            naive_step(reference, [group], spec, 2)
            model.zero_grad(set_to_none=True)
            joint_step(model, [group], spec, 2,
                       chooser=lambda g, m: GroupPlan(2, state_kind="inputs"))
            assert _worst(model, reference) <= TOL, (family, setting, shape)


def _tp_worker(rank: int, world_size: int) -> dict:
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="uniform")
    worst = {}
    for setting in ("none", "full"):
        torch.manual_seed(0)
        reference, model = _pair(lambda **e: build_model(
            R=2, arch=True, hidden=16, heads=4, num_query_groups=2,
            tensor_model_parallel_size=2, **e), setting)
        for shape in ("one-level", "tree"):
            group = _group(shape, 2, seed=8)
            reference.zero_grad(set_to_none=True)
            naive_step(reference, [group], spec, 2)
            for name, plan in PLANS.items():
                model.zero_grad(set_to_none=True)
                joint_step(model, [group], spec, plan.wave_size,
                           chooser=lambda g, m, plan=plan: plan)
                worst[f"{setting} {shape} {name}"] = _worst(model, reference)
    return worst


def test_tensor_parallel_2_matches_naive():
    reports = run_distributed(_tp_worker, 2, tensor_model_parallel_size=2, timeout=600)
    for rank, worst in enumerate(reports):
        assert max(worst.values()) <= TOL, (rank, worst)


def test_the_state_is_half_of_kv_and_so_are_its_adjoints(mcore_single):
    """MHA: H = 2 x heads x head_dim / 2, so an input per depth is half of its K and V."""
    model = build_model(R=3, arch=True, hidden=32, heads=4).double()
    tokens, P = torch.ones(1, 11, dtype=torch.long), 11

    def state(kind):
        return model(tokens, return_prefix_state=True, readout=False,
                     state_kind=kind).prefix_state

    kv, inputs = state("kv"), state("inputs")
    assert kv.inputs is None and not inputs.keys and len(inputs.inputs) == len(kv.keys)
    per_depth = sum(t.numel() for t in inputs.tensors()[:-1])
    assert 2 * per_depth == sum(t.numel() for t in kv.tensors()[:-1])
    m = ModelShape.from_model(model)
    numel = sum(t.numel() for t in inputs.tensors())
    assert adjoint_bytes(dataclasses.replace(m, state_kind="inputs"), P) == numel * 8


def test_bad_kinds_are_refused(mcore_single):
    model = build_model(R=2, hidden=32, heads=4)
    tokens = torch.ones(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="state_kind must be 'kv' or 'inputs', got 'k'"):
        model(tokens, return_prefix_state=True, readout=False, state_kind="k")
    with pytest.raises(ValueError, match="GroupPlan.state_kind must be 'kv' or 'inputs'"):
        GroupPlan(2, state_kind="KV")
    with pytest.raises(ValueError, match="state_kind must be one of"):
        Planner(2, state_kind="input")


def test_the_planner_picks_inputs_where_only_they_fit(mcore_single):
    """Full recompute, a budget below every K/V plan (waves of 1, the prompt in P segments)
    that the inputs plans meet: the planner picks an inputs plan (``state_kind`` auto), the
    step's measured peak (saved bytes plus the adjoints) is within the budget, and it is exact
    against naive training without recompute."""
    R, G, P, S = 2, 4, 48, 6
    reference, model = _pair(lambda **e: build_model(R=R, arch=True, hidden=32, heads=4, **e),
                             "full")
    shape, loss = ModelShape.from_model(model), LossSpec().objective().saved_per_position

    def peak(plan):
        return plan_memory(shape, P, S, G, plan, False, loss).peak_bytes

    smallest_kv = peak(GroupPlan(1, prompt_segments=P))
    budget = peak(GroupPlan(1, prompt_segments=4, state_kind="inputs"))
    assert budget < smallest_kv
    group = make_group(G, P, S, R, seed=3)
    plan = Planner("auto", "auto", budget, loss_per_position=loss)(group, model)
    assert plan.state_kind == "inputs" and peak(plan) <= budget, plan
    naive_step(reference, [group], LossSpec(), 2)
    with SavedTensorProbe(model) as probe:
        joint_step(model, [group], LossSpec(), "auto", prompt="auto", memory_budget=budget,
                   loss_per_position=loss)
    adjoints = plan_memory(shape, P, S, G, plan, False, loss).adjoint_bytes
    assert probe.peak_bytes + adjoints <= budget, (plan, probe.peak_bytes + adjoints, budget)
    assert _worst(model, reference) <= TOL
