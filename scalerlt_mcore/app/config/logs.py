"""The logging section: checkpoints, run directory, logs and pretrained weights, and their
checks."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .library import positive

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass
class LoggingArgs:
    """Checkpoints, run directory and logs."""

    save: Optional[str] = None
    """Checkpoint directory to save to; None: no checkpoints."""
    load: Optional[str] = None
    """Checkpoint directory to resume from."""
    save_interval: int = 0
    """Save every this many steps; 0: only at the end (when ``save`` is set)."""
    save_keep_last: int = 0
    """Keep only the newest this many complete checkpoints under ``save`` (older ``iter_*``
    directories are deleted after each save); 0: keep all (Megatron-Bridge's
    ``most_recent_k``)."""
    run_dir: Optional[str] = None
    """Where logs, plots and the resolved config go; None: ``runs/<timestamp>``."""
    log_interval: int = 1
    """Log every this many steps."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard scalars (rewards, lengths, loss, KL, clip fraction, per-loop accuracy,
    tokens/s, step times) here; None: no TensorBoard."""
    no_plot: bool = False
    """Do not write the training-curve plot."""
    wandb_project: Optional[str] = None
    """Weights & Biases project to log every metric to (needs the ``wandb`` extra; offline
    with ``WANDB_MODE=offline``); None: no W&B."""
    wandb_exp_name: Optional[str] = None
    """The W&B run's name; None: W&B picks one."""
    wandb_save_dir: Optional[str] = None
    """Where W&B writes its files; None: the run directory."""
    pretrained_checkpoint: Optional[str] = None
    """Start from these weights (weights only: optimizer, LR schedule and step start fresh):
    a Hugging Face Llama / Qwen2 directory (config.json + *.safetensors), a stock MCore
    GPTModel distributed checkpoint, or a ``save`` directory of this trainer. When ``load``
    holds a checkpoint, training resumes from it instead."""
    use_checkpoint_args: bool = False
    """Take the architecture (layer shapes, norms, RoPE, vocabulary size) from the pretrained
    Hugging Face config.json instead of the model flags."""
    finetune: bool = False
    """With ``load``: load the model weights only and start at step 0 (fresh optimizer, LR
    schedule and step)."""
    no_load_optim: bool = False
    """With ``load``: do not load the optimizer state (Adam moments start at zero) nor the LR
    schedule, as Megatron-LM; weights and step are loaded, and the schedule is this run's
    (its flags), at the point a run with these flags reaches at that step."""
    no_load_rng: bool = False
    """With ``load``: do not load RNG state. Checkpoints hold none (each step's data and
    sampling derive from seed and step), so this is accepted as in Megatron and changes
    nothing."""


def check_logging(cfg: "RunConfig") -> list[str]:
    """Intervals, and the flags that need a checkpoint to apply to."""
    lg = cfg.logging
    errors = positive(lg, "save_interval", "save_keep_last", minimum=0)
    errors += positive(lg, "log_interval")
    if lg.use_checkpoint_args and not lg.pretrained_checkpoint:
        errors.append("use_checkpoint_args needs pretrained_checkpoint")
    errors += [f"{k} needs load (the checkpoint it applies to)"
               for k in ("finetune", "no_load_optim", "no_load_rng")
               if getattr(lg, k) and not lg.load]
    return errors
