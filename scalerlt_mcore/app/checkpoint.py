"""Checkpoints with MCore distributed checkpointing: model, (distributed) optimizer, LR
schedule and the step counter, plus the model's structure to refuse a mismatched load."""

from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

from ..mcore_compat import mcore_workaround
from ..model.kv import config_signature

_SIGNATURE_FIELDS = ("prelude layers", "core layers", "coda layers", "loops", "kv groups",
                     "kv channels", "hidden size", "vocab size")


def _model_signature(model) -> list:
    return [int(x) for x in config_signature(model.config)] + [int(model.vocab_size)]


def _structure_mismatch(ckpt: Path, meta: dict, model) -> list[str]:
    """'<what> <checkpoint's> != <this model's>' for every difference: the loop structure,
    else the name and shape of every model tensor."""
    diffs = [f"{name} {a} != {b}" for name, a, b in
             zip(_SIGNATURE_FIELDS, meta["signature"], _model_signature(model)) if a != b]
    if diffs:
        return diffs
    saved = {k: tuple(t.global_shape) for k, t in
             dist_checkpointing.load_tensors_metadata(str(ckpt)).items()
             if not k.startswith("optimizer.")}
    model_sd = model.sharded_state_dict()
    apply_factories(model_sd)  # e.g. SwiGLU's fc1: the [2 * ffn, H] tensor it is saved as
    mine = {t.key: tuple(t.global_shape) for t in nested_values(model_sd)
            if isinstance(t, ShardedTensor)}
    return [f"{k} {saved.get(k, 'absent')} != {mine.get(k, 'absent')}"
            for k in sorted(saved.keys() | mine.keys()) if saved.get(k) != mine.get(k)]


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


def save_checkpoint(path, step: int, model, optimizer, scheduler) -> Path:
    """Write ``path/iter_<step>`` and point ``path/latest`` at it (rank 0 writes the pointer)."""
    root = Path(path)
    ckpt = root / f"iter_{step:07d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    state = _sharded_state(model, optimizer)
    state["meta"] = {"step": step, "scheduler": scheduler.state_dict(),
                     "signature": _model_signature(model)}
    dist_checkpointing.save(state, str(ckpt))
    if torch.distributed.get_rank() == 0:
        (root / "latest").write_text(ckpt.name)
    torch.distributed.barrier()
    return ckpt


def load_checkpoint(path, model, optimizer, scheduler) -> int:
    """Restore the latest checkpoint under ``path``; returns the step to continue from."""
    root = Path(path)
    pointer = root / "latest"
    if not pointer.exists():
        raise FileNotFoundError(f"no checkpoint under {root} (missing {pointer})")
    ckpt = root / pointer.read_text().strip()
    meta = dist_checkpointing.load_common_state_dict(str(ckpt))["meta"]
    diffs = _structure_mismatch(ckpt, meta, model)
    if diffs:
        more = f", ... ({len(diffs)} differences)" if len(diffs) > 4 else ""
        raise ValueError(f"checkpoint {ckpt} was saved from a different model config "
                         f"(checkpoint != this run): {', '.join(diffs[:4])}{more}")
    _init_adam_state(optimizer)
    state = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(ckpt))
    with torch.no_grad():  # the optimizer copies into views of grad-requiring parameters
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    _restore_adam_step(optimizer)
    scheduler.load_state_dict(meta["scheduler"])
    return int(meta["step"])


# ---- weights only: --pretrained-checkpoint (one of ours), --finetune, --no-load-optim ------


def has_checkpoint(path) -> bool:
    """True when ``path`` is a ``save`` directory holding a checkpoint (``latest``)."""
    return path is not None and (Path(path) / "latest").is_file()


def checkpoint_dir(path) -> Path:
    """A ``save`` directory -> its latest ``iter_*``; an ``iter_*`` directory -> itself."""
    root = Path(path)
    return root / (root / "latest").read_text().strip() if has_checkpoint(root) else root


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
    saved = {k: tuple(t.global_shape) for k, t in
             dist_checkpointing.load_tensors_metadata(str(ckpt)).items()
             if not k.startswith("optimizer.")}
    model_sd = model.sharded_state_dict()
    apply_factories(model_sd)  # e.g. SwiGLU's fc1: the [2 * ffn, H] tensor it is saved as
    mine = {t.key: tuple(t.global_shape) for t in nested_values(model_sd)
            if isinstance(t, ShardedTensor)}
    diffs = [f"{k} {saved.get(k, 'absent')} != {mine.get(k, 'absent')}"
             for k in sorted(saved.keys() | mine.keys()) if saved.get(k) != mine.get(k)]
    if diffs:
        more = f", ... ({len(diffs)} differences)" if len(diffs) > 4 else ""
        raise ValueError(f"checkpoint {ckpt} holds weights of a different model (checkpoint "
                         f"!= this run): {', '.join(diffs[:4])}{more}")
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    with torch.no_grad():
        model.load_state_dict(state["model"])
    return ckpt


def load_step_and_schedule(path, scheduler) -> int:
    """The step and LR schedule of the latest checkpoint under ``path`` (no optimizer)."""
    meta = dist_checkpointing.load_common_state_dict(str(checkpoint_dir(path)))["meta"]
    scheduler.load_state_dict(meta["scheduler"])
    return int(meta["step"])
