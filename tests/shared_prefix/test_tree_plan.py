"""Per-node retain or recompute in a tree group's plan (``GroupPlan.retain_nodes``): any mixed
plan is exact against naive stock MCore rows (fp64, 1e-12 relative per tensor), each retained
node's state is computed once and each recomputed one twice; the planner's tree memory model
(``planner.tree_memory``) against ``SavedTensorProbe`` (10%, as for one-level groups), and the
nodes it retains under a memory budget (none, some, all) and its error below the minimum.
A group's row indices (every node's rows, every leaf wave's) are one non-blocking upload,
and a one-level microbatch result's count tensors are filled on the device."""

import tempfile

import pytest
import torch
from helpers.reference_huginn import write_huginn_checkpoint, write_retrofit_checkpoint
from helpers.reference_nanbeige import write_nanbeige_checkpoint
from helpers.reference_ouro import write_ouro_checkpoint
from helpers.replay_exact import _assert_close_rel
from helpers.sp import LossSpec, build_model, grads, joint_step, naive_step, rel_errors
from helpers.tree import DEPTH3, tree_group

from scalerlt_mcore.model.host_syncs import HostSyncCounter
from scalerlt_mcore.model.looped_import import looped_gpt_from_pretrained
from scalerlt_mcore.shared_prefix import SavedTensorProbe
from scalerlt_mcore.shared_prefix.planner import GroupPlan, ModelShape, Planner, tree_memory
from scalerlt_mcore.shared_prefix.replay import merge
from scalerlt_mcore.shared_prefix.tree_schedule import chain_parent, nodes_with_loss, row_indices

PREDICTION_RTOL = 0.10
SPEC = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="progressive")
LOSS_BYTES = SPEC.objective().saved_per_position
R = 2

BUSHY = [(None, 24), (0, 6), (1, 3), (1, 3), (1, 2), (0, 6), (5, 3), (5, 3), (0, 5), (8, 4),
         (9, 2), (9, 3), (0, 3)]
"""A long prompt, two internal children with three leaves each, a chain 8 -> 9 whose node 9
continues node 8's replay chain (8 has no leaf child) and a leaf child of the root (so node 8
tops its own chain)."""

DEEP = [(None, 4), (0, 8), (1, 8), (2, 4), (2, 4), (2, 4), (1, 3), (1, 3), (1, 3), (0, 3),
        (0, 3), (0, 3)]
"""A chain of three internal nodes each with three leaves (waves of 2 and 1): retaining any
node raises the peak (it is held through its descendants' replays, or beside a full wave
where recomputing it holds it only beside the short last one)."""


def _retained(group, nodes) -> tuple:
    return tuple(n in nodes for n in range(group.tree.num_nodes))


def _fixed(plan):
    return lambda group, model, num_loops=None: plan


def _run(model, group, plan, W: int = 2, checkpoint_waves: bool = False) -> tuple:
    """One step by ``plan`` -> (its results, node-state forwards, peak saved bytes)."""
    calls = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: calls.append(bool(kw.get("return_prefix_state"))), with_kwargs=True)
    model.zero_grad(set_to_none=True)
    try:
        with SavedTensorProbe(model) as probe:
            out = joint_step(model, [group], SPEC, W, chooser=_fixed(plan),
                             checkpoint_waves=checkpoint_waves)
    finally:
        hook.remove()
    return out, sum(calls), probe.peak_bytes


def _reference(model, group):
    model.zero_grad(set_to_none=True)
    losses, _ = naive_step(model, [group], SPEC, 3)
    return losses[0], grads(model)


def _forwards(group, plan) -> int:
    tree = group.tree
    return sum(1 if plan.retain_nodes[n] else 2 for n in range(tree.num_nodes)
               if not tree.is_leaf(n))


@pytest.mark.parametrize("shape,nodes", [(DEPTH3, {0}), (DEPTH3, {1, 4}), (DEPTH3, {2, 3}),
                                         (DEPTH3, {1}), (BUSHY, {8, 9}), (BUSHY, {0, 5}),
                                         (BUSHY, {1, 8})],
                         ids=["d3-root", "d3-chain", "d3-two", "d3-top", "bushy-chain",
                              "bushy-root", "bushy-mixed"])
def test_mixed_plans_match_naive_mcore(mcore_single, shape, nodes):
    model = build_model(R=R, arch=True).double()
    group = tree_group(shape, R, seed=len(nodes) + len(shape), kl=True)
    loss, ref = _reference(model, group)
    plan = GroupPlan(2, retain_nodes=_retained(group, nodes))
    out, forwards, _ = _run(model, group, plan)
    _assert_close_rel(out[0]["loss"], loss, 1e-12, "tree loss")
    errs = rel_errors(grads(model), ref)
    print(f"\n[tree plan] retained {sorted(nodes)}: max relative error {max(errs.values()):.3e}")
    assert max(errs.values()) <= 1e-12, {n: e for n, e in errs.items() if e > 1e-12}
    assert forwards == _forwards(group, plan)


def test_a_chain_is_retained_from_its_top(mcore_single):
    """Node 9 continues node 8's chain: retaining it alone is refused, naming both."""
    model = build_model(R=R).double()
    group = tree_group(BUSHY, R, seed=1, kl=True)
    assert chain_parent(group.tree, 9) == 8 and chain_parent(group.tree, 8) is None
    plan = GroupPlan(2, retain_nodes=_retained(group, {9}))
    with pytest.raises(ValueError, match="node 9 continues the replay chain of node 8"):
        _run(model, group, plan)
    with pytest.raises(ValueError, match="retain_nodes has 3 entries; the tree has 13 nodes"):
        _run(model, group, GroupPlan(2, retain_nodes=(True, False, True)))
    with pytest.raises(ValueError, match="retain_nodes must be a tuple of bools"):
        GroupPlan(2, retain_nodes=[True])


def _peaks(model, group) -> dict:
    m = ModelShape.from_model(model)
    has_loss = nodes_with_loss(group)
    return {mode: tree_memory(m, group.tree, GroupPlan(2, retain=mode == "all"), has_loss,
                              LOSS_BYTES).peak_bytes for mode in ("none", "all")}


@pytest.mark.parametrize("attn", ["cascade", "concat"])
def test_the_budget_decides_which_nodes_are_retained(mcore_single, attn):
    """Recompute-everything's peak as the budget: no node retained; retain-everything's: all;
    halfway: some, not all. Each plan's predicted saved bytes are within 10% of the probe's
    measurement, and each is exact."""
    model = build_model(R=R, arch=True, attn=attn).double()
    group = tree_group(DEEP, R, seed=5, kl=True)
    loss, ref = _reference(model, group)
    peaks = _peaks(model, group)
    assert peaks["all"] > peaks["none"]
    internal = [n for n in range(group.tree.num_nodes) if not group.tree.is_leaf(n)]
    m, has_loss = ModelShape.from_model(model), nodes_with_loss(group)
    budgets = {"none": peaks["none"], "some": (peaks["none"] + peaks["all"]) // 2,
               "all": peaks["all"]}
    for name, budget in budgets.items():
        plan = Planner(2, "auto", budget, loss_per_position=LOSS_BYTES)(group, model)
        kept = sum(plan.retain_nodes[n] for n in internal)
        assert {"none": kept == 0, "some": 0 < kept < len(internal),
                "all": kept == len(internal)}[name], (name, plan)
        predicted = tree_memory(m, group.tree, plan, has_loss, LOSS_BYTES)
        assert predicted.peak_bytes <= budget
        out, forwards, measured = _run(model, group, plan)
        err = abs(predicted.saved_bytes / measured - 1)
        print(f"\n[tree plan] {attn} {name}: retained {kept}/{len(internal)}, predicted "
              f"{predicted.saved_bytes} B, measured {measured} B ({err:.2%})")
        assert err <= PREDICTION_RTOL, (name, predicted.saved_bytes, measured)
        assert forwards == _forwards(group, plan)
        _assert_close_rel(out[0]["loss"], loss, 1e-12, f"{name} loss")
        assert max(rel_errors(grads(model), ref).values()) <= 1e-12


def _family(write, dtype, **config):
    """A tiny random checkpoint of a public family, imported, in ``dtype``, at R = 2."""
    def build():
        with tempfile.TemporaryDirectory() as d:
            write(d)
            return looped_gpt_from_pretrained(d, num_loops=R, use_cpu_initialization=True,
                                              **config).to(dtype)
    return build


MODELS = {
    "f32": lambda: build_model(R=2),
    "rms-gqa-f32": lambda: build_model(R=2, arch=True, normalization="RMSNorm",
                                       num_query_groups=2),
    # the waves read fp32 leaves (and their concatenations) of a bf16 state
    "bf16": lambda: build_model(R=2).to(torch.bfloat16),
    "concat-bf16": lambda: build_model(R=2, attn="concat").to(torch.bfloat16),
    # truncated backprop: graph-free depths save nothing and are no leaves
    "truncated-f64": lambda: build_model(R=3, arch=True, looped_backprop_loops=1).double(),
    # the public families' own layers, measured on the live model (planner.calibration)
    "ouro-bf16": _family(write_ouro_checkpoint, torch.bfloat16),
    "huginn-f32": _family(write_huginn_checkpoint, torch.float32),
    "retrofit-bf16": _family(write_retrofit_checkpoint, torch.bfloat16),
    "nanbeige-f32": _family(write_nanbeige_checkpoint, torch.float32, looped_backprop_loops=1),
}
PLANS = (("none", False), ("mixed", False), ("all", True))
"""(retained nodes, checkpointed waves): a mixed plan retains BUSHY's root and its chain
8 -> 9."""


@pytest.mark.parametrize("name", list(MODELS))
def test_tree_saved_bytes_prediction_within_10_percent(mcore_single, name):
    model = MODELS[name]()
    m = ModelShape.from_model(model)
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    group = tree_group(BUSHY, model.config.looped_num_loops, seed=2, dtype=dtype, kl=True)
    has_loss = nodes_with_loss(group)
    nodes = {"none": set(), "mixed": {0, 8, 9}, "all": set(range(group.tree.num_nodes))}
    for kept, ck in PLANS:
        plan = GroupPlan(2, retain_nodes=_retained(group, nodes[kept]))
        _, _, measured = _run(model, group, plan, checkpoint_waves=ck)
        predicted = tree_memory(m, group.tree, plan, has_loss, LOSS_BYTES, ck).saved_bytes
        err = abs(predicted / measured - 1)
        print(f"\n[tree plan] {name} {kept} ckpt={ck}: predicted {predicted} B, measured "
              f"{measured} B ({err:.2%})")
        assert err <= PREDICTION_RTOL, (name, kept, ck, predicted, measured)


def test_a_node_that_adds_nothing_to_the_peak_is_retained(mcore_single):
    """Greedy takes free nodes: at recompute-everything's peak as the budget, BUSHY's internal
    children are retained (their graphs are held only below the root replay's peak), the
    root is not, and the predicted peak is unchanged."""
    model = build_model(R=R, arch=True).double()
    group = tree_group(BUSHY, R, seed=5, kl=True)
    peaks = _peaks(model, group)
    plan = Planner(2, "auto", peaks["none"], loss_per_position=LOSS_BYTES)(group, model)
    assert plan.retain_nodes[0] is False and sum(plan.retain_nodes) > 0
    m = ModelShape.from_model(model)
    assert tree_memory(m, group.tree, plan, nodes_with_loss(group),
                       LOSS_BYTES).peak_bytes == peaks["none"]


def test_auto_without_budget_retains_and_forced_modes(mcore_single):
    """Without a budget ``prompt="auto"`` retains every node (as a one-level group retains);
    "retain" / "recompute" force every node."""
    model = build_model(R=R).double()
    group = tree_group(DEPTH3, R, seed=2)
    assert Planner(2, "auto")(group, model) == GroupPlan(2, retain=True)
    assert Planner(2, "retain")(group, model) == GroupPlan(2, retain=True)
    assert Planner(2, "recompute")(group, model) == GroupPlan(2, retain=False)
    budget = _peaks(model, group)["all"] * 10
    assert Planner(2, "recompute", budget, loss_per_position=LOSS_BYTES)(group, model) == (
        GroupPlan(2, retain=False))


def test_budget_below_recomputing_every_node_names_group_and_sizes(mcore_single):
    model = build_model(R=R).double()
    group = tree_group(DEPTH3, R, seed=3, group_id=17)
    need = _peaks(model, group)["none"]
    with pytest.raises(ValueError, match=r"group 17 \(tree of 11 nodes, depth 3, G=6\): no "
                       r"joint-replay plan fits the memory budget of .* MiB; the smallest "
                       r"\(every node recomputed, wave size 2\) needs .* MiB"):
        Planner(2, "auto", need - 1, loss_per_position=LOSS_BYTES)(group, model)
    assert Planner(2, "auto", need, loss_per_position=LOSS_BYTES)(group, model).retain_nodes


WIDE = [(None, 16), (0, 4), *[(1, 8)] * 6, (0, 6)]
"""An internal node with six leaves (its waves' size sets the peak) and a leaf of the root."""


def test_auto_wave_size_is_the_largest_that_fits_and_stays_exact(mcore_single):
    """``wave_size="auto"`` on a tree: the largest wave whose every-node-recomputed plan fits
    the budget, greedy retention on top; the step is exact against naive stock MCore; below
    the smallest wave's peak, the error names that plan."""
    model = build_model(R=R, arch=True).double()
    group = tree_group(WIDE, R, seed=4, kl=True)
    m, has_loss = ModelShape.from_model(model), nodes_with_loss(group)
    need = {W: tree_memory(m, group.tree, GroupPlan(W), has_loss, LOSS_BYTES).peak_bytes
            for W in range(1, group.group_size + 1)}
    assert need[4] < need[5] < need[6]
    plan = Planner("auto", "auto", need[4], loss_per_position=LOSS_BYTES,
                   prompt_segments=1)(group, model)
    assert plan.wave_size == 4
    assert tree_memory(m, group.tree, plan, has_loss, LOSS_BYTES).peak_bytes <= need[4]
    loss, ref = _reference(model, group)
    out, _, _ = _run(model, group, plan, W=plan.wave_size)
    _assert_close_rel(out[0]["loss"], loss, 1e-12, "tree loss")
    assert max(rel_errors(grads(model), ref).values()) <= 1e-12
    with pytest.raises(ValueError, match=r"the smallest \(every node recomputed, wave size 1\)"):
        Planner("auto", "auto", need[1] - 1, loss_per_position=LOSS_BYTES,
                prompt_segments=1)(group, model)


def test_a_groups_row_indices_are_one_upload_on_meta():
    """Every node's rows below (where it trains a token) and every leaf wave's rows, in one
    non-blocking copy, not one blocking copy per wave and node (each a stream synchronize on
    CUDA); the values against the tree read directly."""
    group = tree_group(DEPTH3, R, seed=0)
    tree, has_loss = group.tree, nodes_with_loss(group)
    with HostSyncCounter() as c:
        on_meta = row_indices(tree, has_loss, 2, "meta")
    assert dict(c.counts) == {"h2d": 1}
    rows = {k: v.tolist() for k, v in row_indices(tree, has_loss, 2, "cpu").items()}
    assert rows.keys() == on_meta.keys()
    for n in range(tree.num_nodes):
        assert rows.get(n) == (list(tree.rows_below(n)) if has_loss[n] else None), n
        leaves = [c for c in tree.children(n) if tree.is_leaf(c)]
        want = [[tree.leaf_of_row.index(c) for c in leaves[k : k + 2]]
                for k in range(0, len(leaves), 2)]
        assert [rows[(n, k)] for k in range(len(want))] == want, n
        assert (n, len(want)) not in rows


def test_a_microbatch_results_counts_are_filled_on_the_device():
    """num_waves and wave_size join the loss dict as 0-dim tensors built on the device, not
    uploaded blocking per microbatch."""
    loss = {"loss": torch.empty((), device="meta")}
    with HostSyncCounter() as c:
        merged = merge({0: loss, 1: loss}, num_waves=2, wave_size=3)
    assert c.total == 0 and merged["num_waves"].device.type == "meta"
    assert merge({0: {"loss": torch.zeros(())}}, num_waves=2)["num_waves"].item() == 2.0
