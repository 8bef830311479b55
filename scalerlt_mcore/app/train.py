"""Main job: ``python -m scalerlt_mcore.train [--config X.yaml] [--flag value ...]``.

One process, or ``torchrun --nproc-per-node N`` for N ranks: N / tensor_model_parallel_size
data-parallel ranks (MCore DDP + distributed optimizer), each a group of tensor-parallel
ranks. Without ``--config`` the packaged tiny CPU demo config is used.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state
from tqdm import tqdm

from .arguments import default_run_dir, parse_args, save_resolved, validate
from .checkpoint import save_checkpoint
from .metrics import MetricsLog, plot_rewards
from .pretrained import load_before_wrap, resolve_pretrained, resume_after_wrap, run_vocab_size
from .runtime import (
    build_model,
    init_distributed,
    model_config,
    shutdown_distributed,
    wrap_for_training,
)
from .trainer import RLTrainer


class _Interrupt:
    """While entered, SIGINT/SIGTERM set a flag; the loop saves a checkpoint after the current
    step. The previous handlers are restored on exit."""

    def __init__(self):
        self.requested, self._previous = False, {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.requested = True


def _broadcast_run_dir(cfg) -> Path:
    holder = [cfg.logging.run_dir or default_run_dir()]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def _line(step: int, m: dict) -> str:
    return (f"step {step:4d} | reward {m['reward_mean']:.3f} +- {m['reward_std']:.3f} | "
            f"len {m['response_length']:.2f} | loss {m['loss']:+.4f} | kl {m['kl']:.4f} | "
            f"clip {m['clip_fraction']:.3f} | {m['tokens_per_s']:.0f} tok/s | "
            f"rollout/score/train {m['time_rollout_s']:.2f}/{m['time_score_s']:.2f}/"
            f"{m['time_train_s']:.2f} s | "
            f"saved {m['peak_saved_bytes'] / 2**20:.2f} MiB | "
            f"rollout-vs-train logp {m['rollout_logprob_max_diff']:.1e}")


def run(cfg) -> dict:
    """Validate, then train; returns the final evaluation. The process group and MCore's
    parallel state are destroyed on return and on error."""
    notes = resolve_pretrained(cfg)  # --use-checkpoint-args, --looped-retrofit
    validate(cfg, _world_size())  # before any process group: errors name the key
    device = init_distributed(cfg)
    try:
        return _run(cfg, device, notes)
    finally:
        shutdown_distributed()


def _world_size() -> int:
    """The job's process count: torchrun's WORLD_SIZE, 1 for a plain process."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def _run(cfg, device: str, notes: list) -> dict:
    rank0 = dist.get_rank() == 0
    run_dir = _broadcast_run_dir(cfg)
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg, run_dir)
        print(f"device: {device} ({dist.get_backend()}), data-parallel ranks: "
              f"{parallel_state.get_data_parallel_world_size()}, tensor-parallel ranks: "
              f"{parallel_state.get_tensor_model_parallel_world_size()}, run dir: {run_dir}",
              flush=True)
    config = model_config(cfg, device)
    model = build_model(cfg, config, run_vocab_size(cfg), device)
    notes += load_before_wrap(cfg, model)  # before DDP and the optimizer copy the parameters
    for line in notes if rank0 else []:
        print(line, flush=True)
    ddp, optimizer, scheduler = wrap_for_training(cfg, config, model)
    trainer = RLTrainer(cfg, model, ddp, optimizer, scheduler)
    start = resume_after_wrap(cfg, model, optimizer, scheduler)
    with _Interrupt() as stop:
        return _loop(cfg, trainer, start, run_dir, rank0, stop)


def _loop(cfg, trainer, start: int, run_dir: Path, rank0: bool, stop: _Interrupt) -> dict:
    log = MetricsLog(run_dir, enabled=rank0)
    t0, total = time.perf_counter(), cfg.training.train_iters
    sft = cfg.rl.rl_warmup_sft_steps
    step, saved = start, None
    if start == 0:
        _eval(trainer, log, 0, rank0)  # the starting point of the reward curve
    for step in tqdm(range(start, total), disable=not rank0, desc="RL", initial=start,
                     total=total, file=sys.stderr):
        if step < sft:
            m = trainer.sft_step(step)
            log.log({"kind": "sft", "step": step, **m})
            if rank0 and step % cfg.logging.log_interval == 0:
                tqdm.write(f"warm-up step {step:4d} | answer NLL {m['loss']:.4f}")
        else:
            m = trainer.rl_step(step)
            log.log({"kind": "train", "step": step, **m})
            if rank0 and step % cfg.logging.log_interval == 0:
                tqdm.write(_line(step, m))
        if cfg.rl.rl_eval_every and (step + 1) % cfg.rl.rl_eval_every == 0 and step + 1 < total:
            _eval(trainer, log, step + 1, rank0)
        if _maybe_save(cfg, trainer, step + 1, stop.requested):
            saved = step + 1
        if stop.requested:
            if rank0:
                what = "checkpoint saved" if saved == step + 1 else "nothing saved (no --save)"
                print(f"interrupted: {what} after step {step + 1}", flush=True)
            return {}
    final = _eval(trainer, log, total, rank0)
    if saved != total:  # not again: rewriting it would expose a complete checkpoint to a kill
        _maybe_save(cfg, trainer, total, True)
    if rank0:
        _finish(cfg, log, run_dir, final, total - start, time.perf_counter() - t0)
    return final


def _eval(trainer, log, step: int, rank0: bool) -> dict:
    trainer.use_loops_of(step)
    e = trainer.evaluate()
    log.log({"kind": "eval", "step": step, **e})
    if rank0:
        loops = " ".join(f"{a:.2f}" for a in e["eval_per_loop"])
        tqdm.write(f"eval @ {step}: greedy reward {e['eval_reward']:.3f} (per loop: {loops})")
    return e


def _maybe_save(cfg, trainer, step: int, force: bool) -> bool:
    """Save after ``step`` when forced or at the interval; True when it saved."""
    every = cfg.logging.save_interval
    if cfg.logging.save and (force or (every and step % every == 0)):
        trainer.use_configured_loops()  # the next step sets its curriculum loop count again
        save_checkpoint(cfg.logging.save, step, trainer.model, trainer.optimizer,
                        trainer.scheduler)
        return True
    return False


def _finish(cfg, log, run_dir, final, steps: int, seconds: float) -> None:
    if not cfg.logging.no_plot:
        png = plot_rewards(log.records, run_dir / "reward_curve.png")
        print(f"reward curve: {png}")
    print(f"metrics: {run_dir / 'metrics.jsonl'}")
    print(f"final mean reward {final['eval_reward']:.3f} after {steps} steps in {seconds:.0f} s",
          flush=True)


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
