"""Checkpoints with MCore distributed checkpointing: model, (distributed) optimizer, LR
schedule, the step counter and the KL reference, plus the model's structure to refuse a
mismatched load.

Layout: ``<save>/iter_<step>/`` per checkpoint, ``<save>/latest`` naming the newest. A
checkpoint is verified before it is loaded: a missing, truncated or unreadable file is refused
with a ``CheckpointError`` naming the file, the iteration and the newest intact iteration (no
silent fall-back to an older one: ``--load <save>/iter_<step>`` resumes from a chosen one); an
iteration whose save did not finish (no ``.metadata``) is named incomplete.

Saves are synchronous and write in this process (``_in_process_write_results``): a SIGTERM to
the job's process group (torchrun, Slurm) reaches no helper process a save depends on.
"""

import contextlib
import queue
import shutil
from pathlib import Path
from typing import Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint import FileSystemReader

from ..mcore_compat import dist_checkpoint_files, mcore_workaround
from ..model.kv import config_signature

REFERENCE_PREFIX = "reference."
"""Key prefix of the KL reference's tensors in a checkpoint."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or does not fit this run (a user's error): the
    message names the checkpoint and what is wrong."""


_SIGNATURE_FIELDS = ("prelude layers", "core layers", "coda layers", "loops", "kv groups",
                     "kv channels", "hidden size", "vocab size")


def _model_signature(model) -> list:
    return [int(x) for x in config_signature(model.config)] + [int(model.vocab_size)]


def _structure_mismatch(ckpt: Path, meta: dict, model) -> list[str]:
    """'<what> <checkpoint's> != <this model's>' for every difference: the loop structure,
    else the name and shape of every model tensor."""
    diffs = [f"{name} {a} != {b}" for name, a, b in
             zip(_SIGNATURE_FIELDS, meta["signature"], _model_signature(model)) if a != b]
    return diffs or _tensor_mismatch(ckpt, model)


def _tensor_mismatch(ckpt: Path, model) -> list[str]:
    """'<key> <checkpoint's shape> != <this model's>' for every model tensor that differs in
    name or global shape (optimizer and KL-reference tensors aside)."""
    saved = {k: tuple(t.global_shape) for k, t in
             dist_checkpointing.load_tensors_metadata(str(ckpt)).items()
             if not k.startswith(("optimizer.", REFERENCE_PREFIX))}
    model_sd = model.sharded_state_dict()
    apply_factories(model_sd)  # e.g. SwiGLU's fc1: the [2 * ffn, H] tensor it is saved as
    mine = {t.key: tuple(t.global_shape) for t in nested_values(model_sd)
            if isinstance(t, ShardedTensor)}
    return [f"{k} {saved.get(k, 'absent')} != {mine.get(k, 'absent')}"
            for k in sorted(saved.keys() | mine.keys()) if saved.get(k) != mine.get(k)]


def _first_diffs(diffs: list[str]) -> str:
    """The first four differences, and how many there are when more."""
    more = f", ... ({len(diffs)} differences)" if len(diffs) > 4 else ""
    return ", ".join(diffs[:4]) + more


def _sharded_state(model, optimizer, is_loading: bool = False) -> dict:
    model_sd = model.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading,
                metadata={"distrib_optim_sharding_type": "dp_reshardable"})}


def _torch_adams(optimizer) -> list:
    """The torch Adam(W) optimizers inside a (chained) MCore optimizer."""
    inner = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [opt for opt in inner if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))]


@mcore_workaround
def _restore_adam_step(optimizer) -> None:
    """Set Adam's step count from the loaded param groups. MCore 0.16's dp_reshardable load
    sets it from them, then copies the loading template's step (0) over it (torch Adam keeps
    a per-parameter step; Apex/TE Adam does not), which restarts Adam's bias correction.
    Ledger row W3."""
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for p in group["params"]:
                if "step" in group and "step" in adam.state[p]:
                    adam.state[p]["step"] = torch.tensor(float(group["step"]))


@mcore_workaround
def _init_adam_state(optimizer) -> None:
    """Give a never-stepped torch Adam its state: step 0 and zero moments (the same next update
    as no state). MCore 0.16's DistributedOptimizer.state_dict(), which building the loading
    state dict calls, asserts on an empty state when Apex/TE are absent (torch optimizers).
    Ledger row W2."""
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for p in group["params"]:
                if not adam.state[p]:
                    adam.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}


@mcore_workaround
@contextlib.contextmanager
def _in_process_write_results():
    """While entered, MCore's torch_dist writer hands each save's results over through a queue
    in this process. MCore 0.16's ``filesystem_async`` keeps that queue in a
    ``multiprocessing.Manager`` server, a process it spawns at the first save; the server
    ignores SIGINT but not SIGTERM, so a SIGTERM to the process group (torchrun, Slurm) kills
    it and the next save (the one the signal asks for) fails with ``BrokenPipeError``, leaving
    a partial ``iter_<step>``. A synchronous save runs the writer in this process (its per-file
    workers are forked children that inherit this process's signal handlers), so the results
    never cross a process boundary. Ledger row W5."""
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def save_checkpoint(path, step: int, model, optimizer, scheduler, reference=None,
                    extra_meta: Optional[dict] = None, keep_last: int = 0) -> Path:
    """Write ``path/iter_<step>`` and point ``path/latest`` at it (rank 0 writes the pointer).
    ``reference``: the trainer's ``KLReference``, saved once taken; ``extra_meta``: more
    entries of the checkpoint's metadata (e.g. the run directory, ``tokenizer``: its identity,
    ``config``: the run's flat config; ``read_meta``); ``keep_last`` > 0: then delete all but
    the newest ``keep_last`` complete iterations (``prune_checkpoints``)."""
    root = Path(path)
    ckpt = root / f"iter_{step:07d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    state = _sharded_state(model, optimizer)
    state["meta"] = {"step": step, "scheduler": scheduler.state_dict(),
                     "signature": _model_signature(model), **(extra_meta or {})}
    if reference is not None and reference.taken_at is not None:
        state["reference"] = reference.module.sharded_state_dict(prefix=REFERENCE_PREFIX)
        state["meta"]["reference_taken_at"] = reference.taken_at
    with _in_process_write_results():
        dist_checkpointing.save(state, str(ckpt))
    if torch.distributed.get_rank() == 0:
        (root / "latest").write_text(ckpt.name)
        if keep_last:
            prune_checkpoints(root, keep_last)
    torch.distributed.barrier()
    return ckpt


def prune_checkpoints(root, keep_last: int) -> list[Path]:
    """Delete the complete ``iter_*`` directories under ``root`` but the newest ``keep_last``
    (never the one ``latest`` names; incomplete ones are left for inspection); returns the
    deleted ones."""
    root = Path(root)
    pointer = root / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else None
    complete = sorted(p for p in root.glob("iter_*") if p.is_dir() and _is_complete(p))
    doomed = [p for p in complete[:-keep_last] if p.name != named] if keep_last > 0 else []
    for old in doomed:
        shutil.rmtree(old)
    return doomed


def _is_complete(ckpt: Path) -> bool:
    """Whether the save of iteration directory ``ckpt`` finished (MCore writes ``.metadata``,
    then ``metadata.json``, last)."""
    return (ckpt / ".metadata").is_file() and (ckpt / "metadata.json").is_file()


def read_meta(path) -> dict:
    """The metadata of the checkpoint ``find_checkpoint(path)`` names (step, scheduler,
    signature and what ``save_checkpoint`` got as ``extra_meta``); needs no process group."""
    return checkpoint_meta(find_checkpoint(path))


def _check_tokenizer(ckpt: Path, meta: dict, tokenizer: Optional[dict]) -> None:
    saved = meta.get("tokenizer")
    if tokenizer is not None and saved is not None and saved != tokenizer:
        keys = sorted(saved.keys() | tokenizer.keys())
        diffs = [f"{k} {saved.get(k)!r} != {tokenizer.get(k)!r}"
                 for k in keys if saved.get(k) != tokenizer.get(k)]
        raise CheckpointError(f"checkpoint {ckpt} was saved with a different tokenizer "
                              f"(checkpoint != this run): {', '.join(diffs)}; set "
                              "--tokenizer-type / --tokenizer-model as in the run that saved it")


def check_tokenizer(path, tokenizer: dict) -> None:
    """Refuse the checkpoint at ``path`` (a ``save`` directory or an ``iter_*`` directory) when
    it was saved with another tokenizer than ``tokenizer`` (an identity)."""
    ckpt = checkpoint_dir(path)
    _check_tokenizer(ckpt, checkpoint_meta(ckpt), tokenizer)


def load_checkpoint(path, model, optimizer, scheduler, reference=None,
                    tokenizer: Optional[dict] = None) -> int:
    """Restore the checkpoint ``find_checkpoint(path)`` names; returns the step to continue
    from. ``reference``: the trainer's ``KLReference``, given the checkpoint's reference when
    it holds one (else left as it is); ``tokenizer``: this run's tokenizer identity, refused
    when the checkpoint's differs; ``scheduler``: None leaves the LR schedule out (generation),
    else ``restore_schedule``."""
    ckpt = find_checkpoint(path)
    meta = checkpoint_meta(ckpt)
    _check_tokenizer(ckpt, meta, tokenizer)
    diffs = _structure_mismatch(ckpt, meta, model)
    if diffs:
        raise CheckpointError(f"checkpoint {ckpt} was saved from a different model config "
                              f"(checkpoint != this run): {_first_diffs(diffs)}")
    _init_adam_state(optimizer)
    request = {**_sharded_state(model, optimizer, is_loading=True),
               **_reference_request(meta, reference)}
    state = dist_checkpointing.load(request, str(ckpt))
    with torch.no_grad():  # the optimizer copies into views of grad-requiring parameters
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    _restore_adam_step(optimizer)
    if scheduler is not None:
        restore_schedule(scheduler, meta["scheduler"], ckpt)
    _restore_reference(state, meta, reference)
    return int(meta["step"])


SCHEDULE_SHAPE = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                  "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")
"""The LR schedule's fields that a run's flags set (its position, ``num_steps``, is not one)."""


def restore_schedule(scheduler, saved: dict, ckpt) -> None:
    """Load the checkpoint's LR schedule ``saved`` into ``scheduler`` (MCore's
    ``OptimizerParamScheduler``): its position always; its shape only where it equals this
    run's, unless the scheduler overrides it (``--override-opt-param-scheduler``: this run's)
    or takes the checkpoint's (``--use-checkpoint-opt-param-scheduler``), as Megatron-LM."""
    if not (scheduler.override_opt_param_scheduler
            or scheduler.use_checkpoint_opt_param_scheduler):
        diffs = [f"{k}: {saved[k]!r} != {getattr(scheduler, k)!r}" for k in SCHEDULE_SHAPE
                 if k in saved and saved[k] != getattr(scheduler, k)]
        if diffs:
            raise CheckpointError(
                f"checkpoint {ckpt} was saved with another LR schedule (checkpoint != this "
                f"run): {'; '.join(diffs)}. Pass --override-opt-param-scheduler true for this "
                f"run's schedule, --use-checkpoint-opt-param-scheduler true for the "
                f"checkpoint's, or the checkpoint run's lr / min_lr / warm-up / train_iters / "
                f"lr_decay_iters flags")
    scheduler.load_state_dict(saved)


def _reference_request(meta: dict, reference) -> dict:
    """``{"reference": its sharded state dict}`` when the checkpoint holds a KL reference and
    the run has one to give it to, else ``{}``."""
    if reference is None or meta.get("reference_taken_at") is None:
        return {}
    return {"reference": reference.module.sharded_state_dict(prefix=REFERENCE_PREFIX)}


def _restore_reference(state: dict, meta: dict, reference) -> None:
    """Give the loaded reference tensors (if requested) to the run's ``KLReference``."""
    if "reference" in state:
        n = len(REFERENCE_PREFIX)
        reference.load({k[n:]: v for k, v in state["reference"].items()},
                       meta["reference_taken_at"])


# ---- finding and verifying a checkpoint -------------------------------------------------------


def find_checkpoint(path) -> Path:
    """The iteration directory to resume from, verified: ``path`` itself when it is one
    (``<save>/iter_<step>``), else the one ``path/latest`` names. Raises ``CheckpointError``
    when there is none, or when it is damaged (naming the file, the iteration and the newest
    intact iteration beside it)."""
    path = Path(path)
    if (path / "metadata.json").is_file():
        ckpt = path
    elif _is_iteration(path):
        raise CheckpointError(f"checkpoint iteration {_iteration(path)} ({path}) is incomplete: "
                              f"it has no .metadata (its save did not finish); refusing to resume "
                              f"from it. {_intact_hint(path)}")
    else:
        pointer = path / "latest"
        if not pointer.is_file():
            what = "does not exist" if not path.exists() else f"has no {pointer.name} file"
            if any(_is_iteration(p) for p in path.glob("iter_*")):
                what += f" (no save finished). {_intact_hint(pointer, root=path)}"
            raise CheckpointError(f"no checkpoint to load: {path} {what}")
        ckpt = path / pointer.read_text().strip()
    problem = checkpoint_problem(ckpt)
    if problem:
        raise CheckpointError(f"checkpoint iteration {_iteration(ckpt)} ({ckpt}) is damaged: "
                              f"{problem}; refusing to resume from it. {_intact_hint(ckpt)}")
    return ckpt


def checkpoint_meta(ckpt) -> dict:
    """The metadata dict saved with iteration directory ``ckpt`` (step, scheduler, ...)."""
    return dist_checkpointing.load_common_state_dict(str(ckpt))["meta"]


def checkpoint_problem(ckpt) -> str | None:
    """What is wrong with iteration directory ``ckpt`` (the first missing, truncated or
    unreadable file), or None when every file its index lists is there in full."""
    ckpt = Path(ckpt)
    files = dist_checkpoint_files()  # per MCore version: 0.19 has no common.pt
    for name in files:
        if not (ckpt / name).is_file():
            return f"{ckpt / name} is missing"
    try:
        storage = FileSystemReader(str(ckpt)).read_metadata().storage_data
    except Exception as e:
        return f"{ckpt / '.metadata'} is unreadable ({type(e).__name__}: {e})"
    needed = {}  # file -> bytes its index needs
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        shard = ckpt / name
        if not shard.is_file():
            return f"{shard} is missing"
        if shard.stat().st_size < size:
            return (f"{shard} is truncated ({shard.stat().st_size} bytes; the checkpoint's "
                    f"index needs {size})")
    try:
        checkpoint_meta(ckpt)
    except Exception as e:  # any failure to read it is the finding
        where = ckpt / "common.pt" if "common.pt" in files else f"the common state in {ckpt}"
        return f"{where} is unreadable ({type(e).__name__}: {e})"
    return None


def _is_iteration(path: Path) -> bool:
    """Whether ``path`` is an ``iter_<step>`` directory (complete or not)."""
    return path.is_dir() and path.name.startswith("iter_") and path.name[5:].isdigit()


def _iteration(ckpt: Path) -> str:
    """The step of ``iter_<step>``, as written in messages."""
    digits = ckpt.name.removeprefix("iter_")
    return str(int(digits)) if digits.isdigit() else ckpt.name


def _intact_hint(ckpt: Path, root: Optional[Path] = None) -> str:
    """Where to resume from instead: the newest intact iteration beside ``ckpt`` (or under
    ``root``)."""
    root = ckpt.parent if root is None else root
    others = sorted((p for p in root.glob("iter_*") if p != ckpt and p.is_dir()), reverse=True)
    for other in others:
        if checkpoint_problem(other) is None:
            return (f"The newest intact iteration is {_iteration(other)}: resume from it with "
                    f"--load {other}")
    return f"No intact iteration under {root}."


# ---- weights only: --pretrained-checkpoint (one of ours), --finetune, --no-load-optim ------


def has_checkpoint(path) -> bool:
    """True when ``path`` is a ``save`` directory holding a checkpoint (``latest``) or one of
    its ``iter_*`` directories (a checkpoint beside a ``latest`` pointer)."""
    if path is None:
        return False
    root = Path(path)
    return (root / "latest").is_file() or ((root / "metadata.json").is_file()
                                           and (root.parent / "latest").is_file())


def checkpoint_dir(path) -> Path:
    """A ``save`` directory -> its latest ``iter_*``, verified (``find_checkpoint``); any other
    directory -> itself."""
    return find_checkpoint(path) if has_checkpoint(path) else Path(path)


def is_own_checkpoint(path) -> bool:
    """True for a checkpoint written by ``save_checkpoint`` (its common state has ``meta``)."""
    ckpt = checkpoint_dir(path)
    if not (ckpt / "metadata.json").is_file():
        return False
    return "meta" in dist_checkpointing.load_common_state_dict(str(ckpt))


def load_model_weights(path, model) -> Path:
    """Only the model weights of a checkpoint of ours (any loop count); returns its
    directory. Tensors that differ in name or shape are named."""
    ckpt = checkpoint_dir(path)
    diffs = _tensor_mismatch(ckpt, model)
    if diffs:
        raise CheckpointError(f"checkpoint {ckpt} holds weights of a different model (checkpoint "
                              f"!= this run): {_first_diffs(diffs)}")
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    with torch.no_grad():
        model.load_state_dict(state["model"])
    return ckpt


def load_step(path, reference=None) -> int:
    """The step of the latest checkpoint under ``path`` (no optimizer, no LR schedule, no
    weights), and its KL reference when it holds one and ``reference`` is given."""
    ckpt = checkpoint_dir(path)
    meta = checkpoint_meta(ckpt)
    request = _reference_request(meta, reference)
    if request:
        _restore_reference(dist_checkpointing.load(request, str(ckpt)), meta, reference)
    return int(meta["step"])
