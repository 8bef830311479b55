"""Whole tensors and this rank's tensor-parallel shards of them, by the attributes MCore sets
on a split parameter (``tensor_model_parallel``, ``partition_dim``): what lets a checkpoint
of whole tensors (a Hugging Face import) load at any TP size and an export write whole
tensors from any TP size.

A split tensor is cut into TP contiguous chunks along its partition dim, rank r holding chunk
r, except a gated MLP's ``linear_fc1`` (SwiGLU: [gate; up] stacked on dim 0), of which rank r
holds [gate chunk r; up chunk r]: MCore's layout of each rank's fc1 output, split in halves.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor


def _split(param) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _gated(name: str, config) -> bool:
    return bool(config.gated_linear_unit) and ".linear_fc1." in name


def local_shard(name: str, param, whole: Tensor, config) -> Tensor:
    """This rank's part of ``whole`` for parameter ``name`` (``whole`` itself for a tensor
    every rank holds whole, or at TP 1)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not _split(param):
        return whole
    rank, dim = parallel_state.get_tensor_model_parallel_rank(), param.partition_dim
    if _gated(name, config):
        return torch.cat([half.chunk(tp, dim=dim)[rank] for half in whole.chunk(2, dim=dim)],
                         dim=dim)
    return whole.chunk(tp, dim=dim)[rank]


def whole_tensor(name: str, param, local: Tensor, config) -> Tensor:
    """The whole tensor of parameter ``name`` from every rank's ``local`` shard (an all-gather
    over the tensor-parallel group: every rank calls it), the inverse of ``local_shard``."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not _split(param):
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(),
                    group=parallel_state.get_tensor_model_parallel_group())
    dim = param.partition_dim
    if _gated(name, config):
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def whole_state_dict(model) -> dict:
    """``model.state_dict()`` (no ``_extra_state``) with every split parameter whole
    (``whole_tensor``; every tensor-parallel rank calls it)."""
    params = dict(model.named_parameters())
    return {k: whole_tensor(k, params[k], v, model.config) if k in params else v
            for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
