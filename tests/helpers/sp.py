"""Shared helpers of the joint-replay tests: tiny looped models, random GRPO groups, and the
NAIVE reference (every response a full prompt+response sequence through STOCK MCore
``get_forward_backward_func()``, with the RL loss written here in plain PyTorch).

The reference loss never calls ``RLObjective``; it is this file's own implementation of
docs/design.md section 2: PPO clipped ratio, k3 KL, per-loop weights, and token_mean /
seq_mean / constant normalisation over the whole group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.config import LoopedTransformerConfig
from scalerlt_mcore.rl.batch import RLGroup
from scalerlt_mcore.rl.objective import RLObjective, rl_forward_step
from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func

VOCAB = 48
MAX_SEQ = 64


# ---- model and data ----------------------------------------------------------------------


def build_model(R: int = 2, arch: bool = False, attn: str = "cascade", hidden: int = 16,
                heads: int = 2, layers: int = 2, vocab: int = VOCAB, **extra) -> LoopedGPTModel:
    """Tiny looped GPT (fp32 parameters). ``arch``: one prelude and one coda layer and
    linear_concat injection (its weight perturbed away from [I | 0] so the embedding path
    carries gradient)."""
    cfg = LoopedTransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        use_cpu_initialization=True, looped_num_loops=R,
        looped_num_prelude_layers=int(arch), looped_num_coda_layers=int(arch),
        looped_injection="linear_concat" if arch else "none", looped_prefix_attention=attn,
        **extra,
    )
    model = LoopedGPTModel(cfg, get_looped_gpt_layer_local_spec(), vocab, MAX_SEQ)
    if arch:
        with torch.no_grad():
            w = model.decoder.injection.weight
            w.add_(0.1 * torch.randn(w.shape, generator=torch.Generator().manual_seed(7)))
    return model


def make_group(G: int, P: int, S: int, R: int, seed: int, dtype=torch.float64,
               kl: bool = False, group_id: int = 0, vocab: int = VOCAB,
               device=None, inference: bool = False) -> RLGroup:
    """A group with one random prompt and G right-padded responses of uneven lengths in
    [1, S] (the first has length S, the last is shorter when S > 1), on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab, (P,), generator=gen)
    lens = torch.randint(1, S + 1, (G,), generator=gen)
    lens[0] = S
    if G > 1 and S > 1:
        lens[-1] = max(1, S // 2)
    responses = torch.zeros(G, S, dtype=torch.long)  # [G, S], right-padded with 0
    for i, n in enumerate(lens.tolist()):
        responses[i, :n] = torch.randint(1, vocab, (n,), generator=gen)
    adv = torch.randn(G, generator=gen, dtype=dtype)
    # Behaviour/reference log-probs near the tiny model's (almost uniform, log 1/V) so that
    # some tokens are clipped and some are not, whatever the advantage's sign.
    base = -math.log(vocab)
    old = base + 0.25 * torch.randn(R, G, P + S, generator=gen, dtype=dtype)
    ref = base + 0.25 * torch.randn(R, G, P + S, generator=gen, dtype=dtype) if kl else None
    # the rollout engine's log-probs: the old ones off by up to ~0.6 nats (weights 0.5 .. 2)
    inf = (old + 0.3 * torch.randn(R, G, P + S, generator=gen, dtype=dtype) if inference
           else None)
    return RLGroup.from_rollout(prompt, responses, lens, 0, device=device, mask_dtype=dtype,
                                group_id=group_id, advantages=adv, old_logprobs=old,
                                ref_logprobs=ref, inference_logprobs=inf)


# ---- the naive reference loss (independent of RLObjective) -------------------------------


@dataclass
class LossSpec:
    normalization: str = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    loop_weights: str = "final"
    constant_length: int = 0
    entropy_weight: float = 0.0
    is_correction: bool = False  # the inference log-probs' importance-sampling weights
    is_coef: Optional[float] = None  # their truncation

    def objective(self) -> RLObjective:
        return RLObjective(normalization=self.normalization, clip_low=self.clip_low,
                           clip_high=self.clip_high, kl_coef=self.kl_coef,
                           loop_weights=self.loop_weights,
                           constant_length=self.constant_length,
                           entropy_weight=self.entropy_weight,
                           inference_is_correction=self.is_correction,
                           is_truncation_coef=self.is_coef)


def ref_loop_weights(scheme: str, R: int) -> list:
    if scheme == "final":
        return [0.0] * (R - 1) + [1.0]
    if scheme == "uniform":
        return [1.0 / R] * R
    assert scheme == "progressive"
    return [r / (R * (R + 1) / 2) for r in range(1, R + 1)]


def ref_token_weights(spec: LossSpec, group_mask: torch.Tensor) -> torch.Tensor:
    """[G, T] per-token coefficient from the WHOLE group's mask (fp64)."""
    m = group_mask.double()
    G, T = m.shape
    if spec.normalization == "token_mean":
        return m / m.sum()
    if spec.normalization == "seq_mean":
        return torch.stack([m[i] / m[i].sum() for i in range(G)]) / G
    assert spec.normalization == "constant"
    return m / (G * (spec.constant_length or T))


def ref_rl_loss(spec: LossSpec, logprobs, old, adv, coef, ref=None,
                inference=None) -> torch.Tensor:
    """sum_r w_r sum_{i,t} coef[i,t] * (-is * min(rho A, clip(rho) A) + kl_coef * k3
    + entropy_weight * p log p), p = exp(logprob) of the sampled token; with
    ``spec.is_correction`` is = min(exp(old - inference), is_coef) (Megatron-LM's
    ``calculate_grpo_loss``), else 1.

    logprobs/old/ref/inference [R, b, T]; adv [b]; coef [b, T] (zero off the loss mask)."""
    R = logprobs.shape[0]
    dt = logprobs.dtype
    total = logprobs.new_zeros(())
    for r, w in enumerate(ref_loop_weights(spec.loop_weights, R)):
        lp = logprobs[r]
        rho = torch.exp(lp - old[r].to(dt))
        a = adv.to(dt)[:, None]
        surrogate = torch.minimum(rho * a,
                                  torch.clamp(rho, 1 - spec.clip_low, 1 + spec.clip_high) * a)
        per_token = -surrogate
        if spec.is_correction:
            weight = torch.exp(old[r].to(dt) - inference[r].to(dt))
            if spec.is_coef is not None:
                weight = torch.minimum(weight, torch.tensor(spec.is_coef, dtype=dt))
            per_token = weight * per_token
        if spec.kl_coef > 0:
            d = ref[r].to(dt) - lp
            per_token = per_token + spec.kl_coef * (torch.exp(d) - d - 1)
        if spec.entropy_weight > 0:
            per_token = per_token + spec.entropy_weight * torch.exp(lp) * lp
        on = coef != 0  # never multiply an off-mask inf/nan by zero
        total = total + w * torch.where(on, per_token * coef.to(dt), 0).sum()
    return total


# ---- naive training through stock MCore --------------------------------------------------


def naive_microbatches(groups, spec: LossSpec, per_mb: int) -> list:
    """Every response a full sequence; ``per_mb`` responses of one group per microbatch."""
    batches = []
    for k, g in enumerate(groups):
        coef = ref_token_weights(spec, g.loss_mask)
        for idx in torch.arange(g.group_size).split(per_mb):
            batches.append(dict(
                group=k, tokens=g.tokens[idx], labels=g.labels[idx], coef=coef[idx],
                adv=g.advantages[idx], old=g.old_logprobs[:, idx],
                ref=None if g.ref_logprobs is None else g.ref_logprobs[:, idx],
                inf=None if g.inference_logprobs is None else g.inference_logprobs[:, idx],
            ))
    return batches


def naive_forward_step(spec: LossSpec, scale: float, data_iterator, model):
    """MCore forward_step_func: full sequences, RL loss as ``loss_func``."""
    batch = next(data_iterator)
    logprobs = model(batch["tokens"], labels=batch["labels"]).logprobs  # [R, b, T]

    def loss_func(output):
        loss = ref_rl_loss(spec, output, batch["old"], batch["adv"], batch["coef"], batch["ref"],
                           batch["inf"])
        # MCore divides by num_microbatches; ``scale`` = num_microbatches / num_groups makes
        # the step loss the mean of the group losses, as joint replay defines it.
        return loss * scale, {"loss": loss.detach(), "group": batch["group"],
                              "logprobs": output.detach()}

    return logprobs, loss_func


def naive_step(model, groups, spec: LossSpec, per_mb: int, forward_only: bool = False):
    """Stock MCore step over the naive microbatches -> (group losses, forward data store)."""
    batches = naive_microbatches(groups, spec, per_mb)
    fb = get_forward_backward_func()
    out = fb(forward_step_func=partial(naive_forward_step, spec, len(batches) / len(groups)),
             data_iterator=iter(batches), model=model, num_microbatches=len(batches),
             seq_length=0, micro_batch_size=1, forward_only=forward_only)
    losses = [sum(o["loss"] for o in out if o["group"] == k) for k in range(len(groups))]
    return losses, out


def joint_step(model, groups, spec: LossSpec, wave_size: int, checkpoint_waves: bool = False,
               forward_only: bool = False, **kw):
    """A joint-replay step of ``groups``; the prompt recomputed unless ``kw`` says otherwise
    (a ``prompt`` or a ``chooser``)."""
    if "chooser" not in kw:
        kw.setdefault("prompt", "recompute")
    fb = get_shared_prefix_forward_backward_func(wave_size, checkpoint_waves=checkpoint_waves,
                                                 **kw)
    step = rl_forward_step(spec.objective())
    out = fb(forward_step_func=step, data_iterator=iter(groups), model=model,
             num_microbatches=len(groups), seq_length=0, micro_batch_size=1,
             forward_only=forward_only, collect_non_loss_data=forward_only)
    return [{"logprobs": lp} for lp in out] if forward_only else out


# ---- comparisons ---------------------------------------------------------------------------


def grads(model) -> dict:
    """A copy of every parameter's grad (zeros where autograd left None)."""
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def rel_errors(got: dict, ref: dict) -> dict:
    """Per tensor: max |got - ref| / max |ref| (computed in fp64)."""
    out = {}
    for n, r in ref.items():
        r64, g64 = r.double(), got[n].double()
        scale = r64.abs().max()
        assert scale > 0, f"reference grad of {n} is identically zero: test is not probing it"
        out[n] = float((g64 - r64).abs().max() / scale)
    return out


def rel_errors_with_zeros(got: dict, ref: dict, expected_zero: set) -> dict:
    """``rel_errors`` where the parameters named in ``expected_zero`` (ones the feature under
    test cuts off from the loss) must have exactly zero grads on both sides."""
    for n in expected_zero:
        assert not ref[n].any(), f"{n}: the reference gives it a gradient"
        assert not got[n].any(), f"{n}: the reference gives no gradient, the schedule does"
    return rel_errors({n: g for n, g in got.items() if n not in expected_zero},
                      {n: r for n, r in ref.items() if n not in expected_zero})
