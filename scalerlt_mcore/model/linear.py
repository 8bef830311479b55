"""MCore's tensor-parallel linears with a direct path for forwards that record no graph.

Under ``torch.no_grad`` (rollouts, scoring, the prompt-once producer's first pass) MCore's
``ColumnParallelLinear`` / ``RowParallelLinear`` still route each matmul through three
``autograd.Function`` calls (the copy to the tensor-parallel region, the matmul with gradient
accumulation, the reduce from the region). No gradient is recorded, but every ``apply`` costs
host time, and a decode step of a small model is bound by host time: on the decode benchmark
(``benchmarks/decode.py``) they were a third of a step. These subclasses compute the same
tensors directly when no graph is recorded and the layer is in its plain layout (no sequence
parallelism, expert communication, deferred weight gradients or weight sharding): the matmul
``input @ W^T`` then ``+ bias`` as MCore's autograd function does it, then the row-parallel
all-reduce as MCore's reduce does it. Bitwise MCore's own forward
(``tests/model/test_linear.py``, tensor-parallel size 1 and 2); with a graph recorded (training)
MCore's forward runs unchanged. Same parameters and state dict as MCore's.
"""

from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn


def _direct(layer) -> bool:
    """The forward may skip MCore's autograd functions: no graph is recorded and nothing of
    the layer's layout needs them."""
    config = layer.config
    return (not torch.is_grad_enabled() and not layer.sequence_parallel
            and not getattr(layer, "explicit_expert_comm", False)
            and not config.defer_embedding_wgrad_compute
            and getattr(layer, "gtp_remat_size", 1) == 1
            and config._cpu_offloading_context is None)


def _matmul(input_: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """MCore's linear forward: [s, b, k] @ [n, k]^T (+ bias) -> [s, b, n]."""
    output = torch.matmul(input_, weight.t())
    return output if bias is None else output + bias


def _all_reduce(x: Tensor, group) -> Tensor:
    """MCore's reduce from the tensor-parallel region (forward): identity on one rank."""
    if group.size() == 1:
        return x
    x = x.contiguous()
    torch.distributed.all_reduce(x, group=group)
    return x


class ColumnParallelLinear(tensor_parallel.ColumnParallelLinear):
    """MCore's ``ColumnParallelLinear``; without a recorded graph, computed directly."""

    def forward(self, input_: Tensor, weight: Optional[Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        used = self.weight if weight is None else weight
        expected = (self.output_size_per_partition, self.input_size)
        if (gather or used is None or tuple(used.shape) != expected  # MCore's errors
                or not _direct(self)):
            return super().forward(input_, weight, runtime_gather_output)
        output = _matmul(input_, used, None if self.skip_bias_add else self.bias)
        return output, self.bias if self.skip_bias_add else None


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """MCore's ``RowParallelLinear``; without a recorded graph, computed directly."""

    def forward(self, input_: Tensor):
        if not self.input_is_parallel or not _direct(self):
            return super().forward(input_)
        output = _all_reduce(_matmul(input_, self.weight, None), self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


DIRECT = {tensor_parallel.ColumnParallelLinear: ColumnParallelLinear,
          tensor_parallel.RowParallelLinear: RowParallelLinear}
"""MCore's linear -> its subclass here (what the layer specs swap in)."""


class ReplicatedLinear(MegatronModule):
    """[s, b, k] -> [s, b, n], weight [n, k] and bias [n] (zeros) whole on every
    tensor-parallel rank: for an output too narrow to split (the exit gate's one logit) of an
    input every rank holds whole. Computed as MCore's linears compute it (matmul, then the
    bias); the weight drawn as MCore draws a ``ColumnParallelLinear``'s at TP 1 (the whole
    weight by ``config.init_method``: on the host in fp32 with ``use_cpu_initialization``,
    else from the device's default generator, which MCore seeds alike on every
    tensor-parallel rank), so every rank holds the same numbers."""

    def __init__(self, config, input_size: int, output_size: int):
        super().__init__(config=config)
        host = config.use_cpu_initialization
        device = "cpu" if host else torch.cuda.current_device()
        weight = torch.empty(output_size, input_size, device=device,
                             dtype=torch.float32 if host else config.params_dtype)
        if config.perform_initialization:
            config.init_method(weight)
        self.weight = nn.Parameter(weight.to(config.params_dtype))
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype,
                                             device=device))

    def forward(self, input_: Tensor) -> Tensor:
        return _matmul(input_, self.weight, self.bias)  # [s, b, n]
