"""The main job's pretrained start in process: a trainer built as ``train.run`` builds it
from a pretrained checkpoint (``build``), one step, flat parameters and Adam moments."""

import torch

from scalerlt_mcore.app import runtime
from scalerlt_mcore.app.config import parse_args, validate
from scalerlt_mcore.app.pretrained import (
    load_before_wrap,
    resolve_pretrained,
    resume_after_wrap,
    resume_checkpoint,
    run_vocab_size,
)
from scalerlt_mcore.app.trainer import RLTrainer


def build(argv: list):
    """(trainer, start step, log lines): what ``train._run`` builds, on the current state."""
    cfg = parse_args(argv)
    notes = resolve_pretrained(cfg)
    validate(cfg, torch.distributed.get_world_size())
    resume = resume_checkpoint(cfg)
    config = runtime.model_config(cfg, "cpu")
    model = runtime.build_model(cfg, config, run_vocab_size(cfg), "cpu")
    notes += load_before_wrap(cfg, model)
    ddp, optimizer, scheduler = runtime.wrap_for_training(cfg, config, model)
    trainer = RLTrainer(cfg, model, ddp, optimizer, scheduler)
    return trainer, resume_after_wrap(cfg, trainer, resume), notes


def _step(trainer, step: int) -> dict:
    sft = trainer.cfg.rl.rl_warmup_sft_steps
    return trainer.sft_step(step) if step < sft else trainer.rl_step(step)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _adam_moments(optimizer) -> torch.Tensor:
    (inner,) = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [inner.optimizer.state[s] for g in inner.shard_fp32_groups for s in g]
    return torch.cat([torch.cat([s["exp_avg"].reshape(-1), s["exp_avg_sq"].reshape(-1)])
                      for s in states])
