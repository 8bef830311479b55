"""Starting from weights, the Megatron way.

- ``--pretrained-checkpoint DIR`` (weights only): a Hugging Face Llama / Qwen2 directory, a
  public looped checkpoint in its own format (Ouro, ``model/looped_import.py``), a
  stock MCore ``GPTModel`` distributed checkpoint or a ``--save`` directory of this trainer,
  loaded into the freshly built model before MCore DDP and the optimizer copy its parameters.
  The run's flags describe the architecture; a source that differs is refused, naming what
  differs (``--use-checkpoint-args`` takes it from a Hugging Face config.json instead).
- ``--looped-retrofit p,c,d``: the source's layers as prelude / core / coda (the rest dropped).
- ``--load DIR``: resume when it holds a checkpoint (weights, optimizer, LR schedule, step, KL
  reference, run directory; verified first, a damaged one is refused naming the file);
  ``--finetune`` loads its weights only at step 0, ``--no-load-optim`` everything but the
  optimizer state.
"""

import dataclasses
import re
from pathlib import Path

from ..model.hf_import import (
    PretrainedArchitecture,
    load_hf_state_dict,
    read_hf_architecture,
)
from ..model.looped_import import (
    LoopedSource,
    is_looped_source,
    load_looped_state_dict,
    read_looped_source,
)
from ..model.mcore_import import is_dist_checkpoint, load_mcore_gpt_state_dict, source_layers
from ..model.retrofit import LayerMapping, load_converted_state_dict, retrofit_state_dict
from ..model.vocab_parallel import padded_vocab_size
from .checkpoint import (
    CheckpointError,
    check_tokenizer,
    find_checkpoint,
    has_checkpoint,
    is_own_checkpoint,
    load_checkpoint,
    load_model_weights,
    load_step,
)
from .config import ConfigError, tokenizer_args, tokenizer_from
from .runtime import scheduled_steps

ARCHITECTURE_KEYS = tuple(f.name for f in dataclasses.fields(PretrainedArchitecture)
                          if f.name != "num_layers")
"""Model flags a pretrained source fixes (besides the layer count)."""


def run_vocab_size(cfg) -> int:
    """Embedding rows: ``vocab_size`` as set, else the tokenizer's padded as Megatron pads it
    (to a multiple of ``make_vocab_size_divisible_by`` x ``tensor_model_parallel_size``)."""
    m = cfg.model
    if m.vocab_size is not None:
        return m.vocab_size
    return padded_vocab_size(tokenizer_from(cfg).vocab_size, m.make_vocab_size_divisible_by,
                             m.tensor_model_parallel_size)


def source_kind(path) -> str:
    """``hf``, ``own`` (a checkpoint of this trainer) or ``mcore`` (a GPTModel checkpoint)."""
    root = Path(path)
    if (root / "config.json").is_file():
        return "hf"
    if has_checkpoint(root) or is_own_checkpoint(root):
        return "own"
    if is_dist_checkpoint(root):
        return "mcore"
    raise FileNotFoundError(
        f"pretrained checkpoint {path} is neither a Hugging Face directory (config.json), an "
        f"MCore distributed checkpoint (metadata.json) nor a save directory (latest)")


# ---- before validation: flags the source sets ---------------------------------------------


def resolve_pretrained(cfg) -> list[str]:
    """Apply ``--use-checkpoint-args`` and ``--looped-retrofit`` to ``cfg.model`` and resolve
    the tokenizer flags (in place); returns lines for the log."""
    m, path = cfg.model, cfg.logging.pretrained_checkpoint
    lines = _resolve_tokenizer(cfg)
    if path is None:
        return lines
    if cfg.logging.use_checkpoint_args:
        if source_kind(path) != "hf":
            raise ConfigError(f"use_checkpoint_args needs a Hugging Face directory "
                              f"(config.json); {path} has none")
        looped = read_looped_source(path) if is_looped_source(path) else None
        if looped is not None and m.looped_retrofit:
            raise ConfigError(
                f"looped_retrofit {m.looped_retrofit!r} conflicts with --use-checkpoint-args: "
                f"{path} is a looped {looped.model_type} checkpoint, whose loop layout "
                f"--use-checkpoint-args takes from its config.json (its layers map one to one; "
                f"looped_retrofit maps a plain stack's); set looped_retrofit null "
                f"(--looped-retrofit null)")
        arch = read_hf_architecture(path) if looped is None else looped.arch
        for key in ARCHITECTURE_KEYS:
            setattr(m, key, getattr(arch, key))
        layout = None if looped is None else _take_loop_layout(cfg, looped)
        m.num_layers = arch.num_layers - m.looped_num_prelude_layers - m.looped_num_coda_layers
        lines.append(f"architecture from {Path(path) / 'config.json'}: {arch}")
        if layout is not None:
            lines.append(layout)
    if m.looped_retrofit and re.fullmatch(r"\d+,\d+,\d+", m.looped_retrofit):  # else: validate
        prelude, core, coda = (int(x) for x in m.looped_retrofit.split(","))
        m.looped_num_prelude_layers, m.num_layers, m.looped_num_coda_layers = prelude, core, coda
        m.looped_injection = "linear_concat"
    return lines


def _take_loop_layout(cfg, source: LoopedSource) -> str:
    """``--use-checkpoint-args`` of a looped source: its loop layout, loop count, maximum
    positions (unless the run's are more, as Megatron-LM keeps a given
    ``--max-position-embeddings``: rotary positions have no table to match), exit threshold
    (Ouro), truncated backprop and Poisson-lognormal loop sampling (Huginn's training) become
    the run's; a line for the log."""
    taken = {**source.looped, "looped_num_loops": source.num_loops}
    if source.backprop_loops:  # Huginn's training: sampled loop counts, truncated backprop
        taken.update(looped_backprop_loops=source.backprop_loops,
                     looped_num_loops_sampling="poisson_lognormal")
    if (source.max_sequence_length or 0) >= cfg.model.max_position_embeddings:
        taken["max_position_embeddings"] = source.max_sequence_length
    for key, value in taken.items():
        setattr(cfg.model, key, value)
    if source.exit_threshold is not None:
        cfg.rl.rl_exit_threshold = taken["rl_exit_threshold"] = source.exit_threshold
    kept = ("" if "max_position_embeddings" in taken or not source.max_sequence_length else
            f"; the run's max_position_embeddings {cfg.model.max_position_embeddings} kept "
            f"(the source's {source.max_sequence_length}: longer rows are beyond its training)")
    return f"loop layout from {source.model_type}: " + ", ".join(
        f"{k} {v}" for k, v in taken.items()) + kept


def _resolve_tokenizer(cfg) -> list[str]:
    """Write the run's tokenizer flags into ``cfg`` (as the resolved config and checkpoints
    record them): unset, a Hugging Face checkpoint's tokenizer.json."""
    t = cfg.tokenizer
    given = (t.tokenizer_type, t.tokenizer_model)
    t.tokenizer_type, t.tokenizer_model = tokenizer_args(cfg)
    if given[1] is not None or t.tokenizer_model is None:
        return []
    return [f"tokenizer: {t.tokenizer_type} {t.tokenizer_model} (of the pretrained checkpoint)"]


# ---- before DDP: weights -------------------------------------------------------------------


def load_before_wrap(cfg, model) -> list[str]:
    """Pretrained weights, then (``--finetune`` / ``--no-load-optim``) the ``--load``
    checkpoint's weights; returns lines for the log."""
    lines = []
    if cfg.logging.pretrained_checkpoint:
        lines.append(load_pretrained(cfg, model))
    lg = cfg.logging
    if has_checkpoint(lg.load) and (lg.finetune or lg.no_load_optim):
        check_tokenizer(lg.load, tokenizer_from(cfg).identity())
        lines.append(f"weights from {load_model_weights(lg.load, model)}")
    return lines


def load_pretrained(cfg, model) -> str:
    """Load ``cfg.logging.pretrained_checkpoint`` into ``model``; a line for the log."""
    path = cfg.logging.pretrained_checkpoint
    kind = source_kind(path)
    if kind == "own":
        if cfg.model.looped_retrofit:
            raise ConfigError(f"looped_retrofit maps a plain stack's layers; {path} is already "
                              f"a looped model")
        check_tokenizer(path, tokenizer_from(cfg).identity())
        return f"pretrained weights from {load_model_weights(path, model)}"
    if kind == "hf" and is_looped_source(path):
        return _load_looped(cfg, model, path)
    if kind == "hf":
        arch = read_hf_architecture(path)
        _check_architecture(cfg, arch, path)
        mapping = _mapping(cfg, arch.num_layers, path)
        weights = load_hf_state_dict(path, arch)
    else:
        mapping = _mapping(cfg, source_layers(path), path)
        weights = load_mcore_gpt_state_dict(path, model)
    load_converted_state_dict(model, retrofit_state_dict(weights, mapping))
    return (f"pretrained weights from {path} ({'Hugging Face' if kind == 'hf' else 'MCore'}, "
            f"vocabulary {model.vocab_size}): {mapping.describe()}")


def _load_looped(cfg, model, path) -> str:
    """A public looped checkpoint (Ouro, Huginn): the run must have its architecture and loop
    layout (any loop count and initial state); its layers map one to one (no retrofit)."""
    source, m = read_looped_source(path), cfg.model
    _check_architecture(cfg, source.arch, path)
    fixed = {k: v for k, v in source.looped.items()  # the initial state is a choice
             if not k.startswith("looped_initial_state")}
    diffs = [f"{k}: checkpoint {v!r} != run {getattr(m, k)!r}" for k, v in fixed.items()
             if getattr(m, k) != v]
    core = source.core_layers or source.arch.num_layers
    if m.looped_retrofit or m.num_layers != core:
        diffs.append(f"num_layers: checkpoint {core} != run {m.num_layers} (a looped "
                     f"checkpoint's layers map one to one; no looped_retrofit)")
    if diffs:
        raise ConfigError(f"pretrained checkpoint {path} ({source.model_type}) has another "
                          f"model than this run ({'; '.join(diffs)}): set those flags, or pass "
                          f"--use-checkpoint-args")
    load_converted_state_dict(model, load_looped_state_dict(path, source))
    return (f"pretrained weights from {path} ({source.model_type}, vocabulary "
            f"{model.vocab_size}): {m.looped_num_prelude_layers} prelude, {core} core layers "
            f"looped {m.looped_num_loops} times (checkpoint: {source.num_loops}), "
            f"{m.looped_num_coda_layers} coda")


def run_architecture(cfg) -> dict:
    """The run's values of ``ARCHITECTURE_KEYS``, defaults resolved as the model builds them."""
    m = cfg.model
    values = {k: getattr(m, k) for k in ARCHITECTURE_KEYS}
    values.update(
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        num_query_groups=m.num_query_groups or m.num_attention_heads,
        kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads,
        vocab_size=run_vocab_size(cfg),
    )
    return values


def _check_architecture(cfg, arch: PretrainedArchitecture, path) -> None:
    run = run_architecture(cfg)
    keys = [k for k in ARCHITECTURE_KEYS if k != "rope_scaling_factor" or arch.use_rope_scaling]
    diffs = [f"{k}: checkpoint {getattr(arch, k)!r} != run {run[k]!r}" for k in keys
             if getattr(arch, k) != run[k]]
    if diffs:
        raise ConfigError(f"pretrained checkpoint {path} has another architecture than this run "
                          f"({'; '.join(diffs)}): set those flags, or pass "
                          f"--use-checkpoint-args to take them from its config.json")


def _mapping(cfg, layers: int, path) -> LayerMapping:
    m = cfg.model
    used = m.looped_num_prelude_layers + m.num_layers + m.looped_num_coda_layers
    if not m.looped_retrofit and used != layers:
        raise ConfigError(
            f"num_layers: pretrained checkpoint {path} has {layers} layers, this run "
            f"{used} (prelude {m.looped_num_prelude_layers} + core {m.num_layers} + coda "
            f"{m.looped_num_coda_layers}); set the layer counts or --looped-retrofit")
    try:
        return LayerMapping.of_config(m, layers)  # ModelArgs has the config's field names
    except ValueError as e:
        raise ConfigError(f"looped_retrofit {m.looped_retrofit}: {e}") from e


# ---- after DDP: resume ---------------------------------------------------------------------


def resume_checkpoint(cfg):
    """The verified ``--load`` checkpoint this run continues (its step, LR schedule, KL
    reference and run directory), or None: no ``--load``, ``--finetune`` (weights only, step 0),
    or a ``--load`` without a checkpoint beside ``--pretrained-checkpoint`` (Megatron: start
    from the pretrained weights). A missing or damaged checkpoint is a ``CheckpointError``
    naming it."""
    lg = cfg.logging
    if not lg.load or (lg.pretrained_checkpoint and not has_checkpoint(lg.load)):
        return None
    if lg.finetune and has_checkpoint(lg.load):
        return None
    return find_checkpoint(lg.load)


def resume_after_wrap(cfg, trainer, ckpt) -> int:
    """The step to start from: 0 without ``ckpt``; else the checkpoint's step, LR schedule and
    KL reference, with its optimizer state unless ``--no-load-optim``. Past the warm-up, a run
    with a KL penalty needs the checkpoint's reference."""
    if ckpt is None:
        return 0
    if cfg.logging.no_load_optim:  # its tokenizer checked with its weights (load_before_wrap)
        start = load_step(ckpt, reference=trainer.ref)
        trainer.scheduler.step(increment=scheduled_steps(cfg, start))  # this run's schedule
    else:
        start = load_checkpoint(ckpt, trainer.model, trainer.optimizer, trainer.scheduler,
                                reference=trainer.ref, tokenizer=trainer.tok.identity())
    if trainer.ref is not None and trainer.ref.taken_at is None \
            and start > cfg.rl.rl_warmup_sft_steps:
        raise CheckpointError(
            f"checkpoint {ckpt} (step {start}, past the warm-up) holds no KL reference (saved "
            f"with grpo_kl_beta 0): the reference must be the policy at the start of RL; resume "
            f"with --grpo-kl-beta 0, or from a checkpoint of a run with a KL penalty")
    return start
