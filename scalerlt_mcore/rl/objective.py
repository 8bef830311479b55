"""The RL objective over all-loop readouts, normalised over the whole group.

Group loss L = sum_r w_r * sum_{i,t} c_{i,t} * (ppo_{r,i,t} + kl_coef * kl_{r,i,t}), where the
token weights c are computed once from the whole group's loss mask (never per wave), so the
loss is the same number whatever the wave size.
"""

from dataclasses import dataclass
from functools import partial
from typing import Literal, get_args

import torch
from torch import Tensor

from .advantages import kl_k3, ppo_clipped_objective

Normalization = Literal["token_mean", "seq_mean", "constant"]
LoopWeights = Literal["final", "uniform", "progressive"]
NORMALIZATIONS = get_args(Normalization)
LOOP_WEIGHTS = get_args(LoopWeights)


def loop_weights(scheme: str, num_loops: int, device=None) -> Tensor:
    """Per-loop credit w_r [R] in fp64 on ``device`` (sums to 1): final readout only, uniform,
    or growing with r (RLTT)."""
    if scheme == "final":
        w = torch.zeros(num_loops, dtype=torch.float64, device=device)
        w[-1] = 1.0
        return w
    if scheme == "uniform":
        return torch.full((num_loops,), 1.0 / num_loops, dtype=torch.float64, device=device)
    if scheme == "progressive":
        r = torch.arange(1, num_loops + 1, dtype=torch.float64, device=device)
        return r / r.sum()
    raise ValueError(f"loop weights must be one of {LOOP_WEIGHTS}, got {scheme!r}")


@dataclass
class RLObjective:
    """PPO-clipped policy loss with optional k3 KL, per-loop credit and group normalisation."""

    normalization: Normalization = "token_mean"
    """token_mean: / valid tokens of the group; seq_mean: mean over responses of per-response
    token means; constant: / (G * constant_length) (Dr. GRPO)."""

    constant_length: int = 0
    """Denominator length for ``constant`` normalisation (0: the group's padded length)."""

    clip_low: float = 0.2
    """PPO ratio clip below: ratio >= 1 - clip_low."""

    clip_high: float = 0.2
    """PPO ratio clip above: ratio <= 1 + clip_high."""

    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy (needs ref log-probs when > 0). The main job's
    reference is the policy at the start of RL (after the supervised warm-up), saved with
    checkpoints."""

    loop_weights: LoopWeights = "final"
    """Per-loop credit over all-loop readouts: final | uniform | progressive."""

    def __post_init__(self):
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, "
                             f"got {self.normalization!r}")
        loop_weights(self.loop_weights, 1)
        if self.clip_low <= 0 or self.clip_high <= 0:
            raise ValueError("clip_low and clip_high must be > 0")

    @property
    def saved_per_position(self) -> float:
        """Tensors of shape [R, rows, T] (accumulator dtype) that ``loss`` saves for backward:
        the memory planner's per-position term for this objective."""
        return 5.0 + 2.0 * (self.kl_coef > 0)

    def token_weights(self, loss_mask: Tensor) -> Tensor:
        """c [G, T] from the whole group's loss mask [G, T]."""
        mask = loss_mask.to(torch.float64)
        G, T = mask.shape
        if self.normalization == "token_mean":
            return mask / mask.sum()
        if self.normalization == "seq_mean":
            return mask / (mask.sum(dim=1, keepdim=True) * G)
        return mask / (G * (self.constant_length or T))

    def loss(self, logprobs: Tensor, old: Tensor, advantages: Tensor, weights: Tensor,
             ref=None) -> tuple:
        """logprobs/old/ref [R, B, T'], advantages [B], weights [B, T'] -> (loss, stats).

        ``stats`` holds detached sums over this batch: clipped tokens, k3 KL, weighted tokens."""
        R, acc = logprobs.shape[0], logprobs.dtype
        mask = (weights != 0)[None].expand_as(logprobs)  # [R, B, T']
        adv = advantages.to(acc)[None].expand(R, -1)  # [R, B]
        per_token, clipped = ppo_clipped_objective(
            logprobs, old.to(acc), adv, mask, self.clip_low, self.clip_high)
        kl = torch.zeros_like(per_token)
        if self.kl_coef > 0:
            if ref is None:
                raise ValueError("kl_coef > 0 needs ref_logprobs")
            kl = kl_k3(logprobs, ref.to(acc)) * mask
            per_token = per_token + self.kl_coef * kl
        w_loop = loop_weights(self.loop_weights, R, logprobs.device).to(acc)[:, None, None]
        coef = w_loop * weights.to(acc)[None]  # [R, B, T']
        stats = {"clipped": clipped[-1].sum().detach(), "kl": kl[-1].sum().detach(),
                 "tokens": mask[-1].sum().to(acc).detach()}
        return (coef * per_token).sum(), stats

    def check_group(self, group) -> None:
        """Up-front check of what the loss needs from a group (before any compute)."""
        if self.kl_coef > 0 and group.ref_logprobs is None:
            raise ValueError(f"group {group.group_id}: kl_coef = {self.kl_coef} > 0 needs "
                             f"ref_logprobs (reference log-probs), got None")

    def wave_loss(self, wave, logprobs: Tensor, non_loss_data: bool = False):
        """The loss_func of a shared-prefix or naive step: ``wave`` (a ``WaveBatch``) and its
        per-loop log-probs [R, W, T] -> (the wave's share of the group loss, stats). Token
        weights come from the whole group's loss mask. ``non_loss_data``: the log-probs."""
        if non_loss_data:
            return logprobs.detach()
        g = wave.group
        weights = wave.rows(self.token_weights(g.loss_mask))  # [W, T]
        loss, stats = self.loss(logprobs, wave.rows(g.old_logprobs, 1),
                                wave.rows(g.advantages), weights, wave.rows(g.ref_logprobs, 1))
        return loss, {"loss": loss.detach(), **stats}


def rl_forward_step(objective: RLObjective):
    """MCore-style ``forward_step_func`` of the RL loss for ``SharedPrefixSchedule`` and
    ``naive_step``: the wave's log-probs from ``model(wave)``, ``objective.wave_loss``. Its
    ``check_group`` attribute (``objective.check_group``) lets the shared-prefix schedule reject
    a group the loss cannot use before any compute."""

    def forward_step(data_iterator, model):
        wave = next(data_iterator)
        return model(wave), partial(objective.wave_loss, wave)

    forward_step.check_group = objective.check_group
    return forward_step
