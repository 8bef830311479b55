"""Main job: ``python -m scalerlt_mcore.train [--config X.yaml] [--flag value ...]``.

One process, or ``torchrun --nproc-per-node N`` for N ranks: N / tensor_model_parallel_size
data-parallel ranks (MCore DDP + distributed optimizer), each a group of tensor-parallel
ranks. Without ``--config`` the packaged tiny CPU demo config is used.

From the command line (``cli``), errors a user causes (flags, config file, ``--load``,
``--save``, ``--run-dir``) print one line, ``error: ...``, and exit with status 2; any other
error keeps its traceback.

SIGINT / SIGTERM (to the process or its whole process group: what torchrun forwards and Slurm
sends) end the run after the current step with a checkpoint (with ``--save``) and status 0;
the ranks agree after every step on whether one of them got the signal, so they all stop after
the same step.
"""

import contextlib
import gc
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from tqdm import tqdm

from ..mcore_compat import fallback_note
from .checkpoint import CheckpointError, checkpoint_meta, save_checkpoint
from .config import ConfigError, parse_args, save_resolved, to_dict, validate
from .metrics import MetricsLog, check_wandb, plot_rewards, read_records, wandb_settings
from .plan import HEADROOM
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

USER_ERRORS = (ConfigError, CheckpointError, FileNotFoundError)
"""Errors a user causes (a bad flag or config, a checkpoint that is missing, damaged or does
not fit, a file a flag names that is not there): ``cli`` prints their message alone, without a
traceback."""

LIBRARY_WARNINGS = (
    (UserWarning, r"full scope is deprecated", r"megatron\.core\."),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf", r"megatron\.core\."),
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated", r"torch\.distributed\."),
    (FutureWarning, r".", r"megatron\.core\."),
    (DeprecationWarning, r".", r"megatron\.core\."),
    (UserWarning, r"MimoModelConfig is experimental", r"megatron\.core\.models\.mimo\."),
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized, assuming the "
                  r"intent is to load in a single process", r"torch\.distributed\.checkpoint\."),
)
"""(category, message, module) of the warnings MCore and torch raise from their own code on
every run (a deprecated config default, MCore's use of deprecated torch collectives and
checkpoint calls, MCore's optimizer reading ``.grad`` of non-leaf views; MCore 0.19 also
imports its experimental multimodal config, which warns, when building an optimizer, and reads
a checkpoint's common state with ``torch.distributed.checkpoint.load(no_dist=True)``, which
warns on every call): nothing a user can act on. Only these are silenced
(``quiet_library_warnings``); the project's own warnings and any other library's still show."""


def quiet_library_warnings() -> None:
    """Ignore ``LIBRARY_WARNINGS`` from here on (each filter bound to the module it names)."""
    for category, message, module in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


class _Interrupt:
    """While entered, SIGINT/SIGTERM set a flag; the loop saves a checkpoint after the current
    step. The previous handlers are restored on exit. ``agreed`` tells every rank whether any
    rank has got a signal."""

    def __init__(self, device: str = "cpu"):
        self.requested, self._previous, self._device = False, {}, device

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self) -> bool:
        """Whether any rank has got a signal (a collective: every rank calls it after every
        step). A signal reaches the ranks at different moments; they stop together."""
        if dist.get_world_size() == 1:
            return self.requested
        flag = torch.tensor([int(self.requested)], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.requested = bool(flag.item())
        return self.requested


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
    quiet_library_warnings()
    check_wandb(cfg)
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
    if rank0 and trainer.default_budget is not None:
        print(f"shared-prefix memory budget: {trainer.default_budget / 2**20:.0f} MiB per group "
              f"({HEADROOM:.0%} of what {device} has left beside the model state)", flush=True)
    start = resume_after_wrap(cfg, trainer, resume)
    if rank0 and resume is not None:
        print(f"loaded {resume}, resuming at step {start}", flush=True)
    log = MetricsLog(run_dir, enabled=rank0, start=start,
                     tensorboard_dir=cfg.logging.tensorboard_dir, wandb=wandb_settings(cfg))
    if log.dropped:
        print(f"{log.path}: dropped {log.dropped} records from step {start} on (written again "
              f"by this run)", flush=True)
    try:
        manual_gc = gc_paused() if cfg.training.manual_gc else contextlib.nullcontext()
        with _Interrupt(device) as stop, manual_gc:
            return _loop(cfg, trainer, start, run_dir, rank0, stop, log)
    finally:
        log.close()
        if trainer.engine is not None and rank0:
            trainer.engine.stop()


def _loop(cfg, trainer, start: int, run_dir: Path, rank0: bool, stop: _Interrupt,
          log: MetricsLog) -> dict:
    t0, total = time.perf_counter(), cfg.training.train_iters
    sft = cfg.rl.rl_warmup_sft_steps
    step, saved = start, None
    if start == 0:
        _eval(trainer, log, 0, rank0)  # the starting point of the reward curve
    _publish(trainer, start, rank0)
    bar = progress_bar(start, total, sft, enabled=rank0)
    for step in range(start, total):
        if step == sft:
            bar.set_description("RL")
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
        _publish(trainer, step + 1, rank0)
        every = cfg.training.eval_interval
        if every and (step + 1) % every == 0 and step + 1 < total:
            _eval(trainer, log, step + 1, rank0)
        gc_every = cfg.training.manual_gc_interval
        if cfg.training.manual_gc and gc_every and (step + 1) % gc_every == 0:
            gc.collect()
        bar.update()
        exiting, interrupted = _exit_interval_reached(cfg, step + 1), stop.agreed()
        if _maybe_save(cfg, trainer, step + 1, interrupted or exiting, run_dir, rank0):
            saved = step + 1
        if interrupted or exiting:
            bar.close()
            if rank0:
                what = "checkpoint saved" if saved == step + 1 else "nothing saved (no --save)"
                why = "interrupted" if interrupted else "exit_interval reached"
                print(f"{why}: {what} after step {step + 1}", flush=True)
            return {}
    bar.close()
    final = _eval(trainer, log, total, rank0)
    if saved != total:  # not again: rewriting it would expose a complete checkpoint to a kill
        _maybe_save(cfg, trainer, total, True, run_dir, rank0)
    if rank0:
        _finish(cfg, log, run_dir, final, total - start, time.perf_counter() - t0)
    return final


def _publish(trainer, step: int, rank0: bool) -> None:
    """The policy after ``step`` steps to ``rl_publish_dir`` (a log line on rank 0)."""
    version = trainer.publish()
    if rank0 and version is not None:
        tqdm.write(f"published weight version {version} (after step {step}) to "
                   f"{trainer.publisher.root}")


def progress_bar(start: int, total: int, sft: int, enabled: bool, stream=None) -> tqdm:
    """A tqdm bar over the steps on ``stream`` (stderr), drawn only when ``enabled`` (rank 0)
    and the stream is a terminal: written to a file (nohup, Slurm) a bar would interleave with
    every log line, which then say the same. Described ``warm-up`` until step ``sft``, then
    ``RL``."""
    stream = sys.stderr if stream is None else stream
    drawn = enabled and hasattr(stream, "isatty") and stream.isatty()
    return tqdm(total=total, initial=start, disable=not drawn, file=stream,
                desc="warm-up" if start < sft else "RL")


def _exit_interval_reached(cfg, steps_done: int) -> bool:
    """True after a step that is a multiple of ``exit_interval`` (not the last one)."""
    every = cfg.training.exit_interval
    return bool(every) and steps_done % every == 0 and steps_done < cfg.training.train_iters


def _eval(trainer, log, step: int, rank0: bool) -> dict:
    e = trainer.evaluate(trainer.start_step(step, evaluation=True))
    log.log({"kind": "eval", "step": step, **e})
    if rank0:
        loops = " ".join(f"{a:.2f}" for a in e["eval_per_loop"])
        tqdm.write(f"eval @ {step}: greedy reward {e['eval_reward']:.3f} (per loop: {loops})")
    return e


def _maybe_save(cfg, trainer, step: int, force: bool, run_dir: Path, rank0: bool) -> bool:
    """Save after ``step`` when forced or at the interval (one log line); True when it saved.
    The checkpoint records the run directory, which a resumed run continues by default."""
    lg = cfg.logging
    if lg.save and (force or (lg.save_interval and step % lg.save_interval == 0)):
        tic = time.perf_counter()
        save_checkpoint(lg.save, step, trainer.model, trainer.optimizer,
                        trainer.scheduler, reference=trainer.ref,
                        extra_meta={"run_dir": str(run_dir.resolve()),
                                    "tokenizer": trainer.tok.identity(), "config": to_dict(cfg)},
                        keep_last=lg.save_keep_last)
        if rank0:
            tqdm.write(f"saved checkpoint iter {step} to {lg.save} in "
                       f"{time.perf_counter() - tic:.1f} s")
            sys.stdout.flush()
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
        exit_with_error(e)


def exit_with_error(error: Exception) -> None:
    """Print ``error: <message>`` as one line on stderr (a list of problems joined with
    '; '), naming the rank in a job of several, and exit with status 2."""
    rank = os.environ.get("RANK") if os.environ.get("WORLD_SIZE", "1") != "1" else None
    print(f"error: {'' if rank is None else f'rank {rank}: '}{one_line(str(error))}",
          file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def one_line(message: str) -> str:
    """``message`` on one line: 'head:' + indented lines -> 'head: a; b'."""
    head, *rest = [line.strip() for line in message.splitlines() if line.strip()] or [""]
    if not rest:
        return head
    return f"{head} {'; '.join(rest)}" if head.endswith(":") else "; ".join([head, *rest])


if __name__ == "__main__":
    cli()
