"""The RL objective over all-loop readouts, normalised over the whole group.

Group loss L = sum_r w_r * sum_{i,t} c_{i,t} * (ppo_{r,i,t} + kl_coef * kl_{r,i,t} - entropy_weight
* h_{r,i,t}), h = -p log p of the sampled token (Megatron-LM's GRPO entropy term), where the token
weights c are computed once from the whole group's loss mask (never per wave), so the loss is the
same number whatever the wave size. The loop weights w_r are fixed (final, uniform, progressive),
per token from the exit gate (exit_pdf: w_{r,i,t} = p(r | i, t)), or learned (RLTT: softmax of
trainable logits). With ``exit_gate_coef`` the gate's own objective is added: exit_gate_coef *
sum_{i,t} c_{i,t} (sum_r p_r sg(l_{r,i,t}) - exit_entropy_coef * H(p_{i,t})), l the per-token loss
above and sg stop-gradient (Ouro's entropy-regularised expected loss).

Every log-prob the loss reads (new, old, reference) is that of the distribution the responses
were sampled from, log_softmax(logits / T) at the sampling temperature T (the schedule's
``temperature``; top-p not applied), as verl and OpenRLHF compute them: the first update's
ratio is 1, the entropy term is the sampling distribution's and the KL is to the reference
at the same temperature.
"""

from dataclasses import dataclass
from functools import partial
from typing import Literal, Optional, get_args

import torch
from torch import Tensor

from ..model.config import FieldError
from . import loop_credit
from .advantages import entropy_term, kl_k3, ppo_clipped_objective
from .loop_credit import FIXED_LOOP_WEIGHTS, LOOP_WEIGHTS, LoopWeights, loop_weights

__all__ = ["FIXED_LOOP_WEIGHTS", "LOOP_WEIGHTS", "LoopWeights", "NORMALIZATIONS",
           "RLObjective", "exit_stats", "loop_weights", "rl_forward_step"]

Normalization = Literal["token_mean", "seq_mean", "constant", "step_token_mean"]
NORMALIZATIONS = get_args(Normalization)


ENTROPY_SAVES = 3.0
"""Tensors of shape [R, rows, T] the entropy term saves for backward: p, the log-probs it
multiplies, and the term before the loss mask (measured: 3.09 with the token weights)."""


@dataclass
class RLObjective:
    """PPO-clipped policy loss with optional k3 KL, per-loop credit and group normalisation."""

    normalization: Normalization = "token_mean"
    """token_mean: / valid tokens of the group; seq_mean: mean over responses of per-response
    token means; constant: / (G * constant_length) (Dr. GRPO); step_token_mean: / valid tokens
    of the whole step, every group and data-parallel rank (DAPO's token-level loss): each wave
    returns its unnormalised token sum and token count, MCore's per-token-loss contract, and
    needs the model config's ``calculate_per_token_loss``."""

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

    entropy_weight: float = 0.0
    """Weight of Megatron-LM's GRPO entropy term: minus entropy_weight * (-p log p) of every
    sampled token is added to its loss, p the token's probability under the current policy;
    it lowers tokens with p > 1/e and raises rarer ones, against the entropy collapse that
    leaves groups all right or all wrong (0: off)."""

    loop_weights: LoopWeights = "final"
    """Per-loop credit over all-loop readouts (``loop_credit.LOOP_CREDIT``): final | uniform |
    progressive (fixed), exit_pdf (per token, the exit gate's p(r), detached: credit follows
    the gate but the policy loss does not move the gate, which a policy loss could otherwise
    push to whichever loop's surrogate is lowest; the gate learns from its own term,
    ``exit_gate_coef``) | learned (RLTT: softmax of trainable per-loop logits, trained with the
    policy)."""

    exit_gate_coef: float = 0.0
    """Weight of the exit gate's entropy-regularised expected loss (0: off); needs the gate."""

    exit_entropy_coef: float = 0.0
    """Entropy bonus (beta) of the exit distribution inside the gate's objective."""

    inference_is_correction: bool = False
    """Megatron-LM's inference-log-prob importance-sampling correction: each token's policy
    term (not its KL or entropy term) weighted by exp(old - inference), the trainer's old
    log-prob over the rollout engine's of the same token at the same loop, a constant; the
    group needs ``inference_logprobs``."""

    is_truncation_coef: Optional[float] = None
    """With ``inference_is_correction``: the weights truncated at this value, min(w, coef)
    (truncated importance sampling); None: not truncated."""

    def __post_init__(self):
        """Each field's check; a ``FieldError`` names the field."""
        schemes = tuple(loop_credit.LOOP_CREDIT)  # the registry as it is now
        for name, allowed in (("normalization", NORMALIZATIONS), ("loop_weights", schemes)):
            if getattr(self, name) not in allowed:
                raise FieldError(name, f"must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("clip_low", "clip_high"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("kl_coef", "entropy_weight", "exit_gate_coef", "exit_entropy_coef"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.is_truncation_coef is not None and self.is_truncation_coef <= 0:
            raise FieldError("is_truncation_coef", f"must be > 0, got "
                             f"{self.is_truncation_coef}")
        if self.is_truncation_coef is not None and not self.inference_is_correction:
            raise FieldError("is_truncation_coef", "has nothing to truncate: the inference "
                             "log-prob importance-sampling correction is off")

    @property
    def saved_per_position(self) -> float:
        """Tensors of shape [R, rows, T] (accumulator dtype) that ``loss`` saves for backward:
        the memory planner's per-position term for this objective."""
        return 5.0 + 2.0 * (self.kl_coef > 0) + ENTROPY_SAVES * (self.entropy_weight > 0)

    def token_weights(self, loss_mask: Tensor) -> Tensor:
        """c [G, T] from the whole group's loss mask [G, T]."""
        mask = loss_mask.to(torch.float64)
        G, T = mask.shape
        if self.normalization == "token_mean":
            return mask / mask.sum()
        if self.normalization == "step_token_mean":  # the step's token count divides later
            return mask
        if self.normalization == "seq_mean":
            return mask / (mask.sum(dim=1, keepdim=True) * G)
        return mask / (G * (self.constant_length or T))

    @property
    def needs_readouts(self) -> bool:
        """Whether the loss needs more of the model than per-loop log-probs."""
        return self.exit_gate_coef > 0 or loop_credit.needs_readouts(self.loop_weights)

    def loop_coef(self, R: int, exit_logprobs=None, learned=None, like=None) -> Tensor:
        """Loop weights broadcastable to [R, B, T'] (``loop_credit.coefficients``): fixed
        [R, 1, 1]; exit_pdf p(r) [R, B, T'] (detached); learned [R, 1, 1] (with grad)."""
        readouts = {"exit_logprobs": exit_logprobs, "loop_weights": learned}
        return loop_credit.coefficients(self.loop_weights, readouts, like)

    def model_errors(self, model, max_loops=None) -> list:
        """What the loss needs of the model and what the model's parts need of the loss
        (``model``: anything with the ``looped_*`` fields; ``max_loops``: the most loops a
        step runs) -> a ``FieldError`` per problem, naming this objective's field (empty:
        fine)."""
        errors = loop_credit.model_errors(self.loop_weights, model, max_loops)
        gate = bool(getattr(model, "looped_exit_gate", False))
        if self.exit_gate_coef > 0 and not gate:
            errors.insert(0, FieldError("exit_gate_coef", "> 0 needs looped_exit_gate true"))
        if gate and self.exit_gate_coef <= 0:
            errors.append(FieldError("exit_gate_coef", "must be > 0 with looped_exit_gate (the "
                                     "gate learns only from its own term; without it the gate "
                                     "parameters get no gradient)"))
        return errors

    def gate_objective(self, exit_logprobs: Tensor, per_token: Tensor, weights: Tensor):
        """sum_{i,t} c_{i,t} (sum_r p_r sg(l_r) - exit_entropy_coef * H(p)): exit_logprobs and
        per_token [R, B, T'], weights c [B, T'] -> 0-dim."""
        if exit_logprobs is None:
            raise ValueError("exit_gate_coef > 0 needs the model's exit gate (looped_exit_gate)")
        p = exit_logprobs.exp()
        expected = (p * per_token.detach()).sum(0)  # [B, T']
        entropy = -(p * exit_logprobs).sum(0)  # [B, T']
        per_position = expected - self.exit_entropy_coef * entropy
        c = weights.to(per_position.dtype)
        return torch.where(c != 0, c * per_position, 0).sum()

    def loss(self, logprobs: Tensor, old: Tensor, advantages: Tensor, weights: Tensor,
             ref=None, exit_logprobs=None, learned=None, inference=None,
             reads=None) -> tuple:
        """logprobs/old/ref/exit_logprobs/inference [R, B, T'], advantages [B], weights
        [B, T'], learned [R], reads [B, T'] (recorded exit depths: each token's loss at the
        loop it was sampled at, instead of ``loop_weights`` final's last loop) -> (loss, stats).

        ``stats`` holds detached sums over this batch: clipped tokens, k3 KL, weighted tokens,
        with an exit distribution the mean exit loop sum_r r p_r and its entropy summed over
        the trained tokens, and with the IS correction its weights and the truncated ones."""
        R, acc = logprobs.shape[0], logprobs.dtype
        mask = (weights != 0)[None].expand_as(logprobs)  # [R, B, T']
        adv = advantages.to(acc)[None].expand(R, -1)  # [R, B]
        per_token, clipped = ppo_clipped_objective(
            logprobs, old.to(acc), adv, mask, self.clip_low, self.clip_high)
        extra = {}
        if self.inference_is_correction:
            per_token, extra = self._is_corrected(per_token, old.to(acc), inference, mask)
        kl = torch.zeros_like(per_token)
        if self.kl_coef > 0:
            if ref is None:
                raise ValueError("kl_coef > 0 needs ref_logprobs")
            kl = kl_k3(logprobs, ref.to(acc)) * mask
            per_token = per_token + self.kl_coef * kl
        if self.entropy_weight > 0:
            per_token = per_token - self.entropy_weight * entropy_term(logprobs) * mask
        credit = (self.loop_coef(R, exit_logprobs, learned, logprobs) if reads is None
                  else read_loops(reads, R, acc))
        coef = credit * weights.to(acc)[None]
        stats = {"clipped": clipped[-1].sum().detach(), "kl": kl[-1].sum().detach(),
                 "tokens": mask[-1].sum().to(acc).detach(), **extra}
        total = (coef * per_token).sum()
        if self.exit_gate_coef > 0:
            total = total + self.exit_gate_coef * self.gate_objective(exit_logprobs, per_token,
                                                                      weights)
        if exit_logprobs is not None:
            stats.update(exit_stats(exit_logprobs, mask[-1]))
        return total, stats

    def _is_corrected(self, policy: Tensor, old: Tensor, inference, mask: Tensor) -> tuple:
        """The policy term [R, B, T'] times min(exp(old - inference), coef) (constants) ->
        (it, stats: the last loop's weights and truncated tokens summed over the mask)."""
        if inference is None:
            raise ValueError("inference_is_correction needs inference_logprobs")
        w = (old - inference.to(old.dtype)).exp()
        truncated = torch.zeros_like(mask)
        if self.is_truncation_coef is not None:
            truncated = mask & (w > self.is_truncation_coef)
            w = w.clamp(max=self.is_truncation_coef)
        w = torch.where(mask, w, 1)  # off the mask: never an inf times a zero
        return w * policy, {"is_weight": (w * mask)[-1].sum().detach(),
                            "is_truncated": truncated[-1].sum().to(old.dtype).detach()}

    def check_group(self, group) -> None:
        """Up-front check of what the loss needs from a group (before any compute): an
        ``RLGroup`` with advantages and old log-probs, and reference log-probs for the KL."""
        tag = f"group {group.group_id}"
        if not all(hasattr(group, n) for n in ("advantages", "old_logprobs", "ref_logprobs")):
            raise TypeError(f"{tag}: the RL loss trains RLGroup objects (advantages, old and "
                            f"reference log-probs), got {type(group).__name__}")
        if group.advantages is None or group.old_logprobs is None:
            raise ValueError(f"{tag}: training needs advantages and old_logprobs")
        if self.kl_coef > 0 and group.ref_logprobs is None:
            raise ValueError(f"group {group.group_id}: kl_coef = {self.kl_coef} > 0 needs "
                             f"ref_logprobs (reference log-probs), got None")
        if getattr(group, "exit_depths", None) is not None:
            if self.loop_weights != "final":
                raise ValueError(f"{tag}: recorded exit depths (exit_depths) read each token at "
                                 f"the loop it was sampled at: they need loop_weights final, "
                                 f"got {self.loop_weights!r}")
            _check_shared_exits(group, tag)
        if self.inference_is_correction and getattr(group, "inference_logprobs", None) is None:
            raise ValueError(f"{tag}: inference_is_correction needs inference_logprobs (the "
                             f"rollout engine's log-probs), got None")

    def wave_loss(self, wave, output, non_loss_data: bool = False):
        """The loss_func of a shared-prefix or naive step: ``wave`` (a ``WaveBatch``) and its
        per-loop log-probs [R, W, T'] of the wave's positions (``wave.span``: all T of a
        one-level group; a tree node's) (or the wave model's ``readouts`` dict: ``logprobs``,
        ``exit_logprobs``, ``loop_weights``) -> (the wave's share of the group loss, stats).
        Token weights come from the whole group's loss mask. ``non_loss_data``: the log-probs.
        ``step_token_mean``: (the wave's token sum, its trained tokens, stats) as MCore's
        per-token-loss contract, the reported ``loss`` its [sum, tokens] pair."""
        out = output if isinstance(output, dict) else {"logprobs": output}
        logprobs = out["logprobs"]
        if non_loss_data:
            return logprobs.detach()
        g = wave.group
        weights = wave.positions(wave.rows(self.token_weights(g.loss_mask)))  # [W, T']
        old, ref, inference = (wave.positions(wave.rows(t, 1)) for t in (
            g.old_logprobs, g.ref_logprobs, getattr(g, "inference_logprobs", None)))
        reads = wave.positions(wave.rows(getattr(g, "exit_depths", None)))  # [W, T'] or None
        loss, stats = self.loss(logprobs, old, wave.rows(g.advantages), weights, ref,
                                exit_logprobs=out.get("exit_logprobs"),
                                learned=out.get("loop_weights"), inference=inference,
                                reads=reads)
        if self.normalization == "step_token_mean":
            num_tokens = (weights != 0).sum().to(torch.int)
            pair = torch.stack([loss.detach(), num_tokens.to(loss.dtype)])
            return loss, num_tokens, {"loss": pair, **stats}
        return loss, {"loss": loss.detach(), **stats}


def _check_shared_exits(group, tag: str) -> None:
    """A tree's node is decoded once: the loops each of its positions ran (``exit_runs``; a
    sampled last position's are its children's first tokens' depth) are the same in every
    row below it (the replay runs the node once)."""
    tree = group.as_tree()
    runs = group.exit_runs(0)  # positions that ran every loop: 0 here, whatever R
    for n in tree.inner_nodes[1:]:  # a leaf is one row's; the root is prefilled
        rows = torch.as_tensor(tree.rows_below(n), device=runs.device)
        span = runs[rows][:, tree.starts[n] : tree.ends[n]]
        if bool((span != span[:1]).any()):
            raise ValueError(f"{tag}: node {n}'s recorded exit depths differ between the rows "
                             f"below it (a node is decoded once)")


def read_depths(exit_depths: Tensor, R: int) -> Tensor:
    """The loop (1..R) each label is read at from recorded exit depths [..., T'] (1..R; 0 off
    the responses, read as R)."""
    return torch.where(exit_depths == 0, R, exit_depths)


def read_loops(reads: Tensor, R: int, dtype: torch.dtype) -> Tensor:
    """[R, B, T'] weights of recorded exit depths ``reads`` [B, T'] (``read_depths``): 1 at
    each token's own loop."""
    return torch.nn.functional.one_hot(read_depths(reads, R) - 1, R).permute(2, 0, 1).to(dtype)


def rl_forward_step(objective: RLObjective):
    """MCore-style ``forward_step_func`` of the RL loss for ``SharedPrefixSchedule`` and
    ``naive_step``: the wave's log-probs from ``model(wave)``, ``objective.wave_loss``. Its
    ``check_group`` attribute (``objective.check_group``) lets the shared-prefix schedule reject
    a group the loss cannot use before any compute."""

    def forward_step(data_iterator, model):
        wave = next(data_iterator)
        output = model.readouts(wave) if objective.needs_readouts else model(wave)
        return output, partial(objective.wave_loss, wave)

    forward_step.check_group = objective.check_group
    return forward_step


def exit_stats(exit_logprobs: Tensor, mask: Tensor) -> dict:
    """Detached sums over the masked tokens ([B, T'] mask) of the mean exit loop
    sum_r r p_r (loops counted from 1) and the exit distribution's entropy."""
    p = exit_logprobs.detach().exp()  # [R, B, T']
    r = torch.arange(1, p.shape[0] + 1, dtype=p.dtype, device=p.device)[:, None, None]
    on = mask != 0
    mean_loop = torch.where(on, (r * p).sum(0), 0).sum()
    entropy = torch.where(on, -(p * exit_logprobs.detach()).sum(0), 0).sum()
    return {"exit_loop": mean_loop, "exit_entropy": entropy}
