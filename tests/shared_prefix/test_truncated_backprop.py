"""Truncated backprop through loops (``looped_backprop_loops`` = k, Huginn).

1. The model's gradients with k match the independent plain-PyTorch reference
   (tests/helpers/reference_looped.py) whose first R - k loops and their readouts run under no_grad.
2. Joint replay with k matches NAIVE training through stock MCore with the same model
   (tests/helpers/sp.py): fp64 <= 1e-12, fp32 <= 1e-6 relative per tensor.
3. Under joint replay the prefix K/V of graph-free depths is not a grad leaf and gets no
   adjoint; the saved bytes and adjoint bytes shrink against full backprop (printed with -s).
"""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from helpers.fp32_exact import fp64_group, fp64_twin, whole_gradient_error
from helpers.reference_looped import RefConfig, reference_forward, weights_from_state_dict
from helpers.sp import (
    LossSpec,
    build_model,
    grads,
    joint_step,
    make_group,
    naive_step,
    rel_errors,
    rel_errors_with_zeros,
)

from scalerlt_mcore.model.kv import trained_depths
from scalerlt_mcore.rl.objective import rl_forward_step
from scalerlt_mcore.shared_prefix import SavedTensorProbe
from scalerlt_mcore.shared_prefix.schedule import SharedPrefixSchedule
from scalerlt_mcore.shared_prefix.tree_schedule import TreeReplay

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
F32_FACTOR = 1.5
"""An fp32 joint loss may be up to this many times as far from the exact loss as stock
MCore's fp32 naive run is (where that run itself rounds further than TOL)."""


def _set_k(model, k: int):
    model.config.looped_backprop_loops = k
    return model


# ---- the model against the independent reference ----------------------------------------


def _flat(weights: dict) -> dict:
    """The reference's nested weights as {name: tensor} (None entries dropped)."""
    out = {}
    for key, value in weights.items():
        if isinstance(value, list):
            for i, layer in enumerate(value):
                out.update({f"{key}.{i}.{n}": t for n, t in layer.items()})
        elif value is not None:
            out[key] = value
    return out


@pytest.mark.parametrize("R,k", [(3, 1), (3, 2), (4, 1), (2, 0)])
def test_gradients_match_reference(mcore_single, R, k):
    """Loss sum_r (r+1) * mean NLL_r over every loop's readout: grads of the model with k vs
    the reference's (parameter grads mapped by the same layout as the weights)."""
    model = _set_k(build_model(R=R, arch=True).double(), k)
    ref_cfg = RefConfig(hidden=16, heads=2, groups=2, n_core=2, n_prelude=1, n_coda=1,
                        loops=R, injection="linear_concat", backprop_loops=k)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 48, (2, 9), generator=gen)
    labels = torch.randint(0, 48, (2, 9), generator=gen)
    weights = _flat(weights_from_state_dict(model.state_dict(), ref_cfg))
    for t in weights.values():
        t.requires_grad_(True)
    nested = weights_from_state_dict(model.state_dict(), ref_cfg)
    _rebind(nested, weights)
    logits, _ = reference_forward(nested, ref_cfg, tokens)
    ref_loss = sum((r + 1) * F.cross_entropy(lg.reshape(-1, 48), labels.reshape(-1))
                   for r, lg in enumerate(logits))
    ref_loss.backward()

    model.zero_grad(set_to_none=True)
    logprobs = model(tokens, labels=labels).logprobs  # [R, B, S]
    loss = sum(-(r + 1) * logprobs[r].mean() for r in range(R))
    loss.backward()
    got = _flat(weights_from_state_dict(grads(model), ref_cfg))

    assert abs(float(loss) - float(ref_loss)) <= 1e-12 * abs(float(ref_loss))
    ref_grads = {n: w.grad if w.grad is not None else torch.zeros_like(w)
                 for n, w in weights.items()}
    largest = max(float(g.abs().max()) for g in ref_grads.values())
    for name, g in ref_grads.items():
        # a key bias has an exactly-zero gradient (softmax ignores a per-query shift): its
        # roundoff is measured against the largest gradient instead of its own
        scale = largest if name.endswith(".bk") else float(g.abs().max())
        assert float((got[name] - g).abs().max()) <= 1e-12 * scale, name
    assert float(weights["core.0.w1"].grad.abs().max()) > 0  # the trained loops reach the core


def _rebind(nested: dict, flat: dict) -> None:
    """Point the nested weights at the grad-requiring tensors of ``flat``."""
    for key, value in nested.items():
        if isinstance(value, list):
            for i, layer in enumerate(value):
                for n in layer:
                    layer[n] = flat[f"{key}.{i}.{n}"]
        elif value is not None:
            nested[key] = flat[key]


def test_truncation_changes_the_gradient(mcore_single):
    """k < R drops the graph of the first loops: the grads differ from full backprop, and
    the loss value (which still reads every loop) does not."""
    group = make_group(4, 7, 4, 3, seed=2)
    spec = LossSpec(loop_weights="uniform")
    model = build_model(R=3, arch=True).double()
    full_losses, _ = naive_step(model, [group], spec, per_mb=2)
    full = grads(model)
    model.zero_grad(set_to_none=True)
    cut_losses, _ = naive_step(_set_k(model, 1), [group], spec, per_mb=2)
    cut = grads(model)
    assert abs(float(full_losses[0]) - float(cut_losses[0])) <= 1e-12 * abs(float(full_losses[0]))
    assert max(rel_errors(cut, full).values()) > 1e-3


# ---- joint replay against naive stock MCore ----------------------------------------------


def _rel_errors(got: dict, ref: dict, arch: bool) -> dict:
    """``rel_errors``; without injection the embeddings reach no trained loop when k < R
    (the detached state cuts them off): their grads must be exactly zero on both sides."""
    cut = set() if arch else {"embedding.word_embeddings.weight",
                              "embedding.position_embeddings.weight"}
    return rel_errors_with_zeros(got, ref, cut)


# dtype, G, W, R, k, arch (prelude + coda + injection), checkpoint waves, loop weights, attn
GRID = [
    ("f64", 5, 2, 3, 1, True, False, "uniform", "cascade"),
    ("f64", 8, 3, 4, 2, False, True, "progressive", "concat"),
    ("f64", 3, 3, 2, 1, True, True, "final", "cascade"),
    ("f32", 5, 2, 3, 2, True, False, "progressive", "cascade"),
    ("f32", 6, 4, 4, 1, True, True, "uniform", "concat"),
    ("f64", 4, 1, 3, 3, True, False, "uniform", "cascade"),  # k = R: every loop trains
]
DTYPES = {"f64": torch.float64, "f32": torch.float32}


@pytest.mark.parametrize("row", GRID, ids=["-".join(map(str, r)) for r in GRID])
def test_joint_replay_matches_naive(mcore_single, row):
    dt, G, W, R, k, arch, ck, lw, attn = row
    dtype = DTYPES[dt]
    model = _set_k(build_model(R=R, arch=arch, attn=attn).to(dtype), k)
    group = make_group(G, 8, 4, R, seed=40 + G, dtype=dtype, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights=lw)
    if dtype == torch.float32:  # the exact run of the same weights (tests/helpers/fp32_exact.py)
        exact_model = fp64_twin(model, _set_k(build_model(R=R, arch=arch, attn=attn).double(), k))
        naive_losses, _ = naive_step(exact_model, [fp64_group(group)], spec, per_mb=2)
        ref = grads(exact_model)
        # stock MCore's own fp32 run of the same step: how far this host's fp32 rounds from
        # the exact loss (1.37e-6 of a 0.029 loss on an AVX-512 host, under 1e-6 on others)
        f32_losses, _ = naive_step(model, [group], spec, per_mb=2)
        model.zero_grad(set_to_none=True)
    else:
        naive_losses, _ = naive_step(model, [group], spec, per_mb=2)
        ref = grads(model)
        model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, W, checkpoint_waves=ck)
    tol = TOL[dtype]
    exact = float(naive_losses[0])
    loss_err = abs(float(out[0]["loss"]) - exact) / abs(exact)
    if dtype == torch.float32:  # no further from the exact loss than stock MCore's fp32 run
        assert loss_err <= max(tol, F32_FACTOR * abs(float(f32_losses[0]) - exact) / abs(exact))
    else:
        assert loss_err <= tol
    errs = _rel_errors(grads(model), ref, arch or k >= R)  # zeros checked on both sides
    if dtype == torch.float32:
        assert whole_gradient_error(grads(model), ref) <= tol, errs
    else:
        assert max(errs.values()) <= tol, {n: e for n, e in errs.items() if e > tol}


def test_two_groups_in_one_step(mcore_single):
    R = 3
    model = _set_k(build_model(R=R, arch=True).double(), 2)
    groups = [make_group(5, 9, 4, R, seed=1, group_id=3), make_group(4, 6, 6, R, seed=2)]
    spec = LossSpec(normalization="token_mean", loop_weights="progressive")
    naive_step(model, groups, spec, per_mb=3)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    joint_step(model, groups, spec, 2, checkpoint_waves=True)
    assert max(_rel_errors(grads(model), ref, True).values()) <= 1e-12


# ---- no adjoints for graph-free depths; bytes against full backprop ----------------------


class _AdjointBytes:
    """Wraps the replay engine's descent of the root (``TreeReplay._descend``), recording, once
    every wave but the last has run, the bytes of the prefix adjoints (the root's leaves'
    grads) and the leaves' grad flags."""

    def __init__(self):
        self.adjoint_bytes, self.leaf_flags, self.descend = 0, [], TreeReplay._descend

    def __call__(self, engine, n, prefix, chain):
        links = self.descend(engine, n, prefix, chain)
        leaves = links[0].leaves.tensors()
        self.leaf_flags = [t.requires_grad for t in leaves]
        self.adjoint_bytes = sum(t.grad.numel() * t.grad.element_size() for t in leaves
                                 if t.grad is not None)
        return links


def _measure(model, group, wave: int) -> tuple:
    schedule, record = SharedPrefixSchedule(wave), _AdjointBytes()
    model.zero_grad(set_to_none=True)
    with (SavedTensorProbe(model) as probe,
          mock.patch.object(TreeReplay, "_descend", autospec=True, side_effect=record)):
        schedule(forward_step_func=rl_forward_step(LossSpec(loop_weights="uniform").objective()),
                 data_iterator=iter([group]), model=model, num_microbatches=1, seq_length=0,
                 micro_batch_size=1)
    return probe.peak_bytes, record.adjoint_bytes, record.leaf_flags


def test_graph_free_depths_get_no_adjoint(mcore_single):
    """R=4, one prelude and one coda layer: k=1 keeps leaves for the prelude depth and the
    last loop's three depths only; the adjoint bytes are exactly those depths' K/V (fp32)
    plus the boundary, and the saved and adjoint bytes fall against full backprop."""
    R, G, P, S, W, H = 4, 8, 32, 8, 2, 32
    model = build_model(R=R, arch=True, hidden=H, heads=4)
    group = make_group(G, P, S, R, seed=0, dtype=torch.float32)
    results = {}
    for k in (0, 2, 1):
        _set_k(model, k)
        results[k] = _measure(model, group, W)
        flags = trained_depths(model.config)
        assert results[k][2] == [*flags, *flags, True]
    kv = 2 * P * H * 4  # one depth's K and V in fp32
    boundary = R * H * 4
    per_loop = 3  # 2 core + 1 coda depths
    for k, n_loops in ((0, R), (2, 2), (1, 1)):
        assert results[k][1] == (1 + per_loop * n_loops) * kv + boundary
    assert results[1][0] < results[2][0] < results[0][0]
    for k in (0, 2, 1):
        saved, adj, _ = results[k]
        print(f"\n[truncated backprop] R={R} k={k or R} G={G} P={P} S={S} W={W} H={H}: "
              f"peak saved {saved} B ({saved / results[0][0]:.3f} of full), prefix adjoints "
              f"{adj} B ({adj / results[0][1]:.3f} of full)")


def test_negative_k_is_refused(mcore_single):
    with pytest.raises(ValueError, match="looped_backprop_loops must be an integer >= 0, got -1"):
        build_model(R=2, looped_backprop_loops=-1)


@pytest.mark.parametrize("dt", ["f64", "f32"])
def test_retained_prompt_matches_naive(mcore_single, dt):
    """The retained-prompt path (prompt='retain': the prompt graph is kept, built only for
    the trained loops) with k = 1 of R = 3, against naive stock MCore."""
    dtype = DTYPES[dt]
    model = _set_k(build_model(R=3, arch=True).to(dtype), 1)
    group = make_group(5, 8, 4, 3, seed=77, dtype=dtype, kl=True)
    spec = LossSpec(normalization="token_mean", kl_coef=0.05, loop_weights="uniform")
    naive_step(model, [group], spec, per_mb=2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, 2, prompt="retain")
    assert float(out[0]["retain"]) == 1.0
    assert max(rel_errors(grads(model), ref).values()) <= TOL[dtype]
