"""Group advantages and per-token policy-gradient losses (pure torch, any float dtype)."""

from typing import Literal, get_args

import torch

AdvantageMode = Literal["grpo", "dr_grpo", "none"]
"""``grpo``: (r - mean) / (std + eps); ``dr_grpo``: r - mean; ``none``: r."""
ADVANTAGE_MODES = get_args(AdvantageMode)


def group_advantages(rewards: torch.Tensor, mode: AdvantageMode = "grpo",
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages of ``rewards`` [n_groups, G], each response against its own group.

    ``grpo`` divides by the population std of the group (``unbiased=False``), so a group whose
    rewards are all equal gets zero advantages, not NaN. ``dr_grpo`` (Dr. GRPO) only centres.
    Non-finite rewards raise ValueError naming the first bad group: the step must be rejected.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; choose one of {ADVANTAGE_MODES}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")
    bad = (~torch.isfinite(rewards)).any(dim=1).nonzero()
    if len(bad):
        raise ValueError(f"reward is NaN/inf in group {int(bad[0])}: step rejected")
    if mode == "none":
        return rewards.clone()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if mode == "dr_grpo":
        return centred
    return centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)


def ppo_clipped_objective(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``.

    ``logp_*`` and ``mask`` are [..., S]; ``advantages`` is [..., S] or one per sequence
    [...]. Returns ``(loss, clipped)``, both [..., S] and zero where ``mask`` is 0; ``clipped``
    is 1 where the clipped term won the min strictly (the token gets no gradient). Reducing
    the loss (token mean, sequence mean, ...) is the caller's choice.
    """
    if advantages.dim() == logp_new.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp(logp_new - logp_old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    mask = mask.to(unclipped.dtype)
    loss = -torch.minimum(unclipped, clipped) * mask
    return loss, (clipped < unclipped).to(unclipped.dtype) * mask


def kl_k3(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(new || ref): ``exp(d) - d - 1`` with ``d = ref - new``.

    Non-negative and zero where the log-probs agree; computed with ``expm1`` for accuracy.
    """
    d = logp_ref - logp_new
    return (torch.expm1(d) - d).clamp_min(0.0)


def entropy_term(logp: torch.Tensor) -> torch.Tensor:
    """Per-token ``-p log p`` of each sampled token from its log-prob ``logp`` (Megatron-LM's
    GRPO entropy term)."""
    return -logp.exp() * logp
