"""Joint replay is exact: same loss and same gradients as NAIVE training through stock MCore.

The reference (tests/helpers/sp.py) runs every response as a full, independent prompt+response
sequence through ``megatron.core.pipeline_parallel.get_forward_backward_func()``, one or more
responses per microbatch, with its own plain-PyTorch RL loss normalised over the whole group.
The schedule under test then runs on the same model state and the same group(s).

Tolerances (relative to each tensor's max |.|): fp64 1e-12, fp32 1e-6. The two computations
differ only in summation order (prompt once vs G times, waves, cascade attention), so the
error is a few units of roundoff amplified by depth, far below these bounds in fp64.
"""

from functools import partial

import pytest
import torch
from helpers.replay_exact import DTYPES, GRID, TOL, _assert_close_rel, _case_id
from helpers.sp import (
    LossSpec,
    build_model,
    grads,
    joint_step,
    make_group,
    naive_forward_step,
    naive_microbatches,
    naive_step,
    rel_errors,
)
from megatron.core.pipeline_parallel import get_forward_backward_func

from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func

MEASURED = {}  # dtype -> max relative error seen (printed at the end with -s)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for name, err in MEASURED.items():
        print(f"\n[joint replay exact] max relative grad error {name}: {err:.3e}")


def _record(dtype, errs: dict) -> float:
    worst = max(errs.values())
    key = str(dtype).replace("torch.", "")
    MEASURED[key] = max(MEASURED.get(key, 0.0), worst)
    return worst


def test_grid_covers_every_value():
    columns = list(zip(*GRID))
    wanted = [set(DTYPES), {1, 2, 5, 8}, {"1", "3", "G"}, {1, 3}, {False, True},
              {False, True}, {"token_mean", "seq_mean", "constant"},
              {"final", "uniform", "progressive"}, {0, 1}, {"cascade", "concat"},
              {"1", "2", "all"}]
    for col, values in zip(columns, wanted):
        assert set(col) == values


@pytest.mark.parametrize("row", GRID, ids=[_case_id(r) for r in GRID])
def test_joint_replay_matches_naive_mcore(mcore_single, row):
    dt, G, W, R, arch, ck, norm, lw, kl, attn, mb = row
    dtype = DTYPES[dt]
    P, S = 7 + G % 4, 3 + G % 3  # P in 7..10, S in 3..5: several shapes across the grid
    model = build_model(R=R, arch=arch, attn=attn).to(dtype)
    group = make_group(G, P, S, R, seed=100 + G, dtype=dtype, kl=bool(kl), group_id=G)
    spec = LossSpec(normalization=norm, clip_low=0.2, clip_high=0.28, kl_coef=0.1 * kl,
                    loop_weights=lw, constant_length=11 if (norm, G) == ("constant", 1) else 0)
    wave = {"1": 1, "3": 3, "G": G}[W]
    per_mb = {"1": 1, "2": 2, "all": G}[mb]

    model.zero_grad(set_to_none=True)
    naive_losses, _ = naive_step(model, [group], spec, per_mb)
    ref = grads(model)

    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, wave, checkpoint_waves=ck)
    got = grads(model)

    tol = TOL[dtype]
    assert len(out) == 1 and out[0]["num_waves"] == -(-G // wave)
    _assert_close_rel(out[0]["loss"], naive_losses[0], tol, "group loss")
    errs = rel_errors(got, ref)
    worst = _record(dtype, errs)
    bad = {n: e for n, e in errs.items() if e > tol}
    assert not bad, f"grads differ beyond {tol:.0e} (worst {worst:.3e}): {bad}"


@pytest.mark.parametrize("norm,wave,ck,per_mb", [
    ("token_mean", 2, False, 3),
    ("seq_mean", 3, True, 1),
    ("constant", 1, True, 2),
])
def test_two_groups_in_one_step(mcore_single, norm, wave, ck, per_mb):
    """num_microbatches=2: two groups (different P and S) vs naive over all their responses;
    the step loss is the mean of the group losses as MCore averages microbatches."""
    R = 2
    model = build_model(R=R, arch=True).double()
    groups = [make_group(5, 9, 4, R, seed=1, kl=True, group_id=3),
              make_group(4, 6, 6, R, seed=2, kl=True, group_id=4)]
    spec = LossSpec(normalization=norm, kl_coef=0.05, loop_weights="progressive")

    model.zero_grad(set_to_none=True)
    naive_losses, _ = naive_step(model, groups, spec, per_mb)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, groups, spec, wave, checkpoint_waves=ck)
    got = grads(model)

    assert len(out) == 2
    for k in range(2):
        _assert_close_rel(out[k]["loss"], naive_losses[k], 1e-12, f"group {k} loss")
    errs = rel_errors(got, ref)
    _record(torch.float64, errs)
    assert max(errs.values()) <= 1e-12, errs


@pytest.mark.parametrize("dt,norm,lw,wave,ck,prompt", [
    ("f64", "token_mean", "progressive", 2, False, "recompute"),
    ("f64", "seq_mean", "final", 3, True, "retain"),
    ("f32", "constant", "uniform", 1, False, "retain"),
    ("f32", "token_mean", "progressive", 4, True, "recompute"),
])
def test_entropy_term_matches_naive(mcore_single, dt, norm, lw, wave, ck, prompt):
    """Megatron-LM's GRPO entropy term (``entropy_weight``, with KL on): joint replay's loss
    and grads equal naive training's through stock MCore, whose loss is the separately
    written reference (``ref_rl_loss``)."""
    dtype = DTYPES[dt]
    R, G, P, S = 3, 6, 9, 5
    model = build_model(R=R, arch=True).to(dtype)
    group = make_group(G, P, S, R, seed=21, dtype=dtype, kl=True)
    spec = LossSpec(normalization=norm, kl_coef=0.05, loop_weights=lw, entropy_weight=0.3)
    model.zero_grad(set_to_none=True)
    naive_losses, _ = naive_step(model, [group], spec, 2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, wave, checkpoint_waves=ck, prompt=prompt)
    got = grads(model)
    tol = TOL[dtype]
    _assert_close_rel(out[0]["loss"], naive_losses[0], tol, "group loss")
    errs = rel_errors(got, ref)
    _record(dtype, errs)
    assert max(errs.values()) <= tol, errs
    # the term changes the gradient: without it the same step differs
    model.zero_grad(set_to_none=True)
    joint_step(model, [group], LossSpec(normalization=norm, kl_coef=0.05, loop_weights=lw),
               wave, checkpoint_waves=ck, prompt=prompt)
    assert max(rel_errors(grads(model), got).values()) > 100 * tol


def _naive_scores(model, group, spec, per_mb):
    _, store = naive_step(model, [group], spec, per_mb, forward_only=True)
    return torch.cat([o["logprobs"] for o in store], dim=1)  # [R, G, T]


@pytest.mark.parametrize("dt,attn,wave", [("f64", "cascade", 2), ("f32", "concat", 3)])
def test_forward_only_scores_match_naive(mcore_single, dt, attn, wave):
    dtype = DTYPES[dt]
    R, G, P, S = 3, 5, 8, 5
    model = build_model(R=R, arch=True, attn=attn).to(dtype)
    group = make_group(G, P, S, R, seed=5, dtype=dtype)
    spec = LossSpec()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        ref = _naive_scores(model, group, spec, per_mb=2)

    out = joint_step(model, [group], spec, wave, forward_only=True)  # grad mode on
    lp = out[0]["logprobs"]
    assert lp.shape == (R, G, P + S)
    assert not lp.requires_grad and lp.grad_fn is None
    assert all(p.grad is None for p in model.parameters())
    on = group.loss_mask != 0  # [G, T]
    _assert_close_rel(lp[:, on], ref[:, on], TOL[dtype], "forward_only log-probs")
    assert (lp[:, :, : P - 1] == 0).all()


def test_forward_only_scores_need_no_advantages(mcore_single):
    """Scoring a group that has no advantages / old log-probs (e.g. for a new policy)."""
    model = build_model(R=2).double()
    group = make_group(3, 6, 4, 2, seed=9)
    ref = _naive_scores(model, group, LossSpec(), per_mb=3).detach()
    group.advantages = group.old_logprobs = None
    out = joint_step(model, [group], LossSpec(), 2, forward_only=True)
    on = group.loss_mask != 0
    _assert_close_rel(out[0]["logprobs"][:, on], ref[:, on], 1e-12, "log-probs")


@pytest.mark.parametrize("forward_only", [False, True])
def test_dict_batches_go_to_stock_mcore(mcore_single, forward_only):
    """A step of plain dict microbatches is exactly stock MCore's step."""
    R = 2
    model = build_model(R=R, arch=True).double()
    groups = [make_group(4, 7, 4, R, seed=3, kl=True)]
    spec = LossSpec(normalization="seq_mean", kl_coef=0.1, loop_weights="uniform")
    batches = naive_microbatches(groups, spec, per_mb=2)
    step = partial(naive_forward_step, spec, float(len(batches)))
    kwargs = dict(forward_step_func=step, model=model, num_microbatches=len(batches),
                  seq_length=0, micro_batch_size=1, forward_only=forward_only)

    model.zero_grad(set_to_none=True)
    stock = get_forward_backward_func()(data_iterator=iter(batches), **kwargs)
    stock_grads = grads(model)
    model.zero_grad(set_to_none=True)
    schedule = get_shared_prefix_forward_backward_func(2)
    ours = schedule(data_iterator=iter(batches), **kwargs)
    ours_grads = grads(model)

    assert len(ours) == len(stock) == len(batches)
    for a, b in zip(ours, stock):
        assert a["group"] == b["group"]
        assert torch.equal(a["loss"], b["loss"]) and torch.equal(a["logprobs"], b["logprobs"])
    for n in stock_grads:
        assert torch.equal(ours_grads[n], stock_grads[n]), n
    if forward_only:
        assert all(p.grad is None for p in model.parameters())


def test_bool_loss_mask(mcore_single):
    """A bool loss mask (allowed by SharedPrefixGroup) trains exactly like the float one."""
    R = 2
    model = build_model(R=R, arch=True).double()
    group = make_group(5, 8, 4, R, seed=12, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.1)
    naive_step(model, [group], spec, per_mb=2)
    ref = grads(model)
    group.loss_mask = group.loss_mask != 0
    model.zero_grad(set_to_none=True)
    joint_step(model, [group], spec, 2, checkpoint_waves=True)
    errs = rel_errors(grads(model), ref)
    assert max(errs.values()) <= 1e-12, errs


@pytest.mark.parametrize("prompt", ["recompute", "retain"])
def test_grad_scale_func_applied_like_stock(mcore_single, prompt):
    """MCore's loss scaling (config.grad_scale_func) scales joint replay's grads, including
    the prefix adjoints of earlier waves (through the retained prompt graph too), exactly as
    it scales the stock step's."""
    R = 2
    model = build_model(R=R, arch=True).double()
    groups = [make_group(5, 8, 4, R, seed=13), make_group(3, 6, 3, R, seed=14)]
    spec = LossSpec(loop_weights="progressive")
    model.config.grad_scale_func = lambda loss: loss * 1024.0
    try:
        naive_step(model, groups, spec, per_mb=2)
        ref = grads(model)
        model.zero_grad(set_to_none=True)
        joint_step(model, groups, spec, 2, prompt=prompt)
        got = grads(model)
    finally:
        model.config.grad_scale_func = None
    model.zero_grad(set_to_none=True)
    joint_step(model, groups, spec, 2, prompt=prompt)
    unscaled = grads(model)
    assert max(rel_errors(got, ref).values()) <= 1e-12
    assert max(rel_errors({n: g / 1024.0 for n, g in got.items()}, unscaled).values()) <= 1e-12


def test_result_values_average_like_megatron_lm(mcore_single):
    """Megatron-LM's train_step averages every value of the returned loss dicts with
    ``torch.cat([x[key].view(-1) for x in losses]).mean()``: every value must be a floating
    tensor (an integer num_waves would make ``mean`` raise)."""
    model = build_model(R=2).double()
    groups = [make_group(5, 6, 3, 2, seed=21, group_id=0), make_group(3, 6, 3, 2, seed=22)]
    out = joint_step(model, groups, LossSpec(), 2)
    for key in out[0]:
        values = torch.cat([o[key].view(-1) for o in out])
        assert values.is_floating_point(), key
        values.mean()
    assert [float(o["num_waves"]) for o in out] == [3.0, 2.0]
