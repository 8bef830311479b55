"""The shared-prefix schedule with a loss that is not RL: token-level supervised fine-tuning of
G responses to one prompt, with per-token weights the loss owns (a group subclass declaring
them in ``EXTRAS``). Exact against the same loss on full sequences through stock MCore
``get_forward_backward_func()`` (fp64, relative error <= 1e-12); the weights are checked and
guarded like the group's own tensors; the planner plans with the loss's own bytes."""

from dataclasses import dataclass
from typing import ClassVar, Optional

import pytest
import torch
from helpers.sp import build_model, grads, rel_errors
from megatron.core.pipeline_parallel import get_forward_backward_func

from scalerlt_mcore.shared_prefix import (
    ReplayInputError,
    SharedPrefixGroup,
    get_shared_prefix_forward_backward_func,
)

R, G, P, S, VOCAB = 2, 5, 7, 4, 48
EXACT = 1e-12


@dataclass
class SFTGroup(SharedPrefixGroup):
    """G responses to one prompt with the SFT loss's per-token weights."""

    token_weights: Optional[torch.Tensor] = None
    """[G, T] weight of each position's label (0 off the loss mask)."""

    EXTRAS: ClassVar[dict] = {"token_weights": ("G", "T")}


def _group(seed: int, group_id: int) -> SFTGroup:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, VOCAB, (P,), generator=gen)
    lengths = torch.randint(1, S + 1, (G,), generator=gen)
    lengths[0] = S
    responses = torch.randint(1, VOCAB, (G, S), generator=gen)  # [G, S]
    group = SFTGroup.from_rollout(prompt, responses, lengths, 0, mask_dtype=torch.float64,
                                  group_id=group_id)
    mask = group.loss_mask  # [G, T]
    scale = torch.rand(mask.shape, generator=gen, dtype=torch.float64) + 0.5
    group.token_weights = scale * mask / mask.sum()  # a weighted token mean over the group
    return group


def _check_group(group) -> None:
    if getattr(group, "token_weights", None) is None:
        raise ValueError(f"group {group.group_id}: the SFT loss needs token_weights")


def sft_wave_step(data_iterator, model):
    """The per-wave ``forward_step_func``: -sum_{r,i,t} (1/R) c_{i,t} log p_r(label_{i,t})
    over the wave's rows, c the group's token weights (normalised over the whole group)."""
    wave = next(data_iterator)
    logprobs = model(wave)  # [R, W, T]

    def loss_func(output, non_loss_data: bool = False):
        c = wave.rows(wave.group.token_weights).to(output.dtype)  # [W, T]
        loss = -(output.mean(0) * c).sum()
        return loss, {"loss": loss.detach()}

    return logprobs, loss_func


sft_wave_step.check_group = _check_group


def _stock_step(model, groups) -> float:
    """The reference: every response one microbatch of its full sequence through stock MCore,
    the same loss written out here; MCore divides by the number of microbatches, the step loss
    is the mean of the group losses."""
    batches = [(g.tokens[i : i + 1], g.labels[i : i + 1], g.token_weights[i : i + 1])
               for g in groups for i in range(g.group_size)]
    scale = len(batches) / len(groups)

    def step(data_iterator, model):
        tokens, labels, c = next(data_iterator)
        logprobs = model(tokens, labels=labels).logprobs  # [R, 1, T]

        def loss_func(output):
            loss = -sum(output[r] * c for r in range(R)).sum() / R
            return loss * scale, {"loss": loss.detach()}

        return logprobs, loss_func

    out = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(batches), model=model,
        num_microbatches=len(batches), seq_length=0, micro_batch_size=1)
    return sum(float(o["loss"]) for o in out) / len(groups)


def _joint_step(model, groups, wave_size, **kw) -> float:
    schedule = get_shared_prefix_forward_backward_func(wave_size, **kw)
    out = schedule(forward_step_func=sft_wave_step, data_iterator=iter(groups), model=model,
                   num_microbatches=len(groups), seq_length=0, micro_batch_size=1)
    return sum(float(o["loss"]) for o in out) / len(groups)


@pytest.mark.parametrize("wave_size, prompt", [(2, "recompute"), (2, "retain"), (5, "retain")])
def test_sft_on_shared_prefixes_is_exact(mcore_single, wave_size, prompt):
    model = build_model(R=R, arch=True).double()
    groups = [_group(0, 0), _group(1, 1)]
    model.zero_grad(set_to_none=True)
    ref_loss = _stock_step(model, groups)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    loss = _joint_step(model, groups, wave_size, prompt=prompt)
    assert abs(loss - ref_loss) <= EXACT * abs(ref_loss)
    errors = rel_errors(grads(model), ref)
    assert max(errors.values()) <= EXACT, errors


def test_sft_with_the_planner_and_a_naive_plan(mcore_single):
    """The planner plans with the loss's own saved bytes (here: none per [R, rows, T]); a
    budget-chosen wave and a naive plan train exactly as stock MCore."""
    model = build_model(R=R, arch=True).double()
    groups = [_group(2, 0)]
    model.zero_grad(set_to_none=True)
    _stock_step(model, groups)
    ref = grads(model)
    for plan in (dict(wave_size="auto", prompt="auto", memory_budget=2**30,
                      loss_per_position=0.0),
                 dict(wave_size=2, schedule="naive", naive_micro_batch_size=2)):
        model.zero_grad(set_to_none=True)
        _joint_step(model, groups, plan.pop("wave_size"), **plan)
        assert max(rel_errors(grads(model), ref).values()) <= EXACT, plan


def test_loss_owned_tensors_are_checked_and_guarded(mcore_single):
    model = build_model(R=R).double()
    group = _group(3, 7)
    group.token_weights = group.token_weights[:, :-1]
    with pytest.raises(ValueError, match=r"group 7: token_weights has shape \(5, 10\), "
                       r"expected \(5, 11\)"):
        _joint_step(model, [group], 2)
    group = _group(3, 7)
    group.token_weights = None
    with pytest.raises(ValueError, match="group 7: the SFT loss needs token_weights"):
        _joint_step(model, [group], 2)
    group = _group(3, 7)
    group.token_weights[0, P] = float("nan")
    with pytest.raises(ValueError, match="group 7: token_weights contains NaN or inf"):
        _joint_step(model, [group], 2)
    with pytest.raises(TypeError, match="SFTGroup has no extra tensor 'advantages'"):
        SFTGroup.from_rollout([1, 2], torch.ones(2, 3, dtype=torch.long), [3, 2], 0,
                              advantages=torch.zeros(2))
    assert all(p.grad is None for p in model.parameters())

    group = _group(3, 7)

    def change_weights(phase, g):
        if phase == "wave":
            g.token_weights.mul_(2.0)

    with pytest.raises(ReplayInputError, match="group 7: replay input 'token_weights' changed"):
        _joint_step(model, [group], 2, phase_callback=change_weights)
