"""The step-wide token mean (DAPO's token-level loss) through MCore's per-token-loss contract.

With ``config.calculate_per_token_loss`` each loss call returns (its token sum, its token
count, stats); MCore's schedule does not divide by the number of microbatches, sums the counts
and passes them to ``finalize_model_grads_func(model, num_tokens)``, which all-reduces them
over data-parallel ranks and divides the gradients by the total. The reference here is STOCK
MCore ``get_forward_backward_func()`` on naive microbatches (full sequences), with the RL loss
of tests/helpers/sp.py (``ref_rl_loss``, plain PyTorch) summed over the trained tokens: the
shared-prefix schedule (joint replay, naive plans, prefix trees) and ``naive_step`` must give
the same gradients, the same token count to finalize, and the same [sum, count] reports.

The groups have different trained-token counts, so the step-wide mean differs from the mean of
per-group token means; the tests assert that it does, so a schedule that normalised per group
would fail them.
"""

from functools import partial

import pytest
import torch
from helpers.ddp import _build, _global_rel_error, _reduced_grads
from helpers.sp import (
    LossSpec,
    build_model,
    grads,
    joint_step,
    make_group,
    ref_loop_weights,
    ref_rl_loss,
    rel_errors,
)
from helpers.tree import DEPTH2, DEPTH3, tree_group
from megatron.core.pipeline_parallel import get_forward_backward_func

from scalerlt_mcore.rl.objective import rl_forward_step
from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func
from scalerlt_mcore.shared_prefix.naive import naive_step
from scalerlt_mcore.testing import run_distributed

R = 3
TOL = 1e-12
"""fp64, relative to each tensor's max |.|: the schedules differ in summation order only."""
DDP_TOL = 1e-6
"""fp32 under DDP, over the whole reduced gradient (as test_joint_replay_ddp.py)."""
SPEC = LossSpec(normalization="step_token_mean", clip_low=0.2, clip_high=0.28, kl_coef=0.1,
                loop_weights="progressive")


class Finalize:
    """A one-process ``finalize_model_grads_func``: records the ``num_tokens`` it is given and
    divides every gradient by it, as MCore's finalize_model_grads does after its all-reduce
    (over one rank, the identity)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, models, num_tokens, pg_collection=None, force_all_reduce=False):
        self.calls.append(None if num_tokens is None else int(num_tokens))
        if num_tokens is not None:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad /= num_tokens


# ---- the stock-MCore reference ------------------------------------------------------------


def _ref_microbatches(groups, per_mb: int) -> list:
    """Every row of every group a full sequence, ``per_mb`` rows of one group a microbatch."""
    return [dict(group=k, tokens=g.tokens[i], labels=g.labels[i], mask=g.loss_mask[i],
                 adv=g.advantages[i], old=g.old_logprobs[:, i],
                 ref=None if g.ref_logprobs is None else g.ref_logprobs[:, i])
            for k, g in enumerate(groups) for i in torch.arange(g.group_size).split(per_mb)]


def _ref_forward_step(data_iterator, model):
    """MCore forward_step_func with Megatron-LM's per-token loss_func: (masked token sum,
    token count, {name: [sum, count]})."""
    b = next(data_iterator)
    logprobs = model(b["tokens"], labels=b["labels"]).logprobs  # [R, b, T]

    def loss_func(output):
        loss = ref_rl_loss(SPEC, output, b["old"], b["adv"], b["mask"], b["ref"])
        n = (b["mask"] != 0).sum().to(torch.int)
        return loss, n, {"loss": torch.stack([loss.detach(), n.to(loss.dtype)]),
                         "group": b["group"]}

    return logprobs, loss_func


def _ref_step(model, groups, per_mb: int = 2) -> list:
    batches = _ref_microbatches(groups, per_mb)
    return get_forward_backward_func()(
        forward_step_func=_ref_forward_step, data_iterator=iter(batches), model=model,
        num_microbatches=len(batches), seq_length=0, micro_batch_size=1)


def _group_pairs(out: list, num_groups: int) -> list:
    """The reference's [sum, count] per group (its microbatches' pairs summed)."""
    return [sum(o["loss"] for o in out if o["group"] == k) for k in range(num_groups)]


# ---- single process, fp64 -----------------------------------------------------------------


def _model(per_token: bool = True):
    model = build_model(R=R, arch=True, calculate_per_token_loss=per_token).double()
    model.config.finalize_model_grads_func = Finalize(model)
    return model


def _flat_groups() -> list:
    return [make_group(3, 7, 5, R, seed=11, kl=True, group_id=0),
            make_group(5, 9, 4, R, seed=12, kl=True, group_id=1),
            make_group(2, 8, 4, R, seed=13, kl=True, group_id=2)]


def _tree_groups() -> list:
    return [tree_group(DEPTH2, R, seed=21, kl=True, group_id=0),
            make_group(4, 6, 5, R, seed=22, kl=True, group_id=1),
            tree_group(DEPTH3, R, seed=23, kl=True, group_id=2)]


def _reference(model, groups) -> tuple:
    """(grads, the num_tokens finalize got, per-group [sum, count]) of stock MCore."""
    model.zero_grad(set_to_none=True)
    out = _ref_step(model, groups)
    return grads(model), model.config.finalize_model_grads_func.calls.pop(), \
        _group_pairs(out, len(groups))


def _check_against_reference(model, groups, out, ref) -> dict:
    ref_grads, ref_tokens, ref_pairs = ref
    assert model.config.finalize_model_grads_func.calls.pop() == ref_tokens
    assert ref_tokens == int(sum((g.loss_mask != 0).sum() for g in groups))
    errs = rel_errors(grads(model), ref_grads)
    assert max(errs.values()) <= TOL, errs
    for got, want in zip(out, ref_pairs):
        assert got["loss"].shape == (2,)
        assert got["loss"][1] == want[1]
        assert abs(float(got["loss"][0] - want[0])) <= TOL * abs(float(want[0]))
    return errs


def test_groups_differ_in_tokens_so_step_and_group_means_differ(mcore_single):
    """The data can tell the step-wide mean from the per-group one: token counts differ, and
    so do the losses and the gradients (per-group token_mean through the schedule)."""
    for groups in (_flat_groups(), _tree_groups()):
        counts = [int((g.loss_mask != 0).sum()) for g in groups]
        assert len(set(counts)) == len(counts), counts
        model = _model()
        _, tokens, pairs = _reference(model, groups)
        step_mean = float(sum(p[0] for p in pairs)) / tokens
        group_mean = sum(float(p[0] / p[1]) for p in pairs) / len(groups)
        assert abs(step_mean - group_mean) > 1e-3 * abs(step_mean), (step_mean, group_mean)
        ref_grads = grads(model)
        per_group = _model(per_token=False)
        per_group.load_state_dict(model.state_dict())
        per_group.zero_grad(set_to_none=True)
        joint_step(per_group, groups, LossSpec(normalization="token_mean", clip_low=0.2,
                                               clip_high=0.28, kl_coef=0.1,
                                               loop_weights="progressive"), 2)
        assert max(rel_errors(grads(per_group), ref_grads).values()) > 1e-3


@pytest.mark.parametrize("wave, plan", [
    (1, {"prompt": "recompute"}),
    (2, {"prompt": "retain"}),
    (2, {"prompt": "recompute", "checkpoint_waves": True}),
    (5, {"prompt": "retain"}),
    (2, {"schedule": "naive", "naive_micro_batch_size": 2}),
], ids=["w1-recompute", "w2-retain", "w2-recompute-ckpt", "w5-retain", "naive-plan"])
def test_joint_replay_per_token_matches_stock_mcore(mcore_single, wave, plan):
    model = _model()
    groups = _flat_groups()
    ref = _reference(model, groups)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, groups, SPEC, wave, **plan)
    errs = _check_against_reference(model, groups, out, ref)
    print(f"\n[per-token joint replay] max relative grad error {max(errs.values()):.3e}")


@pytest.mark.parametrize("prompt", ["recompute", "retain"])
def test_tree_groups_per_token_match_stock_mcore(mcore_single, prompt):
    model = _model()
    groups = _tree_groups()
    ref = _reference(model, groups)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, groups, SPEC, 2, prompt=prompt)
    errs = _check_against_reference(model, groups, out, ref)
    print(f"\n[per-token trees] max relative grad error {max(errs.values()):.3e}")


def test_naive_step_per_token_matches_stock_mcore(mcore_single):
    model = _model()
    groups = _tree_groups()
    ref = _reference(model, groups)
    model.zero_grad(set_to_none=True)
    out = naive_step(model, groups, rl_forward_step(SPEC.objective()), micro_batch_size=3)
    got, want = sum(o["loss"] for o in out), sum(ref[2])  # the step's [sum, count]
    assert got[1] == want[1]
    assert abs(float(got[0] - want[0])) <= TOL * abs(float(want[0]))
    _check_against_reference(model, groups, [], ref)


def test_scoring_per_token_reports_pairs(mcore_single):
    """forward_only without non-loss data: each group's [sum, count], one-level and tree."""
    model = _model()
    groups = _tree_groups()
    batches = _ref_microbatches(groups, 2)
    ref_pairs = _group_pairs(get_forward_backward_func()(
        forward_step_func=_ref_forward_step, data_iterator=iter(batches), model=model,
        num_microbatches=len(batches), seq_length=0, micro_batch_size=1, forward_only=True),
        len(groups))
    fb = get_shared_prefix_forward_backward_func(2, prompt="retain")
    out = fb(forward_step_func=rl_forward_step(SPEC.objective()), data_iterator=iter(groups),
             model=model, num_microbatches=len(groups), seq_length=0, micro_batch_size=1,
             forward_only=True)
    for got, want in zip(out, ref_pairs):
        assert got["loss"][1] == want[1]
        assert abs(float(got["loss"][0] - want[0])) <= TOL * abs(float(want[0]))


# ---- refusals ------------------------------------------------------------------------------


def _no_grads(model) -> bool:
    return all(p.grad is None for p in model.parameters())


def test_per_token_config_refuses_a_group_normalised_loss(mcore_single):
    model = _model()
    spec = LossSpec(normalization="token_mean")
    with pytest.raises(ValueError, match=r"calculate_per_token_loss: the loss_func must return "
                                         r"\(loss summed over the wave's tokens, num_tokens"):
        joint_step(model, _flat_groups(), spec, 2)
    assert _no_grads(model)
    with pytest.raises(ValueError, match="calculate_per_token_loss: the loss_func must return"):
        naive_step(model, _flat_groups(), rl_forward_step(spec.objective()), 2)
    assert _no_grads(model)


def test_token_sum_loss_needs_the_per_token_config(mcore_single):
    model = _model(per_token=False)
    with pytest.raises(ValueError, match=r"\(loss, num_tokens, stats\) needs "
                                         r"config.calculate_per_token_loss"):
        joint_step(model, _flat_groups(), SPEC, 2)
    assert _no_grads(model)
    with pytest.raises(ValueError, match=r"needs config.calculate_per_token_loss"):
        naive_step(model, _flat_groups(), rl_forward_step(SPEC.objective()), 2)
    assert _no_grads(model)


def test_a_row_without_trained_tokens_is_still_refused(mcore_single):
    model = _model()
    groups = _flat_groups()
    groups[1].loss_mask[2] = 0
    with pytest.raises(ValueError, match="response 2 has no trained token"):
        joint_step(model, groups, SPEC, 2)
    with pytest.raises(ValueError, match="response 2 has no trained token"):
        naive_step(model, groups, rl_forward_step(SPEC.objective()), 2)
    assert _no_grads(model)


# ---- two data-parallel ranks under MCore DDP ------------------------------------------------


def _rank_groups(step: int, rank: int) -> list:
    """Different groups and token counts on the two ranks (fp32, as the DDP model)."""
    seed = 100 * step + 10 * rank
    if rank == 0:
        return [make_group(3, 5, 4, R, seed=seed, dtype=torch.float32, kl=True, group_id=0),
                tree_group(DEPTH2, R, seed=seed + 1, dtype=torch.float32, kl=True, group_id=1)]
    return [make_group(5, 6, 5, R, seed=seed, dtype=torch.float32, kl=True, group_id=0)]


def _recording(config) -> list:
    """Wrap ``config.finalize_model_grads_func``: the num_tokens it leaves (all-reduced)."""
    finalize, seen = config.finalize_model_grads_func, []

    def recorded(model, num_tokens, **kwargs):
        finalize(model, num_tokens, **kwargs)
        seen.append(None if num_tokens is None else int(num_tokens))

    config.finalize_model_grads_func = recorded
    return seen


def _ddp_worker(rank: int, world_size: int) -> dict:
    joint, opt = _build(True, calculate_per_token_loss=True)
    stock, _ = _build(True, calculate_per_token_loss=True)
    seen = {"joint": _recording(joint.config), "stock": _recording(stock.config)}
    report = {"errors": [], "local": [], "seen": seen}
    for step in range(2):
        groups = _rank_groups(step, rank)
        with torch.no_grad():
            for p, q in zip(stock.module.parameters(), joint.module.parameters()):
                p.copy_(q)
        for m in (joint, stock):
            m.zero_grad_buffer()
        opt.zero_grad()
        joint_step(joint, groups, SPEC, 2, prompt="retain" if step else "recompute")
        _ref_step(stock, groups)
        report["local"].append(int(sum((g.loss_mask != 0).sum() for g in groups)))
        report["errors"].append(_global_rel_error(_reduced_grads(joint, rank, world_size),
                                                  _reduced_grads(stock, rank, world_size)))
        opt.step()
    return report


def test_per_token_under_ddp_matches_stock_mcore():
    """2 gloo ranks with different token counts: finalize gets the count summed over both,
    and the reduced gradients equal stock MCore's on the naive microbatches."""
    reports = run_distributed(_ddp_worker, 2, timeout=600)
    totals = [a + b for a, b in zip(reports[0]["local"], reports[1]["local"])]
    for step in range(2):
        assert reports[0]["local"][step] != reports[1]["local"][step]
    for rank, r in enumerate(reports):
        assert r["seen"]["joint"] == totals, (rank, r["seen"])
        assert r["seen"]["stock"] == totals, (rank, r["seen"])
        assert max(r["errors"]) <= DDP_TOL, (rank, r["errors"])
    print(f"\n[per-token DDP] max reduced-gradient error "
          f"{max(max(r['errors']) for r in reports):.3e}")



# ---- the supervised warm-up and the step's summary -----------------------------------------


def test_warmup_nll_is_the_step_token_mean(mcore_single):
    """``sft_forward_step`` under the per-token config through stock MCore: two microbatches
    of different answer lengths give the gradient of the NLL summed over both, divided by
    their answer tokens (plain PyTorch here), not the mean of the two token means."""
    from scalerlt_mcore.rl.sft import sft_batch, sft_forward_step

    gen = torch.Generator().manual_seed(5)
    batches = [sft_batch([torch.randint(1, 40, (p,), generator=gen).tolist() for p in ps],
                         [torch.randint(1, 40, (a,), generator=gen).tolist() for a in ans], 0)
               for ps, ans in (((4, 6), (2, 5)), ((5, 3, 4), (1, 1, 3)))]
    model = _model()
    get_forward_backward_func()(
        forward_step_func=partial(sft_forward_step, SPEC.objective()), model=model,
        data_iterator=iter(batches), num_microbatches=2, seq_length=0, micro_batch_size=1)
    got = grads(model)
    assert model.config.finalize_model_grads_func.calls == [7 + 5]
    model.zero_grad(set_to_none=True)
    w = torch.tensor(ref_loop_weights(SPEC.loop_weights, R), dtype=torch.float64)[:, None, None]
    nll = [-(w * model(b["tokens"], labels=b["labels"]).logprobs * b["mask"]).sum()
           for b in batches]
    (sum(nll) / 12).backward()
    assert max(rel_errors(got, grads(model)).values()) <= TOL
    means = [float(n) / float(b["mask"].sum()) for n, b in zip(nll, batches)]
    assert abs(sum(means) / 2 - float(sum(nll)) / 12) > 1e-3


def test_summary_loss_is_the_token_mean_of_the_reports():
    from scalerlt_mcore.rl.stats import summarise

    out = [{"loss": torch.tensor([3.0, 2.0]), "tokens": 2.0, "clipped": 0.0, "kl": 0.0},
           {"loss": torch.tensor([1.0, 6.0]), "tokens": 6.0, "clipped": 0.0, "kl": 0.0}]
    assert summarise(out, 2)["loss"] == 0.5  # (3 + 1) / (2 + 6), not (1.5 + 1/6) / 2


def _logged_loss_worker(rank, world_size) -> float:
    """The trainer's reduction of one step's summary on ``rank``: rank 0 trained 2 tokens of
    loss 3, rank 1 6 tokens of loss 1."""
    from types import SimpleNamespace

    from scalerlt_mcore.app.trainer import RLTrainer
    from scalerlt_mcore.rl.stats import summarise

    report = torch.tensor([[3.0, 2.0], [1.0, 6.0]][rank], dtype=torch.float64)
    out = [{"loss": report, "tokens": report[1], "clipped": 0.0, "kl": 0.0}]
    trainer = SimpleNamespace(world=world_size, device=torch.device("cpu"))
    return RLTrainer._reduce(trainer, summarise(out, 1))


def test_logged_loss_is_the_step_token_mean_over_ranks():
    """(3 + 1) / (2 + 6) on every rank, not the mean of the ranks' token means (1.5 + 1/6) / 2,
    and the sums do not reach the log."""
    for metrics in run_distributed(_logged_loss_worker, 2):
        assert metrics["loss"] == 0.5
        assert "loss_tokens" not in metrics and "loss_token_sum" not in metrics
