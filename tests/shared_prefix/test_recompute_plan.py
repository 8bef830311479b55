"""The planner under activation recompute (``recompute_granularity`` full with ``uniform`` and
``block`` chunks, and ``selective``): its predicted peak saved bytes against
``SavedTensorProbe`` measurements of joint replay (the prompt retained or recomputed, one
wave or several) and of naive microbatches, within 10% as without recompute, for the GPT
layout and the public families in f32 and bf16, with truncated backprop and the exit gate;
and a memory budget planned there: the chosen plan's measured peak fits the budget."""

import pytest
import torch
from helpers.families import BUILDERS, SETTINGS
from helpers.sp import LossSpec, build_model, grads, joint_step, make_group, naive_step, rel_errors

from scalerlt_mcore.rl.objective import rl_forward_step
from scalerlt_mcore.shared_prefix import SavedTensorProbe
from scalerlt_mcore.shared_prefix import naive_step as library_naive_step
from scalerlt_mcore.shared_prefix.planner import GroupPlan, ModelShape, Planner, plan_memory
from scalerlt_mcore.testing import run_distributed

PREDICTION_RTOL = 0.10
MEASURED = {}
PREDICTED_SETTINGS = {**SETTINGS,
                      # a recomputed MLP (its fc2 bias would come back through the checkpoint)
                      "selective-mlp": dict(recompute_granularity="selective",
                                            recompute_modules=["core_attn", "mlp"],
                                            add_bias_linear=False)}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if MEASURED:
        low, high = (f(MEASURED, key=MEASURED.get) for f in (min, max))
        print(f"\n[recompute plan] predicted / measured over {len(MEASURED)} plans: "
              f"{MEASURED[low]:.4f} ({low}) .. {MEASURED[high]:.4f} ({high})")


CASES = [(b, s) for b in ("arch-f32", "arch-concat-bf16") for s in SETTINGS] + [
    ("rms-gqa-f32", "selective-mlp"), ("exit-gate-truncated-bf16", "selective-mlp"),
    ("rms-gqa-f32", "full-uniform-2"), ("truncated-arch-bf16", "full-uniform-1"),
    ("truncated-arch-bf16", "selective"), ("exit-gate-f32", "full-block-1"),
    ("exit-gate-truncated-bf16", "full-uniform-1"), ("ouro-f32", "full-uniform-1"),
    ("ouro-bf16", "selective"), ("huginn-truncated-f32", "full-uniform-2"),
    ("huginn-bf16", "full-block-1"), ("retrofit-f32", "selective"),
    ("retrofit-bf16", "full-uniform-1"), ("nanbeige-f32", "full-block-1"),
    ("nanbeige-bf16", "full-uniform-2")]
SHAPES = ((4, 16, 6), (5, 40, 9))  # (G, P, S)
PLANS = (GroupPlan(2), GroupPlan(2, retain=True), GroupPlan(1), GroupPlan(8),
         GroupPlan(3, naive=True), GroupPlan(2, state_kind="inputs"),
         GroupPlan(1, prompt_segments=3, state_kind="inputs"))


def _peak(model, step) -> int:
    model.zero_grad(set_to_none=True)
    with SavedTensorProbe(model) as probe:
        step()
    return probe.peak_bytes


def _run(model, group, plan, spec):
    if plan.naive:
        return library_naive_step(model, [group], rl_forward_step(spec.objective()),
                                  plan.wave_size)
    return joint_step(model, [group], spec, plan.wave_size, chooser=lambda g, m: plan)


@pytest.mark.parametrize("name,setting", CASES, ids=[f"{b}-{s}" for b, s in CASES])
def test_saved_bytes_under_recompute_within_10_percent(mcore_single, name, setting):
    model = BUILDERS[name](**PREDICTED_SETTINGS[setting])
    shape = ModelShape.from_model(model)
    assert shape.recompute == PREDICTED_SETTINGS[setting]["recompute_granularity"]
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    R = model.config.looped_num_loops
    for kl, (G, P, S) in enumerate(SHAPES):
        spec = LossSpec(kl_coef=0.1 * kl, entropy_weight=0.1 * kl)
        group = make_group(G, P, S, R, seed=G, dtype=dtype, kl=bool(kl),
                           vocab=model.vocab_size)
        for plan in PLANS:
            got = _peak(model, lambda: _run(model, group, plan, spec))  # noqa: B023
            pred = plan_memory(shape, P, S, G, plan, False,
                               spec.objective().saved_per_position).saved_bytes
            MEASURED[(name, setting, G, plan)] = pred / got
            assert abs(pred / got - 1) <= PREDICTION_RTOL, (
                f"{name} {setting} G={G} P={P} S={S} {plan}: predicted {pred} B, measured "
                f"{got} B ({pred / got:.3f})")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_budget_under_recompute_is_planned_and_fits(mcore_single, setting):
    """``wave_size`` "auto" with the budget of waves of 2, the prompt recomputed: the planner
    picks the largest wave that fits (below the group), its measured peak (saved bytes plus the
    prefix adjoints) is within the budget, and the step is exact against naive training of the same
    weights without recompute (fp64, 1e-12)."""
    R, G, P, S = 2, 6, 40, 6
    reference = build_model(R=R, arch=True).double()
    model = build_model(R=R, arch=True, **SETTINGS[setting]).double()
    model.load_state_dict(reference.state_dict())
    shape = ModelShape.from_model(model)
    loss = LossSpec().objective().saved_per_position
    peaks = {(W, r): plan_memory(shape, P, S, G, GroupPlan(W, retain=r), False,
                                 loss).peak_bytes for W in range(1, G + 1) for r in (True, False)}
    budget = peaks[(2, False)]
    fits = [W for W in range(1, G + 1) if min(peaks[(W, True)], peaks[(W, False)]) <= budget]
    group = make_group(G, P, S, R, seed=3)
    plan = Planner("auto", "auto", budget, loss_per_position=loss)(group, model)
    assert plan.wave_size == max(fits) < G, (plan, peaks)
    naive_step(reference, [group], LossSpec(), 2)
    got = _peak(model, lambda: joint_step(model, [group], LossSpec(), "auto", prompt="auto",
                                          memory_budget=budget, loss_per_position=loss))
    adjoints = plan_memory(shape, P, S, G, plan, False, loss).adjoint_bytes
    assert got + adjoints <= budget, (plan, got + adjoints, budget)
    assert max(rel_errors(grads(model), grads(reference)).values()) <= 1e-12


BUSHY = [(None, 24), (0, 6), (1, 3), (1, 3), (1, 2), (0, 6), (5, 3), (5, 3), (0, 5), (8, 4),
         (9, 2), (9, 3), (0, 3)]
"""test_tree_plan.py's tree: a long prompt, two internal children with three leaves each, a
chain 8 -> 9 (node 9 continues node 8's replay chain) and a leaf child of the root."""
TREE_CASES = [("arch-f32", "full-uniform-1"), ("arch-f32", "full-block-1"),
              ("arch-f32", "selective"), ("arch-concat-bf16", "full-uniform-2"),
              ("truncated-arch-bf16", "full-uniform-1"), ("exit-gate-f32", "full-uniform-1"),
              ("ouro-bf16", "full-uniform-1"), ("huginn-truncated-f32", "full-block-1"),
              ("retrofit-f32", "full-uniform-2"), ("nanbeige-bf16", "selective")]


@pytest.mark.parametrize("name,setting", TREE_CASES, ids=[f"{b}-{s}" for b, s in TREE_CASES])
def test_tree_saved_bytes_under_recompute_within_10_percent(mcore_single, name, setting):
    """A depth-2 tree (DEPTH2) and a bushy one with a replay chain (``BUSHY``), every node
    recomputed, some retained, all retained."""
    from helpers.tree import DEPTH2, tree_group

    from scalerlt_mcore.shared_prefix.planner import tree_memory
    from scalerlt_mcore.shared_prefix.tree_schedule import nodes_with_loss

    model = BUILDERS[name](**SETTINGS[setting])
    m = ModelShape.from_model(model)
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="progressive")
    loss = spec.objective().saved_per_position
    for label, shape, mixed in (("depth2", DEPTH2, {1}), ("bushy", BUSHY, {0, 8, 9})):
        group = tree_group(shape, model.config.looped_num_loops, seed=2, dtype=dtype, kl=True)
        tree = group.tree
        for kept, kind in ((set(), "kv"), (mixed, "kv"), (set(range(tree.num_nodes)), "kv"),
                           (set(), "inputs"), (mixed, "inputs")):
            plan = GroupPlan(2, retain_nodes=tuple(n in kept for n in range(tree.num_nodes)),
                             state_kind=kind)
            got = _peak(model, lambda: joint_step(  # noqa: B023
                model, [group], spec, 2, chooser=lambda *a, **k: plan))  # noqa: B023
            pred = tree_memory(m, tree, plan, nodes_with_loss(group), loss).saved_bytes
            MEASURED[(name, setting, label, tuple(sorted(kept)), kind)] = pred / got
            assert abs(pred / got - 1) <= PREDICTION_RTOL, (
                f"{name} {setting} {label} retained {sorted(kept)} {kind}: predicted {pred} B, "
                f"measured {got} B ({pred / got:.3f})")


@pytest.mark.parametrize("setting", ["full-uniform-1", "full-block-1", "selective"])
def test_a_tree_budget_under_recompute_is_planned_and_fits(mcore_single, setting):
    """A tree group (BUSHY), prompt "auto", the budget halfway between recomputing every node
    and retaining every node: the planner retains some nodes, the step's measured peak (saved
    bytes plus the prefix adjoints) is within the budget, and it is exact against naive
    training without recompute (fp64, 1e-12)."""
    from helpers.tree import tree_group

    from scalerlt_mcore.shared_prefix.planner import tree_memory
    from scalerlt_mcore.shared_prefix.tree_schedule import nodes_with_loss

    R = 2
    reference = build_model(R=R, arch=True).double()
    model = build_model(R=R, arch=True, **SETTINGS[setting]).double()
    model.load_state_dict(reference.state_dict())
    group = tree_group(BUSHY, R, seed=5, kl=True)
    tree, has_loss = group.tree, nodes_with_loss(group)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05)
    loss = spec.objective().saved_per_position
    m = ModelShape.from_model(model)
    peaks = [tree_memory(m, tree, GroupPlan(2, retain=r), has_loss, loss).peak_bytes
             for r in (False, True)]
    assert peaks[1] > peaks[0]
    budget = sum(peaks) // 2
    plan = Planner(2, "auto", budget, loss_per_position=loss)(group, model)
    internal = [n for n in range(tree.num_nodes) if not tree.is_leaf(n)]
    assert 0 < sum(plan.retain_nodes[n] for n in internal) < len(internal), plan
    naive_step(reference, [group], spec, 3)
    got = _peak(model, lambda: joint_step(model, [group], spec, 2,
                                          chooser=lambda *a, **k: plan))
    adjoints = tree_memory(m, tree, plan, has_loss, loss).adjoint_bytes
    assert got + adjoints <= budget, (plan, got + adjoints, budget)
    assert max(rel_errors(grads(model), grads(reference)).values()) <= 1e-12


def _tp_ratios(rank, world_size, setting, name) -> list:
    """Per plan, (predicted / measured saved bytes of this rank, the case) at TP = 2: the GPT
    layout (``gpt``) or a family of ``BUILDERS``."""
    if name == "gpt":
        model = build_model(R=2, arch=True, hidden=32, heads=4, num_query_groups=2,
                            tensor_model_parallel_size=2, **SETTINGS[setting])
    else:
        model = BUILDERS[name](tensor_model_parallel_size=2, **SETTINGS[setting])
    shape, spec, out = ModelShape.from_model(model), LossSpec(), []
    for G, P, S in SHAPES:
        group = make_group(G, P, S, model.config.looped_num_loops, seed=G, dtype=torch.float32,
                           vocab=model.vocab_size)
        for plan in PLANS:
            got = _peak(model, lambda: _run(model, group, plan, spec))  # noqa: B023
            pred = plan_memory(shape, P, S, G, plan, False,
                               spec.objective().saved_per_position).saved_bytes
            out.append((pred / got, f"{name} {setting} TP2 G={G} {plan}: predicted {pred} B, "
                                    f"measured {got} B"))
    return out


@pytest.mark.parametrize("name,setting", [("gpt", "full-uniform-1"), ("gpt", "selective"),
                                          ("ouro-bf16", "full-uniform-1"),
                                          ("huginn-truncated-f32", "selective")])
def test_saved_bytes_under_recompute_at_tp2(name, setting):
    """The calibration (with and without recompute) runs on each rank's shards."""
    for ratios in run_distributed(_tp_ratios, 2, setting, name, tensor_model_parallel_size=2):
        for ratio, case in ratios:
            MEASURED[case] = ratio
            assert abs(ratio - 1) <= PREDICTION_RTOL, f"{case} ({ratio:.3f})"


@pytest.mark.parametrize("setting", ["full-uniform-1", "full-block-1", "selective"])
def test_a_model_on_meta_calibrates_under_recompute_as_on_a_device(mcore_single, setting):
    """The plan command's twin with recompute is planned on ``meta``: both calibrations (with
    and without recompute) run there as on CPU, so a bf16 model's predicted peaks agree within
    2%."""
    kw = dict(R=3, arch=True, hidden=64, heads=4, **SETTINGS[setting])
    cpu = build_model(**kw).to(torch.bfloat16)
    meta = build_model(**kw).to(torch.bfloat16).to("meta")
    loss = LossSpec().objective().saved_per_position
    for plan in (GroupPlan(1, naive=True), GroupPlan(2), GroupPlan(2, retain=True)):
        pred = [plan_memory(ModelShape.from_model(m), 24, 8, 4, plan, False, loss).saved_bytes
                for m in (cpu, meta)]
        assert abs(pred[1] / pred[0] - 1) <= 0.02, (plan, pred)
