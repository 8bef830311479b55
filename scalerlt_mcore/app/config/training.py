"""The training section: optimizer, LR schedule, batch sizes, evaluation, distributed training
and their checks."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

from .library import positive

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass
class TrainingArgs:
    """Optimizer, batch sizes and distributed training."""

    micro_batch_size: int = 8
    """Responses per forward/backward on one rank."""
    global_batch_size: int = 32
    """Responses per RL step, summed over data-parallel ranks (prompts x grpo_group_size)."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """Steps of linear warm-up to ``lr``."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Gradient-norm clipping threshold; 0 disables it."""
    train_iters: int = 100
    """Steps of the run: supervised warm-up steps, then RL steps (rollout batches)."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "cosine"
    """Learning-rate decay after the warm-up (MCore's ``OptimizerParamScheduler``)."""
    lr_decay_iters: Optional[int] = None
    """Optimizer steps over which the learning rate decays to ``min_lr`` (one per warm-up
    step, ``grpo_iterations`` per RL step); None: all of the run's optimizer steps."""
    override_opt_param_scheduler: bool = False
    """With ``load`` (optimizer state loaded): the LR schedule's shape (``lr``, ``min_lr``,
    warm-up and decay steps, decay style, weight decay) from this run's flags, its position
    (steps taken) from the checkpoint; Megatron-LM's ``--override-opt-param-scheduler``."""
    use_checkpoint_opt_param_scheduler: bool = False
    """With ``load`` (optimizer state loaded): the LR schedule's shape from the checkpoint, this
    run's flags for it ignored; Megatron-LM's ``--use-checkpoint-opt-param-scheduler``. With
    neither, a checkpoint whose schedule differs from this run's is refused, naming the
    fields. (``no_load_optim`` and ``finetune`` load no schedule: it is this run's.)"""
    eval_interval: int = 10
    """Greedy evaluation every this many steps; 0 disables it."""
    eval_iters: int = 16
    """Evaluation batches of ``grpo_prompts_per_step`` held-out prompts each (one greedy
    response per prompt)."""
    exit_interval: int = 0
    """Exit after the step that is a multiple of this (saving a checkpoint when ``save`` is
    set); 0: run all ``train_iters``."""
    distributed_timeout_minutes: int = 10
    """Timeout of collective operations (``torch.distributed.init_process_group``)."""
    manual_gc: bool = False
    """Disable Python's automatic garbage collection (one collection at start) and collect
    only every ``manual_gc_interval`` steps, as Megatron-LM's ``--manual-gc``: a full
    collection traverses every Python object of the process, and joint replay's many small
    passes trigger it often."""
    manual_gc_interval: int = 0
    """With ``manual_gc``: ``gc.collect()`` after every this many steps; 0: never during
    training."""
    seed: int = 1234
    """Random seed (model init, sampling, task problems)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (MCore distributed optimizer)."""
    overlap_grad_reduce: bool = False
    """Overlap the gradient reduce-scatter/all-reduce with backward (MCore DDP)."""
    ddp_bucket_size: Optional[int] = None
    """Elements per DDP gradient bucket; None: MCore's default."""


def check_training(cfg: "RunConfig", world_size: int) -> list[str]:
    """The optimizer, the LR schedule, the step counts and intervals, and the batch sizes."""
    return _check_optimizer(cfg.training) + _check_steps(cfg.training) + _check_batches(
        cfg, world_size)


def _check_optimizer(t: TrainingArgs) -> list[str]:
    """Adam, the LR schedule and the DDP buckets."""
    errors = positive(t, "lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad",
                      minimum=0)
    if t.min_lr > t.lr:
        errors.append(f"min_lr ({t.min_lr}) must not exceed lr ({t.lr})")
    if t.adam_eps <= 0:
        errors.append(f"adam_eps must be > 0, got {t.adam_eps}")
    for k in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(t, k) < 1:
            errors.append(f"{k} must be in [0, 1), got {getattr(t, k)}")
    if t.lr_decay_iters is not None and t.lr_decay_iters < 1:
        errors.append(f"lr_decay_iters must be >= 1 or null, got {t.lr_decay_iters}")
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        errors.append("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler "
                      "exclude each other: the LR schedule comes from this run's flags or from "
                      "the checkpoint")
    if t.ddp_bucket_size is not None and t.ddp_bucket_size < 1:
        errors.append(f"ddp_bucket_size must be >= 1 or null, got {t.ddp_bucket_size}")
    return errors


def _check_steps(t: TrainingArgs) -> list[str]:
    """Step counts, intervals and the collectives' timeout."""
    errors = positive(t, "train_iters", "eval_iters", "distributed_timeout_minutes")
    return errors + positive(t, "eval_interval", "exit_interval", "manual_gc_interval",
                             minimum=0)


def _check_batches(cfg: "RunConfig", world_size: int) -> list[str]:
    """The batch sizes against the group size and the data-parallel size."""
    t, group = cfg.training, cfg.rl.grpo_group_size
    errors = positive(t, "micro_batch_size", "global_batch_size")
    errors += positive(cfg.rl, "grpo_group_size")
    if errors:
        return errors
    dp = max(world_size // max(cfg.model.tensor_model_parallel_size, 1), 1)
    prompts = cfg.rl.grpo_prompts_per_step
    if prompts is not None and prompts * group != t.global_batch_size:
        errors.append(f"global_batch_size ({t.global_batch_size}) must equal "
                      f"grpo_prompts_per_step x grpo_group_size ({prompts} x {group}): one "
                      "optimizer step per pass over the rollout batch")
    elif t.global_batch_size % (dp * group):
        errors.append(f"global_batch_size ({t.global_batch_size}) must be divisible by "
                      f"data-parallel size x grpo_group_size ({dp} x {group} = {dp * group})")
    elif (t.global_batch_size // dp) % t.micro_batch_size:
        errors.append(f"responses per rank (global_batch_size / data-parallel size = "
                      f"{t.global_batch_size // dp}) must be divisible by micro_batch_size "
                      f"({t.micro_batch_size})")
    return errors
