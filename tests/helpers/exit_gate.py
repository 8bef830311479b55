"""The exit gate's references: a gated model, its loss in plain PyTorch through stock
MCore ``get_forward_backward_func()`` (``_naive``), and the same groups by joint replay
(``_joint``)."""

from functools import partial

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from helpers.sp import LossSpec, build_model, ref_token_weights
from scalerlt_mcore.rl.objective import RLObjective, rl_forward_step
from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func


def _gated(R=3, arch=True, attn="cascade", learned=False, **extra):
    model = build_model(R=R, arch=arch, attn=attn, looped_exit_gate=True,
                        looped_learned_loop_weights=learned, **extra)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # a gate away from its init (logits of about unit size): p(r) varies
        for p in model.decoder.exit_gate.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        if learned:
            model.decoder.loop_weights.logits.copy_(torch.randn(R, generator=gen))
    return model


def _per_token(spec: LossSpec, lp, old, adv, ref):
    """[R, b, T] PPO-clip (+ k3 KL) per token."""
    rho = torch.exp(lp - old.to(lp.dtype))
    a = adv.to(lp.dtype)[None, :, None]
    per = -torch.minimum(rho * a, torch.clamp(rho, 1 - spec.clip_low, 1 + spec.clip_high) * a)
    if spec.kl_coef > 0:
        d = ref.to(lp.dtype) - lp
        per = per + spec.kl_coef * (torch.exp(d) - d - 1)
    return per


def _ref_loss(spec, scheme, gate_coef, beta, lp, exit_lp, learned, old, adv, coef, ref):
    per = _per_token(spec, lp, old, adv, ref)
    on = (coef != 0)[None].expand_as(per)
    if scheme == "exit_pdf":
        w = exit_lp.detach().exp()
    else:
        w = torch.softmax(learned, 0)[:, None, None].expand_as(per)
    total = torch.where(on, w * per * coef.to(lp.dtype)[None], 0).sum()
    if gate_coef > 0:
        p = exit_lp.exp()
        inner = (p * per.detach()).sum(0) + beta * (p * exit_lp).sum(0)  # E[l] - beta H
        total = total + gate_coef * torch.where(coef != 0, coef.to(lp.dtype) * inner, 0).sum()
    return total


def _naive_forward_step(spec, scheme, gate_coef, beta, scale, num_loops, data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], labels=batch["labels"], num_loops=num_loops)

    def loss_func(output):
        learned = model.decoder.loop_weights.logits if scheme == "learned" else None
        loss = _ref_loss(spec, scheme, gate_coef, beta, output, out.exit_logprobs, learned,
                         batch["old"], batch["adv"], batch["coef"], batch["ref"])
        return loss * scale, {"loss": loss.detach()}

    return out.logprobs, loss_func


def _naive(model, groups, spec, scheme, gate_coef, beta, per_mb, num_loops=None):
    """Stock MCore over full sequences, ``num_loops`` loops (None: the config's)."""
    batches = []
    for g in groups:
        coef = ref_token_weights(spec, g.loss_mask)
        for idx in torch.arange(g.group_size).split(per_mb):
            batches.append(dict(tokens=g.tokens[idx], labels=g.labels[idx], coef=coef[idx],
                                adv=g.advantages[idx], old=g.old_logprobs[:, idx],
                                ref=None if g.ref_logprobs is None else g.ref_logprobs[:, idx]))
    step = partial(_naive_forward_step, spec, scheme, gate_coef, beta,
                   len(batches) / len(groups), num_loops)
    out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(batches),
                                      model=model, num_microbatches=len(batches),
                                      seq_length=0, micro_batch_size=1)
    return sum(float(o["loss"]) for o in out) / len(groups)


def _joint(model, groups, spec, scheme, gate_coef, beta, wave, ck, num_loops=None, **plan):
    """Joint replay of ``groups`` with ``num_loops`` loops (None: the config's); ``plan``: the
    schedule's planner keywords or a ``chooser``."""
    objective = RLObjective(normalization=spec.normalization, clip_low=spec.clip_low,
                            clip_high=spec.clip_high, kl_coef=spec.kl_coef,
                            loop_weights=scheme, exit_gate_coef=gate_coef,
                            exit_entropy_coef=beta)
    fb = get_shared_prefix_forward_backward_func(wave, checkpoint_waves=ck, **plan)
    return fb(forward_step_func=rl_forward_step(objective), data_iterator=iter(groups),
              model=model, num_microbatches=len(groups), seq_length=0, micro_batch_size=1,
              num_loops=num_loops)
