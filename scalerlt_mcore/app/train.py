"""Main job: ``python -m scalerlt_mcore.train [--config X.yaml] [--flag value ...]``.

One process, or ``torchrun --nproc-per-node N`` for N ranks: N / tensor_model_parallel_size
data-parallel ranks (MCore DDP + distributed optimizer), each a group of tensor-parallel
ranks. Without ``--config`` the packaged tiny CPU demo config is used.

From the command line (``cli``), errors a user causes (flags, config file, ``--load``,
``--save``, ``--run-dir``) print one line, ``error: ...``, and exit with status 2; any other
error keeps its traceback.
"""

import contextlib
import gc
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state
from tqdm import tqdm

from ..mcore_compat import fallback_note
from .checkpoint import CheckpointError, checkpoint_meta, save_checkpoint
from .config import ConfigError, parse_args, save_resolved, to_dict, validate
from .metrics import MetricsLog, plot_rewards, read_records
from .pretrained import (
    load_before_wrap,
    resolve_pretrained,
    resume_after_wrap,
    resume_checkpoint,
    run_vocab_size,
)
from .rundir import check_writable, make_run_dir
from .runtime import (
    build_model,
    gc_paused,
    init_distributed,
    model_config,
    shutdown_distributed,
    wrap_for_training,
)
from .trainer import RLTrainer

USER_ERRORS = (ConfigError, CheckpointError)
"""Errors a user causes: ``cli`` prints their message alone, without a traceback."""


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


def _broadcast_run_dir(cfg, resume) -> Path:
    """Rank 0 creates the run directory (``make_run_dir``; resuming: the checkpoint's) and
    sends its path, or its error, to every rank."""
    holder = [None]
    if dist.get_rank() == 0:
        previous = checkpoint_meta(resume).get("run_dir") if resume else None
        try:
            holder = [str(make_run_dir(cfg.logging.run_dir, previous))]
        except ConfigError as e:
            holder = [e]
    dist.broadcast_object_list(holder, src=0)
    if isinstance(holder[0], ConfigError):
        raise holder[0]
    return Path(holder[0])


def _line(step: int, m: dict) -> str:
    return (f"step {step:4d} | {m['step_ms']:.0f} ms/iter | "
            f"reward {m['reward_mean']:.3f} +- {m['reward_std']:.3f} | "
            f"len {m['response_length']:.2f} | entropy {m['entropy']:.2f} | "
            f"loss {m['loss']:+.4f} | kl {m['kl']:.4f} | "
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
    resume = resume_checkpoint(cfg)  # verified before anything is built
    if cfg.logging.save:
        check_writable(cfg.logging.save, "save")
    run_dir = _broadcast_run_dir(cfg, resume)
    if rank0:
        save_resolved(cfg, run_dir)
        print(f"device: {device} ({dist.get_backend()}), data-parallel ranks: "
              f"{parallel_state.get_data_parallel_world_size()}, tensor-parallel ranks: "
              f"{parallel_state.get_tensor_model_parallel_world_size()}, run dir: {run_dir}",
              flush=True)
        if fallback_note():
            print(fallback_note(), flush=True)
    config = model_config(cfg, device)
    model = build_model(cfg, config, run_vocab_size(cfg), device)
    notes += load_before_wrap(cfg, model)  # before DDP and the optimizer copy the parameters
    for line in notes if rank0 else []:
        print(line, flush=True)
    ddp, optimizer, scheduler = wrap_for_training(cfg, config, model)
    trainer = RLTrainer(cfg, model, ddp, optimizer, scheduler)
    start = resume_after_wrap(cfg, trainer, resume)
    log = MetricsLog(run_dir, enabled=rank0, start=start,
                     tensorboard_dir=cfg.logging.tensorboard_dir)
    if log.dropped:
        print(f"{log.path}: dropped {log.dropped} records from step {start} on (written again "
              f"by this run)", flush=True)
    try:
        manual_gc = gc_paused() if cfg.training.manual_gc else contextlib.nullcontext()
        with _Interrupt() as stop, manual_gc:
            return _loop(cfg, trainer, start, run_dir, rank0, stop, log)
    finally:
        log.close()


def _loop(cfg, trainer, start: int, run_dir: Path, rank0: bool, stop: _Interrupt,
          log: MetricsLog) -> dict:
    t0, total = time.perf_counter(), cfg.training.train_iters
    sft = cfg.rl.rl_warmup_sft_steps
    step, saved = start, None
    if start == 0:
        _eval(trainer, log, 0, rank0)  # the starting point of the reward curve
    for step in tqdm(range(start, total), disable=not rank0, desc="RL", initial=start,
                     total=total, file=sys.stderr):
        tic = time.perf_counter()
        m = trainer.sft_step(step) if step < sft else trainer.rl_step(step)
        m["step_ms"] = 1000 * (time.perf_counter() - tic)
        if step < sft:
            log.log({"kind": "sft", "step": step, **m})
            if rank0 and step % cfg.logging.log_interval == 0:
                tqdm.write(f"warm-up step {step:4d} | {m['step_ms']:.0f} ms/iter | "
                           f"answer NLL {m['loss']:.4f}")
        else:
            log.log({"kind": "train", "step": step, **m})
            if rank0 and step % cfg.logging.log_interval == 0:
                tqdm.write(_line(step, m))
        every = cfg.training.eval_interval
        if every and (step + 1) % every == 0 and step + 1 < total:
            _eval(trainer, log, step + 1, rank0)
        gc_every = cfg.training.manual_gc_interval
        if cfg.training.manual_gc and gc_every and (step + 1) % gc_every == 0:
            gc.collect()
        exiting = _exit_interval_reached(cfg, step + 1)
        if _maybe_save(cfg, trainer, step + 1, stop.requested or exiting, run_dir):
            saved = step + 1
        if stop.requested or exiting:
            if rank0:
                what = "checkpoint saved" if saved == step + 1 else "nothing saved (no --save)"
                why = "interrupted" if stop.requested else "exit_interval reached"
                print(f"{why}: {what} after step {step + 1}", flush=True)
            return {}
    final = _eval(trainer, log, total, rank0)
    if saved != total:  # not again: rewriting it would expose a complete checkpoint to a kill
        _maybe_save(cfg, trainer, total, True, run_dir)
    if rank0:
        _finish(cfg, log, run_dir, final, total - start, time.perf_counter() - t0)
    return final


def _exit_interval_reached(cfg, steps_done: int) -> bool:
    """True after a step that is a multiple of ``exit_interval`` (not the last one)."""
    every = cfg.training.exit_interval
    return bool(every) and steps_done % every == 0 and steps_done < cfg.training.train_iters


def _eval(trainer, log, step: int, rank0: bool) -> dict:
    trainer.use_loops_of(step, evaluation=True)
    e = trainer.evaluate()
    log.log({"kind": "eval", "step": step, **e})
    if rank0:
        loops = " ".join(f"{a:.2f}" for a in e["eval_per_loop"])
        tqdm.write(f"eval @ {step}: greedy reward {e['eval_reward']:.3f} (per loop: {loops})")
    return e


def _maybe_save(cfg, trainer, step: int, force: bool, run_dir: Path) -> bool:
    """Save after ``step`` when forced or at the interval; True when it saved. The checkpoint
    records the run directory, which a resumed run continues by default."""
    every = cfg.logging.save_interval
    if cfg.logging.save and (force or (every and step % every == 0)):
        trainer.use_configured_loops()  # the next step sets its curriculum loop count again
        save_checkpoint(cfg.logging.save, step, trainer.model, trainer.optimizer,
                        trainer.scheduler, reference=trainer.ref,
                        extra_meta={"run_dir": str(run_dir.resolve()),
                                    "tokenizer": trainer.tok.identity(), "config": to_dict(cfg)})
        return True
    return False


def _finish(cfg, log, run_dir, final, steps: int, seconds: float) -> None:
    if not cfg.logging.no_plot:
        records = read_records(log.path)  # the whole run, steps before a resume included
        png = plot_rewards(records, run_dir / "reward_curve.png")
        span = [r["step"] for r in records]
        print(f"reward curve: {png} (steps {min(span)}-{max(span)} of {log.path.name})")
    print(f"metrics: {run_dir / 'metrics.jsonl'}")
    print(f"final mean reward {final['eval_reward']:.3f} after {steps} steps in {seconds:.0f} s",
          flush=True)


def main(argv=None) -> None:
    """Parse the flags and train; every error propagates (see ``cli``)."""
    run(parse_args(argv))


def cli(argv=None) -> None:
    """``main`` for the command line: a user's error (``USER_ERRORS``) prints ``error: ...``
    on stderr, without a traceback, and exits with status 2."""
    try:
        main(argv)
    except USER_ERRORS as e:
        rank = os.environ.get("RANK") if os.environ.get("WORLD_SIZE", "1") != "1" else None
        print(f"error: {'' if rank is None else f'rank {rank}: '}{e}", file=sys.stderr,
              flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
