"""Joint replay over prefix trees is exact: the loss and gradients of NAIVE training, every
root-to-leaf row an independent full sequence through stock MCore ``get_forward_backward_func()``
with the RL loss written in plain PyTorch (tests/helpers/sp.py, tests/helpers/exit_gate.py).

Bounds: fp64 1e-12 relative per tensor; fp32 1e-6 of the exact (fp64) run of the same weights
over the whole gradient (tests/helpers/fp32_exact.py). Measured errors print with -s.
"""

import pytest
import torch
from helpers.exit_gate import _gated, _joint, _naive
from helpers.fp32_exact import fp64_group, fp64_twin, whole_gradient_error
from helpers.replay_exact import TOL, _assert_close_rel
from helpers.sp import (
    LossSpec,
    build_model,
    grads,
    joint_step,
    make_group,
    naive_step,
    rel_errors,
)
from helpers.tree import DEPTH2, DEPTH3, tree_group

from scalerlt_mcore.shared_prefix import SharedPrefixGroup, TreeSegment

MEASURED = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for name, err in MEASURED.items():
        print(f"\n[tree joint replay] max relative error {name}: {err:.3e}")


def _check(name: str, got: dict, ref: dict, tol: float) -> None:
    errs = rel_errors(got, ref)
    worst = max(errs.values())
    MEASURED[name] = max(MEASURED.get(name, 0.0), worst)
    assert worst <= tol, {n: e for n, e in errs.items() if e > tol}


# shape, dtype, wave size, R, arch (prelude/coda/injection), checkpoint waves, normalisation,
# loop weights, kl, internal-node masks, attention, naive rows per microbatch
GRID = [
    (DEPTH2, "f64", 2, 2, True, False, "seq_mean", "uniform", 1, "mixed", "cascade", 2),
    (DEPTH3, "f64", 2, 3, False, True, "token_mean", "progressive", 0, "mixed", "concat", 3),
    (DEPTH3, "f64", 1, 1, True, False, "constant", "final", 1, "none", "cascade", 1),
    (DEPTH2, "f64", 3, 3, True, True, "token_mean", "final", 0, "leaves", "concat", 8),
    (DEPTH3, "f64", 4, 2, True, False, "seq_mean", "progressive", 1, "mixed", "cascade", 2),
]


@pytest.mark.parametrize("row", GRID, ids=[f"d{r[0] is DEPTH3 and 3 or 2}-W{r[2]}-R{r[3]}-{r[6]}"
                                           f"-{r[9]}-{r[10]}" for r in GRID])
def test_tree_matches_naive_mcore(mcore_single, row):
    shape, dt, W, R, arch, ck, norm, lw, kl, masks, attn, per_mb = row
    dtype = torch.float64
    model = build_model(R=R, arch=arch, attn=attn).to(dtype)
    group = tree_group(shape, R, seed=len(shape) + W, dtype=dtype, kl=bool(kl), masks=masks)
    spec = LossSpec(normalization=norm, clip_high=0.28, kl_coef=0.1 * kl, loop_weights=lw)
    naive_losses, _ = naive_step(model, [group], spec, per_mb)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, W, checkpoint_waves=ck)
    _assert_close_rel(out[0]["loss"], naive_losses[0], TOL[dtype], "tree loss")
    _check(dt, grads(model), ref, TOL[dtype])


def test_internal_tokens_carry_loss(mcore_single):
    """The mixed masks train internal-node tokens: without them the gradient differs (the
    grid's exactness covers their loss, not a vacuous zero)."""
    R = 2
    model = build_model(R=R, arch=True).double()
    spec = LossSpec(loop_weights="uniform")
    group = tree_group(DEPTH3, R, seed=1, masks="mixed")
    joint_step(model, [group], spec, 2)
    mixed = grads(model)
    tree = group.tree
    for n in range(1, tree.num_nodes):
        if not tree.is_leaf(n):
            group.loss_mask[list(tree.rows_below(n)), tree.positions(n)] = 0
    model.zero_grad(set_to_none=True)
    joint_step(model, [group], spec, 2)
    assert max(rel_errors(grads(model), mixed).values()) > 1e-3


def test_fp32_within_1e6_of_the_exact_gradient(mcore_single):
    R = 2
    model = build_model(R=R, arch=True)
    group = tree_group(DEPTH3, R, seed=9, dtype=torch.float32, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="progressive")
    exact = fp64_twin(model, build_model(R=R, arch=True).double())
    naive_losses, _ = naive_step(exact, [fp64_group(group)], spec, 2)
    ref = grads(exact)
    out = joint_step(model, [group], spec, 2)
    loss_err = abs(float(out[0]["loss"]) - float(naive_losses[0])) / abs(float(naive_losses[0]))
    err = whole_gradient_error(grads(model), ref)
    MEASURED["f32 (whole gradient)"] = err
    MEASURED["f32 (per tensor, not bounded)"] = max(rel_errors(grads(model), ref).values())
    assert loss_err <= 1e-6 and err <= 1e-6, (loss_err, err)


def test_two_trees_and_a_flat_group_in_one_step(mcore_single):
    R = 2
    model = build_model(R=R, arch=True).double()
    groups = [tree_group(DEPTH2, R, seed=3, kl=True, group_id=1),
              make_group(4, 7, 4, R, seed=4, kl=True, group_id=2),
              tree_group(DEPTH3, R, seed=5, kl=True, group_id=3)]
    spec = LossSpec(normalization="token_mean", kl_coef=0.05, loop_weights="uniform")
    naive_losses, _ = naive_step(model, groups, spec, 3)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, groups, spec, 2, checkpoint_waves=True)
    for k in range(3):
        _assert_close_rel(out[k]["loss"], naive_losses[k], 1e-12, f"group {k} loss")
    _check("f64", grads(model), ref, 1e-12)


def _set_k(model, k: int):
    model.config.looped_backprop_loops = k
    return model


@pytest.mark.parametrize("R,k,W", [(3, 1, 2), (4, 2, 3)])
def test_truncated_backprop(mcore_single, R, k, W):
    """Graph-free depths are no leaves; gradients equal naive truncated training."""
    model = _set_k(build_model(R=R, arch=True).double(), k)
    group = tree_group(DEPTH3, R, seed=R + k, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="uniform")
    naive_losses, _ = naive_step(model, [group], spec, 2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, W)
    _assert_close_rel(out[0]["loss"], naive_losses[0], 1e-12, "tree loss")
    _check("f64", grads(model), ref, 1e-12)


@pytest.mark.parametrize("scheme,gate_coef,learned", [("exit_pdf", 0.5, False),
                                                      ("learned", 0.3, True)])
def test_exit_gate_and_learned_loop_weights(mcore_single, scheme, gate_coef, learned):
    R = 3
    model = _gated(R=R, learned=learned).double()
    groups = [tree_group(DEPTH3, R, seed=13, kl=True), tree_group(DEPTH2, R, seed=14, kl=True)]
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05)
    naive_loss = _naive(model, groups, spec, scheme, gate_coef, 0.1, per_mb=2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = _joint(model, groups, spec, scheme, gate_coef, 0.1, wave=2, ck=False)
    loss = sum(float(o["loss"]) for o in out) / len(groups)
    assert abs(loss - naive_loss) <= 1e-12 * abs(naive_loss)
    assert float(ref["decoder.exit_gate.linear.weight"].abs().max()) > 0
    _check("f64", grads(model), ref, 1e-12)


def test_depth_one_tree_keeps_todays_numbers(mcore_single):
    """A depth-1 tree is the one-level group: bitwise the same loss and gradients."""
    R = 2
    model = build_model(R=R, arch=True).double()
    flat = make_group(5, 7, 4, R, seed=8, kl=True)
    P = flat.prompt_length
    lengths = (flat.loss_mask != 0).sum(dim=1).tolist()
    segments = [TreeSegment(flat.tokens[0, :P], None),
                *(TreeSegment(flat.tokens[g, P : P + n], 0) for g, n in enumerate(lengths))]
    tree = type(flat).from_tree(segments, 0, mask_dtype=torch.float64,
                                advantages=flat.advantages, old_logprobs=flat.old_logprobs,
                                ref_logprobs=flat.ref_logprobs)
    assert tree.tree.depth == 1 and torch.equal(tree.tokens, flat.tokens)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.1)
    a = joint_step(model, [flat], spec, 2)
    ga = grads(model)
    model.zero_grad(set_to_none=True)
    b = joint_step(model, [tree], spec, 2)
    assert torch.equal(a[0]["loss"], b[0]["loss"])
    assert all(torch.equal(g, ga[n]) for n, g in grads(model).items())


class _SyncCounter:
    """Backward calls inside and outside ``no_sync``."""

    def __init__(self, monkeypatch):
        self.synced, self.unsynced, self.inside = 0, 0, False
        backward = torch.autograd.backward

        def counted(*args, **kwargs):
            if self.inside:
                self.unsynced += 1
            else:
                self.synced += 1
            return backward(*args, **kwargs)

        monkeypatch.setattr(torch.autograd, "backward", counted)

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.inside = True
            try:
                yield
            finally:
                self.inside = False
        return ctx()


@pytest.mark.parametrize("shapes,prompt", [((DEPTH2,), "recompute"), ((DEPTH3, DEPTH2), "retain")])
def test_one_sync_enabled_backward_per_step(mcore_single, monkeypatch, shapes, prompt):
    """Whatever the trees: one backward outside no_sync (the last tree's root replay)."""
    R = 2
    model = build_model(R=R).double()
    groups = [tree_group(s, R, seed=k, group_id=k) for k, s in enumerate(shapes)]
    counter = _SyncCounter(monkeypatch)
    model.config.no_sync_func = counter.no_sync
    try:
        out = joint_step(model, groups, LossSpec(), 2, prompt=prompt)
    finally:
        model.config.no_sync_func = None
    assert counter.synced == 1
    assert counter.unsynced > len(groups)
    waves = {id(DEPTH2): 3, id(DEPTH3): 5}  # waves of 2 of each node's leaf children
    assert [int(o["num_waves"]) for o in out] == [waves[id(s)] for s in shapes]


def test_forward_only_scores_the_rows(mcore_single):
    R = 2
    model = build_model(R=R, arch=True).double()
    group = tree_group(DEPTH3, R, seed=2)
    with torch.no_grad():
        ref = model(group.tokens, labels=group.labels).logprobs  # [R, G, T]
    out = joint_step(model, [group], LossSpec(), 2, forward_only=True)
    on = group.loss_mask != 0
    _assert_close_rel(out[0]["logprobs"][:, on], ref[:, on], 1e-12, "scores")
    assert all(p.grad is None for p in model.parameters())


def test_tree_plan_errors(mcore_single):
    """An auto wave size is planned under a budget with prompt 'auto'; a forced prompt mode
    plans no wave size."""
    R = 2
    model = build_model(R=R).double()
    group = tree_group(DEPTH2, R, seed=1)
    with pytest.raises(ValueError, match="wave_size 'auto' of a tree group \\(depth 2\\) is "
                       "planned with prompt 'auto' and a memory budget"):
        joint_step(model, [group], LossSpec(), "auto", memory_budget=2**30,
                   loss_per_position=5.0, prompt="retain")


@pytest.mark.parametrize("shape,W,ck,k", [(DEPTH2, 2, False, 0), (DEPTH3, 3, True, 0),
                                         (DEPTH3, 2, False, 2)])
def test_retain_matches_naive_and_computes_each_node_once(mcore_single, shape, W, ck, k):
    """prompt "retain": every node's graph kept from its first forward (against the retained
    graphs of its chain), none recomputed; loss and gradients those of naive training."""
    R = 3
    model = _set_k(build_model(R=R, arch=True).double(), k)
    group = tree_group(shape, R, seed=W + k, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="progressive")
    naive_losses, _ = naive_step(model, [group], spec, 2)
    ref = grads(model)
    forwards = {}
    for prompt in ("recompute", "retain"):
        calls = []
        hook = model.register_forward_pre_hook(
            lambda m, args, kw, calls=calls: calls.append(kw.get("return_prefix_state")),
            with_kwargs=True)
        model.zero_grad(set_to_none=True)
        try:
            out = joint_step(model, [group], spec, W, checkpoint_waves=ck, prompt=prompt)
        finally:
            hook.remove()
        forwards[prompt] = sum(bool(c) for c in calls)
        assert int(out[0]["retain"]) == (prompt == "retain")
        _assert_close_rel(out[0]["loss"], naive_losses[0], 1e-12, f"{prompt} loss")
        _check("f64", grads(model), ref, 1e-12)
    nodes = group.tree.num_nodes - len(group.tree.leaf_of_row)
    assert forwards == {"recompute": 2 * nodes, "retain": nodes}


def test_naive_plan_of_a_tree_matches(mcore_single):
    R = 2
    model = build_model(R=R, arch=True).double()
    group = tree_group(DEPTH2, R, seed=6, kl=True)
    spec = LossSpec(kl_coef=0.1)
    naive_step(model, [group], spec, 2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    joint_step(model, [group], spec, 2, schedule="naive", naive_micro_batch_size=2)
    _check("f64", grads(model), ref, 1e-12)


def test_from_tree_is_a_shared_prefix_group():
    g = SharedPrefixGroup.from_tree([TreeSegment([1, 2], None), TreeSegment([3], 0),
                                     TreeSegment([4, 5], 0)], 0)
    assert g.tree.depth == 1 and g.group_size == 2


def test_a_changed_input_is_refused_mid_tree(mcore_single):
    """The replay guard covers a tree group: a loss mask changed in place after the first
    node's state is refused before the next use."""
    from scalerlt_mcore.shared_prefix import ReplayInputError

    R = 2
    model = build_model(R=R).double()
    group = tree_group(DEPTH2, R, seed=4)

    def mutate(phase, g):
        if phase == "prompt_producer":
            g.loss_mask.mul_(1.0)

    with pytest.raises(ReplayInputError, match="replay input 'loss_mask' changed"):
        joint_step(model, [group], LossSpec(), 2, phase_callback=mutate)


def _bushy(branches: int) -> list:
    """A long prompt, ``branches`` internal children of 4 tokens, each with two 3-token leaves."""
    shape = [(None, 24)]
    for _ in range(branches):
        node = len(shape)
        shape += [(0, 4), (node, 3), (node, 3)]
    return shape


def test_peak_saved_bytes_hold_one_path(mcore_single):
    """The schedule holds one root-to-leaf path of graphs (plus the adjoint leaves), also when
    it retains them: its peak saved bytes do not grow with the number of branches (up to
    per-token data of the group); naive training's do."""
    from scalerlt_mcore.shared_prefix import SavedTensorProbe

    R = 2
    model = build_model(R=R, arch=True).double()
    peaks = {}
    steps = {"joint": lambda g: joint_step(model, [g], LossSpec(), 2),
             "retain": lambda g: joint_step(model, [g], LossSpec(), 2, prompt="retain"),
             "naive": lambda g: naive_step(model, [g], LossSpec(), g.group_size)}
    for branches in (2, 4):
        group = tree_group(_bushy(branches), R, seed=branches)
        for name, step in steps.items():
            model.zero_grad(set_to_none=True)
            with SavedTensorProbe(model) as probe:
                step(group)
            peaks[name, branches] = probe.peak_bytes
    print(f"\n[tree saved-tensor peak] {peaks}")
    # Allowance: a few 8-byte entries per token of the bigger group (the saved views of its
    # token and label ids keep their whole storage, the per-row loss terms; measured 5.1 of
    # them), no activations: a second path's graphs would be several times that.
    G, T = group.tokens.shape
    for mode in ("joint", "retain"):
        assert 0 <= peaks[mode, 4] - peaks[mode, 2] <= 8 * G * T * 8, mode
    assert peaks["naive", 4] > 1.8 * peaks["naive", 2]
    assert peaks["joint", 4] < peaks["naive", 4] / 3


def test_recording_drift_reads_the_waves_positions(mcore_single):
    """``recording_drift`` over a tree: with old log-probs scored by the same weights, every
    loss call (node and leaf waves, each of its own span) records a drift of zero; with one
    trained token's old log-prob moved by 0.5, the step's max drift is that 0.5."""
    from scalerlt_mcore.rl.batch import recording_drift
    from scalerlt_mcore.rl.objective import rl_forward_step
    from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func

    R = 2
    model = build_model(R=R, arch=True).double()
    group = tree_group(DEPTH3, R, seed=7)
    with torch.no_grad():
        group.old_logprobs = model(group.tokens, labels=group.labels).logprobs  # [R, G, T]
    g, t = (group.loss_mask != 0).nonzero()[-1].tolist()
    fb = get_shared_prefix_forward_backward_func(2)
    drifts = {}
    for moved in (0.0, 0.5):
        group.old_logprobs[-1, g, t] -= moved
        drift = []
        fb(forward_step_func=recording_drift(rl_forward_step(LossSpec().objective()), drift),
           data_iterator=iter([group]), model=model, num_microbatches=1, seq_length=0,
           micro_batch_size=1)
        drifts[moved] = float(torch.stack(drift).max())
        assert len(drift) > 5  # node calls and leaf waves
    assert drifts[0.0] <= 1e-12 and abs(drifts[0.5] - 0.5) <= 1e-6  # it compares in fp32
