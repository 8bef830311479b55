"""Old log-probs of a tree group by scoring (forward_only through the shared-prefix schedule)
are the training forward's bit for bit, as a one-level group's are: a group scored and then
trained one step at the same weights sees a PPO ratio of exactly 1 at every trained token, and
with every advantage zero its gradient is exactly zero, also with a KL term whose reference is
the policy itself (the KL reference at the first RL step), so an Adam step leaves the weights
as they were. Rows scored as full sequences differ from the per-node training forward by fp32
rounding (~2e-7), which made such a step's KL gradient rounding noise that Adam normalises
into a real update.

That the scored values are the model's log-probs of the rows is checked against the model's
full-sequence forward in tests/shared_prefix/test_tree.py (``test_forward_only_scores_the_rows``);
the tree's training against naive stock MCore there too. Without ``collect_non_loss_data`` the
scored stats are the training losses; data that cannot be laid out in the rows are refused.
"""

import pytest
import torch
from helpers.exit_gate import _gated
from helpers.sp import LossSpec, build_model, joint_step, make_group
from helpers.tree import DEPTH2, DEPTH3, tree_group

from scalerlt_mcore.rl.objective import rl_forward_step
from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func

# name, group shape (None: a one-level group), R, wave size, prompt mode, checkpointed waves,
# model extras
CASES = [
    ("flat", None, 2, 2, "recompute", False, {}),
    ("d2-W2", DEPTH2, 2, 2, "recompute", False, {}),
    ("d3-W3-retain-ckpt-concat", DEPTH3, 3, 3, "retain", True, {"attn": "concat"}),
    ("d3-W1-truncated", DEPTH3, 3, 1, "recompute", False, {"looped_backprop_loops": 1}),
    ("d3-W2-exit-gate", DEPTH3, 3, 2, "recompute", False, {"gate": True}),
    ("d3-W2-bf16-concat", DEPTH3, 2, 2, "recompute", False, {"bf16": True, "attn": "concat"}),
]


def _model(R: int, extra: dict):
    extra = dict(extra)
    bf16, gate = extra.pop("bf16", False), extra.pop("gate", False)
    model = _gated(R=R, **extra) if gate else build_model(R=R, arch=True, **extra)
    return model.to(torch.bfloat16) if bf16 else model


def _group(shape, R: int, seed: int):
    if shape is None:
        return make_group(5, 6, 4, R, seed=seed, dtype=torch.float32, kl=True)
    return tree_group(shape, R, seed=seed, dtype=torch.float32, kl=True)


def _spec(extra: dict, **kw) -> LossSpec:
    gated = extra.get("gate", False)
    return LossSpec(loop_weights="exit_pdf" if gated else "uniform", **kw)


def _scored(model, group, W: int, prompt: str, ck: bool) -> torch.Tensor:
    """The group's per-loop log-probs [R, G, T] by the schedule's forward_only pass."""
    return joint_step(model, [group], LossSpec(), W, checkpoint_waves=ck, forward_only=True,
                      prompt=prompt)[0]["logprobs"]


def _recording(forward_step, seen: list):
    """``forward_step`` whose loss_func also keeps (wave, log-probs) of every loss call."""

    def step(data_iterator, model):
        wave = next(data_iterator)
        output, loss_func = forward_step(iter([wave]), model)

        def recorded(output, non_loss_data: bool = False):
            lp = output["logprobs"] if isinstance(output, dict) else output
            seen.append((wave, lp.detach().clone()))
            return loss_func(output, non_loss_data=non_loss_data)

        return output, recorded

    step.check_group = forward_step.check_group
    return step


def _train(model, group, spec: LossSpec, W: int, prompt: str, ck: bool, seen: list):
    fb = get_shared_prefix_forward_backward_func(W, checkpoint_waves=ck, prompt=prompt)
    step = _recording(rl_forward_step(spec.objective()), seen)
    return fb(forward_step_func=step, data_iterator=iter([group]), model=model,
              num_microbatches=1, seq_length=0, micro_batch_size=1)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_scored_logprobs_are_the_training_forwards(mcore_single, case):
    name, shape, R, W, prompt, ck, extra = case
    model = _model(R, extra)
    group = _group(shape, R, seed=len(name))
    group.old_logprobs = _scored(model, group, W, prompt, ck)
    seen = []
    _train(model, group, _spec(extra), W, prompt, ck, seen)
    assert len(seen) >= (2 if shape is None else 4)  # waves (and a tree's node calls)
    checked = torch.zeros_like(group.loss_mask, dtype=torch.bool)  # [G, T]
    for wave, lp in seen:
        old = wave.positions(wave.rows(group.old_logprobs, 1))  # [R, W, L]
        on = wave.positions(wave.rows(group.loss_mask)) != 0  # [W, L]
        assert torch.equal(lp[:, on], old[:, on]), (name, wave.index.tolist(), wave.span)
        assert (torch.exp(lp[:, on] - old[:, on]) == 1).all()  # the PPO ratio
        span = torch.arange(checked.shape[1])[wave.span]
        checked[wave.index[:, None], span] |= on
    assert torch.equal(checked, group.loss_mask != 0)  # every trained token of every row


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2]], ids=["flat", "d2", "d3-retain"])
def test_zero_advantages_leave_the_weights_unchanged(mcore_single, case, kl_coef):
    """All advantages zero, old and reference log-probs scored by the same weights: the
    gradient is exactly zero (the KL term's at new = ref too), and Adam does not move."""
    name, shape, R, W, prompt, ck, extra = case
    model = _model(R, extra)
    group = _group(shape, R, seed=3)
    scored = _scored(model, group, W, prompt, ck)
    group.old_logprobs, group.ref_logprobs = scored, scored.clone()
    group.advantages = torch.zeros_like(group.advantages)
    model.zero_grad(set_to_none=True)
    _train(model, group, _spec(extra, kl_coef=kl_coef), W, prompt, ck, [])
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(not g.any() for g in grads.values()), {
        n: float(g.abs().max()) for n, g in grads.items() if g.any()}
    before = [p.detach().clone() for p in model.parameters()]
    torch.optim.Adam(model.parameters(), lr=1e-3).step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_forward_only_stats_of_a_tree_are_its_training_losses(mcore_single):
    """forward_only without ``collect_non_loss_data``: the loss's stats of every call summed
    (0-dim), the group's loss that training computes."""
    R = 2
    model = build_model(R=R, arch=True).double()
    group = tree_group(DEPTH3, R, seed=5, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.1)
    fb = get_shared_prefix_forward_backward_func(2)
    scored = fb(forward_step_func=rl_forward_step(spec.objective()), data_iterator=iter([group]),
                model=model, num_microbatches=1, seq_length=0, micro_batch_size=1,
                forward_only=True)[0]
    trained = joint_step(model, [group], spec, 2)[0]
    for key in ("loss", "kl", "tokens", "clipped"):
        assert scored[key].dim() == 0
        assert abs(float(scored[key] - trained[key])) <= 1e-12 * abs(float(trained[key])), key
    assert float(scored["tokens"]) == float((group.loss_mask != 0).sum())


def test_forward_only_data_of_a_tree_must_be_laid_out(mcore_single):
    """A tree's scored data are tensors [..., W, L] of a call's rows and positions (laid out
    in the rows) or 0-dim; anything else is refused naming its shape."""
    model = build_model(R=2)
    group = tree_group(DEPTH2, 2, seed=1, dtype=torch.float32)

    def per_row(data_iterator, model):
        wave = next(data_iterator)
        return model(wave), lambda output, non_loss_data=False: output.sum((0, 2))  # [W]

    fb = get_shared_prefix_forward_backward_func(2)
    with pytest.raises(ValueError, match=r"must hold tensors \[..., W, L\] .* got shape"):
        fb(forward_step_func=per_row, data_iterator=iter([group]), model=model,
           num_microbatches=1, seq_length=0, micro_batch_size=1, forward_only=True,
           collect_non_loss_data=True)
