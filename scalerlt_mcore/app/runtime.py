"""Process setup and model/optimizer construction from a ``RunConfig`` (trainer-side only).

Device: CUDA (NCCL) when available, else CPU with gloo and the opt-in CPU backend.
"""

import contextlib
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from ..cpu_backend import enable_cpu_backend
from ..model import LoopedGPTModel, get_looped_gpt_block_spec
from ..model.config import LoopedTransformerConfig
from .config import model_config

__all__ = ["build_model", "init_distributed", "model_config", "shutdown_distributed",
           "wrap_for_training"]


def init_distributed(cfg) -> str:
    """Process group (torchrun env or a single process), model parallelism, RNG. -> device.
    Call ``validate`` first: MCore's own checks here are assertions."""
    cuda = torch.cuda.is_available()
    if not cuda:
        enable_cpu_backend()
    device_id = None
    if cuda:  # before the process group: NCCL binds this device and a bad setup fails fast
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device_id)
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        timeout = timedelta(minutes=cfg.training.distributed_timeout_minutes)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout, device_id=device_id)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.model.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.model.pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(cfg.training.seed)
    return "cuda" if cuda else "cpu"


def shutdown_distributed() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def build_model(cfg, config: LoopedTransformerConfig, vocab_size: int, device: str):
    """The bare looped GPT on ``device`` with ``vocab_size`` embedding rows (the main job's:
    ``pretrained.run_vocab_size``, the tokenizer's padded as Megatron pads it)."""
    te = cfg.model.transformer_impl == "transformer_engine"
    spec = get_looped_gpt_block_spec(config, use_transformer_engine=te)
    model = LoopedGPTModel(
        config, spec, vocab_size=vocab_size,
        max_sequence_length=cfg.model.max_position_embeddings,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.model.position_embedding_type,
        rotary_base=cfg.model.rotary_base, rope_scaling=cfg.model.use_rope_scaling,
        rope_scaling_factor=cfg.model.rope_scaling_factor,
    )
    # As MCore's Float16Module: every parameter (norms too) in the half dtype; the optimizer
    # keeps fp32 main params. Inputs are token ids and log-probs come out in fp32, so the
    # wrapper's input/output casts are not needed.
    return model.to(device=device, dtype=config.params_dtype)


def wrap_for_training(cfg, config, model):
    """MCore DDP + (distributed) Adam + LR schedule; config funcs set as MCore's training."""
    t = cfg.training
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=t.overlap_grad_reduce,
            use_distributed_optimizer=t.use_distributed_optimizer, bucket_size=t.ddp_bucket_size,
        ),
        module=model,
    )
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        clip_grad=t.clip_grad, bf16=cfg.model.bf16, fp16=cfg.model.fp16,
        params_dtype=config.params_dtype, use_distributed_optimizer=t.use_distributed_optimizer,
    ), [ddp])
    steps = max(t.lr_warmup_iters + 1, scheduled_steps(cfg, t.train_iters))
    decay = max(t.lr_warmup_iters + 1, t.lr_decay_iters or steps)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if t.lr_warmup_iters else t.lr, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters, lr_decay_steps=decay,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=t.override_opt_param_scheduler,
    )
    config.no_sync_func = ddp.no_sync
    config.grad_sync_func = ddp.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer, scheduler


def scheduled_steps(cfg, step: int) -> int:
    """LR-schedule steps a run with ``cfg`` takes before ``step``: ``grpo_iterations`` per RL
    step, and one per warm-up step when the warm-up shares the schedule (no
    ``rl_warmup_sft_lr``)."""
    sft = min(cfg.rl.rl_warmup_sft_steps, cfg.training.train_iters)
    warm_up = 0 if cfg.rl.rl_warmup_sft_lr is not None else min(step, sft)
    return warm_up + max(0, step - sft) * cfg.rl.grpo_iterations


@contextlib.contextmanager
def gc_paused():
    """One garbage collection now, then Python's automatic collection off until the block ends
    (restored as it was): Megatron-LM's ``--manual-gc``. The training loop runs inside it with
    ``manual_gc``; the benchmark times each step inside it."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
