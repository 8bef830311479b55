"""The readout under tensor parallelism: logits are split over the vocabulary (MCore's
``ColumnParallelLinear`` output layer), each rank holding V / tp of them.

- ``token_logprobs``: log p(label), by MCore's vocab-parallel cross entropy when the vocabulary
  is split (by log-softmax otherwise), at a sampling temperature (``logprob_temperature``);
- ``gather_vocab``: the full-vocabulary logits on every rank of the group (for sampling);
- ``padded_vocab_size``: the vocabulary padded as Megatron pads it, so that it splits evenly.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as _CE
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import VocabUtility
from torch import Tensor


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by`` x ``tensor_parallel_size``
    (Megatron's ``--make-vocab-size-divisible-by``). Ids >= ``vocab_size`` are padding: no label
    is one, and samplers must never draw one."""
    if vocab_size < 1 or divisible_by < 1 or tensor_parallel_size < 1:
        raise ValueError(f"vocab_size ({vocab_size}), make_vocab_size_divisible_by "
                         f"({divisible_by}) and the tensor-parallel size "
                         f"({tensor_parallel_size}) must be >= 1")
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def tp_group_or_default(tp_group):
    """``tp_group``, else MCore's tensor-parallel group when model parallelism is set up."""
    if tp_group is None and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return tp_group


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def logprob_temperature(temperature: float) -> float:
    """The T of the log-probs of tokens sampled at ``temperature``: log_softmax(logits / T) is
    the distribution they were drawn from (before top-p). Greedy (0) has no such distribution:
    its tokens are scored at T = 1, the policy's own."""
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be finite and >= 0 (0: greedy), got {temperature}")
    return float(temperature) or 1.0


def token_logprobs(logits: Tensor, labels: Tensor, tp_group=None,
                   temperature: float = 1.0) -> Tensor:
    """log p(labels) from logits [..., V / tp] split over ``tp_group`` (default: MCore's
    tensor-parallel group; size 1: not split), in fp32 or wider: fp64 logits give fp64
    log-probs. ``temperature``: of the distribution log_softmax(logits / T) (T =
    ``logprob_temperature(temperature)``; 1: the logits as they are)."""
    logits = tempered(logits, temperature)
    tp_group = tp_group_or_default(tp_group)
    if group_size(tp_group) == 1:
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return _VocabParallelLogprobs.apply(logits, labels, tp_group)


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """``logits`` in fp32 or wider divided by T = ``logprob_temperature(temperature)``: one
    scaled copy (the cast's, when it casts), never the caller's tensor changed; at T = 1 the
    cast alone."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    T = logprob_temperature(temperature)
    return logits.to(acc) if T == 1.0 else logits.to(acc, copy=True).div_(T)


def gather_vocab(logits: Tensor, tp_group=None) -> Tensor:
    """logits [..., V / tp] -> [..., V], identical on every rank of ``tp_group`` (default as
    ``token_logprobs``)."""
    tp_group = tp_group_or_default(tp_group)
    if group_size(tp_group) == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits, group=tp_group)


class _VocabParallelLogprobs(torch.autograd.Function):
    """Minus MCore's vocab-parallel cross entropy, assembled from its own steps
    (``VocabParallelCrossEntropy``) on an explicit group and in the logits' dtype: MCore's
    ``vocab_parallel_cross_entropy`` casts to fp32 and uses the global TP group."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        # MCore's steps work in place: on a private contiguous copy
        logits = logits.to(memory_format=torch.contiguous_format, copy=True)
        logits_max = logits.max(dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.shape[-1], dist.get_rank(group), dist.get_world_size(group))
        mask, target_1d, predicted, sum_exp, exp_logits = _CE.calculate_predicted_logits(
            logits, labels, logits_max, start, end)
        dist.all_reduce(predicted, group=group)
        dist.all_reduce(sum_exp, group=group)
        softmax, loss = _CE.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, mask, target_1d)
        return -loss

    @staticmethod
    def backward(ctx, grad):
        softmax, mask, target_1d = ctx.saved_tensors
        grad_2d, rows, update, grad_input = _CE.prepare_gradient_calculation_operands(
            softmax, mask)
        grad_input = _CE.calculate_gradients(grad_2d, rows, target_1d, update, grad_input,
                                             -grad)  # d(-loss) = -d(loss)
        return grad_input, None, None
