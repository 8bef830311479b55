"""The streamed readout: log-probs of labels computed over vocabulary tiles.

The plain readout (``output_layer`` then ``token_logprobs``) keeps the fp32 logits [.., V / tp]
of every position and loop for the backward (and the log-softmax or MCore's vocab-parallel
cross entropy a softmax of the same size): with Ouro's vocabulary of 49,152 that is 786 KB
per response token at R = 4. ``streamed_logprobs`` computes the same log-probs tile by tile
(``tile`` vocabulary rows at a time): the forward keeps a running max and sum of exponentials
and the label's logit, all-reduced over the tensor-parallel group as MCore's vocab-parallel
cross entropy does; it saves only the readout input, the labels and one log-sum-exp per token.
The backward recomputes each tile's logits and accumulates the input's gradient and the
output weight's gradient (a ``.grad``, which MCore DDP's hook adds to ``main_grad``) tile by
tile. The RL loss needs no other quantity of the full vocabulary: its entropy term (-p log p)
and k3 KL are functions of the sampled token's log-prob (``rl/objective.py``). The output
layer has no bias (``LoopedGPTModel`` builds it with ``bias=False``) and the looped config
refuses sequence parallelism, so neither appears here.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from .vocab_parallel import group_size, logprob_temperature, tp_group_or_default


def streamed_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, tile: int,
                      tp_group=None, temperature: float = 1.0) -> Tensor:
    """log_softmax(hidden @ weight^T / T)[label] without the logits: hidden [S, B, H] (the
    readout input, after the final norm), weight [V / tp, H] (this rank's rows of the output
    layer or the tied embedding), labels [B, S] (global ids) -> [B, S] in fp32 or wider (fp64
    hidden: fp64). ``tile``: vocabulary rows per tile (>= 1); ``tp_group``: as
    ``token_logprobs``; T = ``logprob_temperature(temperature)``."""
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"looped_readout_tile must be an integer >= 1 here, got {tile!r}")
    if hidden.dim() != 3 or labels.shape != (hidden.shape[1], hidden.shape[0]):
        raise ValueError(f"streamed readout: hidden must be [S, B, H] and labels [B, S], got "
                         f"{tuple(hidden.shape)} and {tuple(labels.shape)}")
    group = tp_group_or_default(tp_group)
    out = _StreamedLogprobs.apply(hidden, weight, labels.t(), tile, group,
                                  logprob_temperature(temperature))
    return out.t()  # [B, S]


def _tiles(vocab: int, tile: int):
    return ((start, min(start + tile, vocab)) for start in range(0, vocab, tile))


def _tile_logits(flat: Tensor, weight: Tensor, start: int, end: int, acc, T: float) -> Tensor:
    """[N, end - start] logits of rows start..end in ``acc``, divided by T as ``tempered``:
    the matmul in the weights' dtype (as the output layer), then the cast."""
    logits = (flat @ weight[start:end].t()).to(acc)
    return logits if T == 1.0 else logits.div_(T)


def _label_columns(labels: Tensor, offset: int, width: int) -> tuple:
    """(rows whose label lies in [offset, offset + width), their columns there)."""
    local = labels - offset
    inside = (local >= 0) & (local < width)
    return inside, local.clamp(0, width - 1)


class _StreamedLogprobs(torch.autograd.Function):
    """hidden [S, B, H], weight [V / tp, H], labels [S, B] -> log-probs [S, B]; saves hidden,
    labels and the per-token log-sum-exp."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, tile, group, T):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        flat, lab = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        offset = (dist.get_rank(group) * weight.shape[0]) if group_size(group) > 1 else 0
        inside, column = _label_columns(lab, offset, weight.shape[0])
        run_max = torch.full(lab.shape, -torch.inf, dtype=acc, device=hidden.device)
        run_sum = torch.zeros(lab.shape, dtype=acc, device=hidden.device)
        picked = torch.zeros(lab.shape, dtype=acc, device=hidden.device)
        for start, end in _tiles(weight.shape[0], tile):
            logits = _tile_logits(flat, weight, start, end, acc, T)
            new_max = torch.maximum(run_max, logits.max(dim=-1)[0])
            run_sum = (run_sum * (run_max - new_max).exp()
                       + (logits - new_max[:, None]).exp().sum(dim=-1))
            run_max = new_max
            here = inside & (column >= start) & (column < end)
            cols = (column - start).clamp(0, end - start - 1)
            picked += torch.where(here, logits.gather(1, cols[:, None])[:, 0], 0)
        lse = _reduce_lse(run_max, run_sum, group)
        if group_size(group) > 1:
            dist.all_reduce(picked, group=group)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.tile, ctx.group, ctx.T = tile, group, T
        return (picked - lse).view(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels, lse = ctx.saved_tensors
        tile, group, T = ctx.tile, ctx.group, ctx.T
        acc = lse.dtype
        flat, lab = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        grad = grad.reshape(-1).to(acc)
        offset = (dist.get_rank(group) * weight.shape[0]) if group_size(group) > 1 else 0
        inside, column = _label_columns(lab, offset, weight.shape[0])
        grad_hidden = (torch.zeros(flat.shape, dtype=acc, device=flat.device)
                       if ctx.needs_input_grad[0] else None)
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for start, end in _tiles(weight.shape[0], tile):
            logits = _tile_logits(flat, weight, start, end, acc, T)
            d_logits = (logits - lse[:, None]).exp_().mul_(-grad[:, None])  # -g p
            here = inside & (column >= start) & (column < end)
            cols = (column - start).clamp(0, end - start - 1)
            d_logits.scatter_add_(1, cols[:, None], torch.where(here, grad, 0)[:, None])
            d_z = (d_logits if T == 1.0 else d_logits.div_(T)).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden += d_z @ weight[start:end]
            if grad_weight is not None:
                torch.matmul(d_z.t(), flat, out=grad_weight[start:end])
        if grad_hidden is not None:
            if group_size(group) > 1:
                dist.all_reduce(grad_hidden, group=group)  # the column-parallel input's grad
            grad_hidden = grad_hidden.to(hidden.dtype).view(hidden.shape)
        return grad_hidden, grad_weight, None, None, None, None


def _reduce_lse(run_max: Tensor, run_sum: Tensor, group) -> Tensor:
    """log sum_v exp(logit_v) over the whole vocabulary from each rank's running max and sum
    (max all-reduced first, then the rescaled sums, as MCore's vocab-parallel cross
    entropy)."""
    if group_size(group) > 1:
        local_max = run_max.clone()
        dist.all_reduce(run_max, op=dist.ReduceOp.MAX, group=group)
        run_sum = run_sum * (local_max - run_max).exp()
        dist.all_reduce(run_sum, group=group)
    return run_max + run_sum.log()
