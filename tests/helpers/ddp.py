"""Two-rank MCore DDP + distributed-optimizer harness of the joint-replay DDP tests: the
model and its wrapper (``_build``), bucket count, reduced gradients and the whole-gradient
relative error."""

import torch
import torch.distributed as dist

VOCAB, MAX_SEQ, LOOPS = 64, 16, 3
SEED = 7
LR, WEIGHT_DECAY, BETAS, ADAM_EPS = 1e-2, 0.1, (0.9, 0.999), 1e-8
BUCKET_SIZE = 6000  # elements; the ~45k-parameter model then spans several buckets


def _build(overlap_grad_reduce: bool, *, seed: int = SEED, vocab: int = VOCAB,
           max_seq: int = MAX_SEQ, weight_decay: float = WEIGHT_DECAY, **looped):
    """Tiny fp32 looped GPT (R=3, prelude + coda + injection; ``looped``: more config fields)
    in MCore DDP + distributed AdamW, with the config hooks Megatron's training loop sets.
    Each call builds its own config object: the hooks live on it."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
    from scalerlt_mcore.model.config import LoopedTransformerConfig

    config = LoopedTransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        looped_num_loops=LOOPS, looped_num_prelude_layers=1, looped_num_coda_layers=1,
        looped_injection="linear_concat", **looped,
    )
    torch.manual_seed(seed)
    gpt = LoopedGPTModel(config, get_looped_gpt_layer_local_spec(), vocab, max_seq)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=BUCKET_SIZE,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    # clip_grad=0: clipping is a function of the reduced grads compared below, not under test.
    opt_config = OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=weight_decay, decoupled_weight_decay=True,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=ADAM_EPS, clip_grad=0.0,
        use_distributed_optimizer=True, bf16=False, fp16=False,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    assert isinstance(optimizer.optimizer, torch.optim.AdamW)
    config.grad_scale_func = optimizer.scale_loss
    if overlap_grad_reduce:  # as Megatron's training loop: only with overlapped reduction
        config.no_sync_func = model.no_sync
        config.grad_sync_func = model.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer


def _num_buckets(model) -> int:
    return sum(len(buffer.buckets) for buffer in model.buffers)


def _reduced_grads(model, rank: int, world_size: int) -> dict:
    """name -> the fully reduced gradient. After finalize_model_grads each rank holds the
    reduce-scattered (reduced) shard of every bucket; the rest of its grad buffer is still
    local. Gather the reduced shards into a copy of the buffer and slice every parameter."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    names = {p: n for n, p in model.module.named_parameters()}
    grads = {}
    for buffer in model.buffers:
        full = torch.empty_like(buffer.grad_data)
        for bucket in buffer.buckets:
            view = full[bucket.offset : bucket.offset + bucket.grad_data.numel()]
            mine = shard_buffer(bucket.grad_data, world_size)[rank]
            dist.all_gather(shard_buffer(view, world_size), mine)
        for param, (start, end, _) in buffer.param_index_map.items():
            grads[names[param]] = full[start:end].view(param.shape)
    return grads


def _global_rel_error(a: dict, b: dict) -> float:
    """max over all entries |a - b| / max over all entries |b| (the whole reduced gradient)."""
    diff = max((a[name] - ref).abs().max().item() for name, ref in b.items())
    return diff / max(ref.abs().max().item() for ref in b.values())
