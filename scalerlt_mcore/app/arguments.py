"""Run configuration: dataclasses, a flat YAML file, command-line overrides, one validate.

Precedence: dataclass defaults < YAML file < command line. Without ``--config`` the YAML
file is the packaged demo (``scalerlt_mcore/configs/demo_cpu.yaml``, a tiny CPU run).

Layout: the YAML file is **flat**, one Megatron-style key per line (``num_layers: 2``), the
same names as the command-line flags (``--num-layers 2``). Keys are unique across the
sections of ``RunConfig`` (``model``, ``training``, ``shared_prefix``, ``rl``, ``tokenizer``,
``logging``), which exist only in Python; a grouped file (``model: {num_layers: 2}``) is rejected.

The library's dataclasses are the source of truth: the ``looped_*`` keys are the fields of
``LoopedTransformerConfig`` and the RL loss keys those of ``RLObjective`` (``OBJECTIVE_FLAGS``),
with their types, defaults and docstrings; a choice is a ``Literal`` written once in the
library. Megatron-LM's flag names are used where Megatron-LM has the flag (``grpo_*``,
``tokenizer_*``, ``eval_*``, ``lr_decay_*``, ...). Values go back through one builder per
library object (``model_config``, ``objective_from``, ``schedule_from``, ``task_from``,
``tokenizer_from``), and ``validate`` builds those objects,
so each check lives in the library and reaches the user as a ``ConfigError`` naming the key.

    cfg = parse_args(["--config", "configs/cpu_2rank.yaml", "--lr", "1e-3"])
    validate(cfg, world_size)          # every check, once, before any process group exists
    save_resolved(cfg, run_dir)        # run_dir/config.yaml, re-loadable with --config
"""

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import sys
import textwrap
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import torch
import torch.nn.functional as F
import yaml

from ..model.config import (
    LoopedTransformerConfig,
    Normalization,
    PositionEmbeddingType,
    parse_loop_sampling,
)
from ..rl.advantages import AdvantageMode
from ..rl.objective import RLObjective
from ..rl.task_registry import get_task
from ..rl.tasks import measure_lengths
from ..rl.tokenizer import CharTokenizer, TokenizerType, build_tokenizer
from ..shared_prefix import get_shared_prefix_forward_backward_func
from ..shared_prefix.planner import shared_cost_model


class ConfigError(ValueError):
    """A configuration that cannot be read or does not make sense; the message names the key."""


# ----------------------------------------------------------------------- fields from the library
def field_docs(cls: type) -> dict[str, str]:
    """Help text of each field of dataclass ``cls`` that has one: the attribute docstring (the
    string under the field in the source of ``cls`` or a base class), or the ``doc`` metadata
    of a field taken from a library dataclass."""
    docs = {}
    for klass in reversed(cls.__mro__):
        docs.update(_source_docs(klass))
    docs.update({f.name: f.metadata["doc"] for f in dataclasses.fields(cls) if "doc" in f.metadata})
    return {f.name: docs[f.name] for f in dataclasses.fields(cls) if f.name in docs}


def _source_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # builtins, classes made at run time
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _rename(text: str, flags: dict[str, str]) -> str:
    """``text`` with the library names of ``{flag: name}`` turned into their flags: a
    snake_case name anywhere, a one-word name only in ``code`` quotes (else it is a word)."""
    names = {name: flag for flag, name in flags.items() if name != flag}
    if not names:
        return text
    alt = "|".join(map(re.escape, names))

    def sub(m: re.Match) -> str:
        quoted, bare = m.group(1), m.group(2)
        if bare and "_" not in bare:
            return bare
        return f"``{names[quoted]}``" if quoted else names[bare]

    return re.sub(rf"``({alt})``|\b({alt})\b", sub, text)


def library_fields(library: type, flags: dict[str, str]) -> list[tuple]:
    """``make_dataclass`` specs of the flags ``{flag: field of library}``: each has the field's
    type and default, and its docstring (field names turned into flags) as metadata ``doc``."""
    hints, docs = typing.get_type_hints(library), field_docs(library)
    fields = {f.name: f for f in dataclasses.fields(library)}
    specs = []
    for flag, name in flags.items():
        f = fields[name]
        meta = {"doc": _rename(docs[name], flags)} if name in docs else {}
        specs.append((flag, hints[name], field(default=f.default,
                                               default_factory=f.default_factory, metadata=meta)))
    return specs


def with_library_fields(library: type, flags: dict[str, str]) -> Callable[[type], type]:
    """Class decorator: dataclass ``cls`` plus a field for each flag of ``{flag: field of
    library}`` that ``cls`` does not declare itself (``library_fields``)."""

    def extend(cls: type) -> type:
        own = {f.name for f in dataclasses.fields(cls)}
        specs = [s for s in library_fields(library, flags) if s[0] not in own]
        new = dataclasses.make_dataclass(cls.__name__, specs, bases=(cls,))
        new.__module__, new.__qualname__, new.__doc__ = (
            cls.__module__, cls.__qualname__, cls.__doc__)
        return new

    return extend


LOOPED_FLAGS = {f.name: f.name for f in dataclasses.fields(LoopedTransformerConfig)
                if f.name.startswith("looped_")}
"""The model section's ``looped_*`` keys: every ``looped_*`` field of LoopedTransformerConfig."""

OBJECTIVE_FLAGS = {
    "rl_loss_normalization": "normalization",
    "grpo_clamp_eps_lower": "clip_low",
    "grpo_clamp_eps_upper": "clip_high",
    "grpo_kl_beta": "kl_coef",
    "grpo_entropy_term_weight": "entropy_weight",
    "rl_loop_weights": "loop_weights",
    "rl_exit_gate_coef": "exit_gate_coef",
    "rl_exit_entropy_coef": "exit_entropy_coef",
    "rl_max_response_length": "constant_length",
}
"""Key -> ``RLObjective`` field, one entry per field. Each key is that field, except
``rl_max_response_length``, which ``RLArgs`` declares (the rollout length) and which is also
the length of the ``constant`` normalisation."""

SCHEDULE_FLAGS = {
    "shared_prefix_schedule": "schedule",
    "shared_prefix_wave_size": "wave_size",
    "shared_prefix_checkpoint_waves": "checkpoint_waves",
    "rl_max_response_length": "max_response_length",
    "shared_prefix_prompt": "prompt",
    "shared_prefix_memory_budget": "memory_budget",
    "micro_batch_size": "naive_micro_batch_size",
}
"""Key -> keyword of ``get_shared_prefix_forward_backward_func`` (the schedule and its
``Planner``): the only route of these keys into the library (the memory budget is in MiB here,
in bytes there: ``schedule_from`` converts it)."""


# ----------------------------------------------------------------------- sections
@with_library_fields(LoopedTransformerConfig, LOOPED_FLAGS)
@dataclass
class ModelArgs:
    """The looped GPT (Megatron names where Megatron has them; ``looped_*``: the fields of
    ``LoopedTransformerConfig``)."""

    num_layers: int = 2
    """Core layers (L_core): the block applied ``looped_num_loops`` times with shared weights."""
    hidden_size: int = 64
    """Transformer hidden size."""
    num_attention_heads: int = 2
    """Attention heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention; None: one per attention head."""
    ffn_hidden_size: Optional[int] = None
    """MLP hidden size; None: 4 * hidden_size."""
    max_position_embeddings: int = 32
    """Longest sequence (bos + prompt + response)."""
    position_embedding_type: PositionEmbeddingType = "learned_absolute"
    """Position embeddings: learned (``learned_absolute``) or rotary (``rope``)."""
    normalization: Normalization = "LayerNorm"
    """Norm layers: ``LayerNorm`` or ``RMSNorm``."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weights instead of the embedding's."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Layer backend: ``local`` (PyTorch, runs on CPU) or ``transformer_engine`` (GPU); also
    MCore's ``TransformerConfig.transformer_impl``."""
    bf16: bool = False
    """Train in bfloat16 mixed precision."""
    fp16: bool = False
    """Train in float16 mixed precision."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size: each layer's heads and MLP, and the vocabulary, split over this
    many ranks (the data-parallel size is the world size divided by it)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the tokenizer's vocabulary to a multiple of this times tensor_model_parallel_size (as
    Megatron) when vocab_size is unset; padding ids are never sampled and never labels."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (the looped GPT rejects any other than 1)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (the looped GPT rejects it: not supported)."""
    context_parallel_size: int = 1
    """Megatron's context-parallel size (the looped GPT rejects any other than 1: not
    supported)."""
    vocab_size: Optional[int] = None
    """Rows of the embedding table (as set: not padded; divisible by
    tensor_model_parallel_size); None: the tokenizer's, padded by make_vocab_size_divisible_by.
    A pretrained model's may be larger: ids past the tokenizer's are never sampled."""
    kv_channels: Optional[int] = None
    """Attention head dimension; None: hidden_size / num_attention_heads."""
    swiglu: bool = False
    """SwiGLU MLP (gated linear unit, silu), as in Llama / Qwen2."""
    disable_bias_linear: bool = False
    """No biases on the linear layers (Llama / Qwen2)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection even with ``disable_bias_linear`` (Qwen2)."""
    norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm."""
    rotary_base: float = 10000.0
    """RoPE base (Hugging Face ``rope_theta``)."""
    use_rope_scaling: bool = False
    """Llama 3.x RoPE frequency scaling (MCore's: frequency factors 1 and 4, context 8192)."""
    rope_scaling_factor: float = 8.0
    """Factor of ``use_rope_scaling``."""
    looped_retrofit: Optional[str] = None
    """Retrofitted recurrence from a pretrained plain stack of N layers: ``prelude,core,coda``
    (e.g. ``2,4,2``): the first ``prelude`` layers run once, the next ``core`` layers are
    looped, the last ``coda`` layers run after every loop; the layers between core and coda
    are dropped (logged). Sets looped_num_prelude_layers, num_layers and
    looped_num_coda_layers, and looped_injection ``linear_concat`` (initialised to [I | 0]).
    Needs ``pretrained_checkpoint``."""
    looped_loops_warmup_iters: int = 0
    """Loop-count curriculum: over this many steps the loop count rises linearly from 1 to
    looped_num_loops (step t: 1 + floor((looped_num_loops - 1) * t / this)); 0: off."""
    looped_num_loops_sampling: str = "fixed"
    """Loop count per training step (Huginn): ``fixed`` (looped_num_loops), ``uniform:a,b``
    (uniform in [a, b]) or ``poisson_lognormal[:max]`` (1 + Poisson(e^tau), tau lognormal,
    mean looped_num_loops, clamped to max, default 2x). One draw per step from (seed, step):
    the same on every rank and again on resume; rollouts, scoring and training of the step use
    it. Evaluation runs the largest count it can draw and reports every loop's accuracy."""


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


@dataclass
class SharedPrefixArgs:
    """The schedule that trains a group of responses sharing one prompt."""

    shared_prefix_schedule: Literal["joint_replay", "naive", "auto"] = "joint_replay"
    """``joint_replay`` (prompt computed once, one replay backward), ``naive``, or ``auto``
    (per group, whichever a cost model calibrated at start predicts faster)."""
    shared_prefix_wave_size: Union[int, Literal["auto"]] = 4
    """Responses per wave in joint replay, or ``auto``: per group the largest wave whose
    predicted activations and prefix adjoints fit ``shared_prefix_memory_budget``."""
    shared_prefix_checkpoint_waves: bool = False
    """Recompute each wave in backward instead of keeping its activations."""
    shared_prefix_prompt: Literal["retain", "recompute", "auto"] = "auto"
    """``retain`` (keep the prompt's graph: the prompt is computed once), ``recompute`` (run
    it again in the joint replay), or ``auto`` (retain unless only recompute fits the budget)."""
    shared_prefix_memory_budget: Optional[float] = None
    """MiB of saved activations plus prefix adjoints allowed per group (planner prediction);
    None: no budget."""


@with_library_fields(RLObjective, OBJECTIVE_FLAGS)
@dataclass
class RLArgs:
    """Task, sampling and the policy-gradient loss (``rl_loss_normalization``,
    ``grpo_clamp_eps_*``, ``grpo_kl_beta``, ``rl_loop_weights``: the fields of ``RLObjective``;
    Megatron-LM's ``grpo_*`` names where it has the flag)."""

    rl_task: str = "modular_arithmetic"
    """Task name (``scalerlt_mcore.rl.task_registry.TASKS``)."""
    rl_task_options: dict = field(default_factory=dict)
    """Options of the task, e.g. ``{modulus: 7}``; on the command line a YAML mapping,
    which replaces (does not merge with) the file's."""
    grpo_group_size: int = 8
    """G: responses sampled per prompt."""
    grpo_prompts_per_step: Optional[int] = None
    """Prompts per RL step, summed over data-parallel ranks; None: ``global_batch_size /
    grpo_group_size`` (when set, ``global_batch_size`` must equal it x ``grpo_group_size``)."""
    rl_max_response_length: int = 4
    """Most tokens sampled per response (eos included); also the length of the ``constant``
    loss normalisation."""
    rl_temperature: float = 1.0
    """Sampling temperature."""
    rl_top_p: float = 1.0
    """Nucleus-sampling threshold; 1 disables it."""
    rl_advantage: AdvantageMode = "grpo"
    """``grpo`` ((r - mean) / std per group), ``dr_grpo`` (r - mean) or ``none`` (r)."""
    grpo_iterations: int = 1
    """Passes (optimizer steps) over each rollout batch (PPO epochs)."""
    rl_rollout: Literal["prompt_once", "per_row"] = "prompt_once"
    """How rollouts hold the prompts: ``prompt_once`` (each prompt prefilled once, its G
    samples read that one copy of its K/V, Hydragen-style) or ``per_row`` (every sample its
    own row: the prompt prefilled and cached G times). The same samples up to rounding."""
    rl_rollout_exit: Literal["none", "mixture", "threshold"] = "none"
    """How rollouts use the exit gate (needs looped_exit_gate): ``none`` (sample from the last
    loop's readout), ``mixture`` (from the exit-weighted mixture sum_r p(r) pi_r, Ouro/RLTT)
    or ``threshold`` (per token, from the first loop whose exit CDF reaches
    rl_exit_threshold: Ouro's early exit)."""
    rl_exit_threshold: float = 0.5
    """Exit CDF threshold of ``rl_rollout_exit: threshold``, in (0, 1]."""
    rl_old_logprobs: Literal["score", "rollout"] = "score"
    """Old (behaviour) log-probs of the update: ``score`` (a forward-only pass of the policy
    through the shared-prefix schedule after the rollout) or ``rollout`` (the rollout's own
    per-loop log-probs of the sampled tokens: no scoring pass; they differ from the training
    forward's by rounding, logged as rollout_logprob_max_diff). ``rollout`` needs
    ``grpo_iterations`` 1."""
    rl_partial_credit: bool = False
    """Reward wrong answers with the fraction of correct positions."""
    rl_warmup_sft_steps: int = 0
    """Supervised steps on (prompt, answer) pairs before RL."""
    rl_warmup_sft_lr: Optional[float] = None
    """Constant learning rate of the supervised warm-up steps, which then leave the schedule
    alone (``lr``, ``lr_warmup_iters`` and the decay start with RL); None: the warm-up steps
    follow the schedule like RL steps."""


@dataclass
class TokenizerArgs:
    """The tokenizer (Megatron-LM's flags; ``scalerlt_mcore.rl.tokenizer``)."""

    tokenizer_type: Optional[TokenizerType] = None
    """``CharTokenizer`` (the built-in tasks' characters), ``ByteLevelTokenizer`` (UTF-8
    bytes, MCore's byte-level tokenizer) or ``HuggingFaceTokenizer`` (a tokenizer.json); None:
    ``HuggingFaceTokenizer`` when ``pretrained_checkpoint`` is a Hugging Face directory holding
    a tokenizer.json, else ``CharTokenizer``."""
    tokenizer_model: Optional[str] = None
    """The ``HuggingFaceTokenizer``'s tokenizer.json file, or the folder holding it; None: the
    tokenizer.json of a Hugging Face ``pretrained_checkpoint``."""


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


@dataclass
class RunConfig:
    """Everything a run needs, in sections; file and flag names are the flat field names."""

    model: ModelArgs = field(default_factory=ModelArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    shared_prefix: SharedPrefixArgs = field(default_factory=SharedPrefixArgs)
    rl: RLArgs = field(default_factory=RLArgs)
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)


SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))

DEMO_CONFIG = "demo_cpu.yaml"
"""The packaged config used when no ``--config`` is given."""


def _key_table() -> dict[str, tuple[str, Any]]:
    """Flat key -> (section, type)."""
    table = {}
    for section in dataclasses.fields(RunConfig):
        hints = typing.get_type_hints(section.default_factory)
        for f in dataclasses.fields(section.default_factory):
            assert f.name not in table, f"duplicate config key {f.name}"
            table[f.name] = (section.name, hints[f.name])
    return table


KEYS = _key_table()


def _optional(tp: Any) -> Optional[Any]:
    """``X`` when ``tp`` is ``Optional[X]``, else None."""
    if get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp):
        return next(a for a in get_args(tp) if a is not type(None))
    return None


def _alternatives(tp: Any) -> tuple:
    """The types of a ``Union`` without None (e.g. ``Union[int, Literal["auto"]]``), else ()."""
    if get_origin(tp) in (typing.Union, types.UnionType) and type(None) not in get_args(tp):
        return get_args(tp)
    return ()


def choices(tp: Any) -> tuple:
    """The allowed values of a ``Literal`` (or ``Optional[Literal]``) type; () for other types."""
    tp = _optional(tp) or tp
    return get_args(tp) if get_origin(tp) is Literal else ()


CHOICES = {k: choices(tp) for k, (_, tp) in KEYS.items() if choices(tp)}
"""Allowed values of each key that is a choice (a ``Literal`` field)."""


# ----------------------------------------------------------------------- reading values
def _coerce(key: str, value: Any, tp: Any, cli: bool) -> Any:
    """``value`` as type ``tp`` (a ``Literal``: one of its values; a ``Union``: the first of
    its types that reads it); strings from the command line are parsed."""
    if _optional(tp):
        if value is None or (cli and value.lower() in ("none", "null")):
            return None
        tp = _optional(tp)
    if _alternatives(tp):
        return _coerce_union(key, value, tp, cli)
    allowed = choices(tp)
    parsed = _parse(value, type(allowed[0]) if allowed else tp, cli)
    if allowed and parsed not in allowed:
        raise ConfigError(f"{key} must be one of {allowed}, got {value!r}")
    if parsed is _INVALID:
        raise ConfigError(f"key {key!r} expects {tp.__name__}, got {value!r}")
    return parsed


def _coerce_union(key: str, value: Any, tp: Any, cli: bool) -> Any:
    """``value`` as the first type of the ``Union`` ``tp`` that reads it."""
    for option in _alternatives(tp):
        try:
            return _coerce(key, value, option, cli)
        except ConfigError:
            pass
    raise ConfigError(f"{key} must be {' or '.join(map(_type_name, _alternatives(tp)))}, "
                      f"got {value!r}")


_INVALID = object()
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _parse(value: Any, tp: type, cli: bool) -> Any:
    """``value`` converted to ``tp``, or ``_INVALID``. YAML reads ``1e-3`` as a string, so
    numbers are accepted as strings from files too."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        return _BOOLS.get(value.lower(), _INVALID) if cli else _INVALID
    if tp in (int, float):
        if isinstance(value, bool):
            return _INVALID
        if isinstance(value, tp) or (tp is float and isinstance(value, int)):
            return tp(value)
        try:
            return tp(value) if isinstance(value, str) else _INVALID
        except ValueError:
            return _INVALID
    if tp is dict and cli:
        try:
            value = yaml.safe_load(value) or {}
        except yaml.YAMLError:
            return _INVALID
    return value if isinstance(value, tp) else _INVALID


def _unknown_key(key: str, where: str) -> ConfigError:
    message = f"unknown key {key!r} {where}"
    if key in SECTIONS:
        message += f"; sections are not keys: write flat keys (e.g. 'num_layers: 2'), not '{key}:'"
    close = difflib.get_close_matches(key, KEYS, n=1)
    return ConfigError(message + (f"; did you mean {close[0]!r}?" if close else ""))


def apply_overrides(cfg: RunConfig, values: dict, where: str, cli: bool = False) -> RunConfig:
    """Set each flat key of ``values`` on ``cfg`` (in place); ``where`` names the source."""
    for key, value in values.items():
        if key not in KEYS:
            raise _unknown_key(str(key), where)
        section, tp = KEYS[key]
        setattr(getattr(cfg, section), key, _coerce(key, value, tp, cli))
    return cfg


# ----------------------------------------------------------------------- files
def read_yaml(path: str | Path) -> dict:
    """The flat mapping in ``path``; missing files and non-mappings raise ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    return _load_mapping(path.read_text(), str(path))


def _load_mapping(text: str, name: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse {name}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must be a mapping of keys to values, got {type(data).__name__}")
    return data


def demo_config_text() -> str:
    """The packaged demo config (``scalerlt_mcore/configs/demo_cpu.yaml``)."""
    return (resources.files("scalerlt_mcore") / "configs" / DEMO_CONFIG).read_text()


def load_config(path: Optional[str | Path] = None) -> RunConfig:
    """Defaults overridden by the YAML file ``path`` (the packaged demo when None)."""
    if path is None:
        return apply_overrides(RunConfig(), _load_mapping(demo_config_text(), DEMO_CONFIG),
                               f"in {DEMO_CONFIG}")
    return apply_overrides(RunConfig(), read_yaml(path), f"in {path}")


def to_dict(cfg: RunConfig) -> dict:
    """The flat key -> value mapping of ``cfg``, in section and field order."""
    return {k: v for s in SECTIONS for k, v in dataclasses.asdict(getattr(cfg, s)).items()}


def save_resolved(cfg: RunConfig, run_dir: str | Path) -> Path:
    """Write ``run_dir/config.yaml``: every key, loadable with ``--config``. Returns its path."""
    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Resolved configuration of this run (defaults < config file < command line).\n"
    path.write_text(header + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def default_run_dir() -> str:
    """``runs/<timestamp>``. Under torchrun compute it on one rank and broadcast it."""
    return time.strftime("runs/%Y%m%d-%H%M%S")


# ----------------------------------------------------------------------- command line
def cli_flags() -> list[str]:
    """Every accepted flag, sorted."""
    return sorted(["--config", "--help"] + [_flag(k) for k in KEYS])


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def split_cli(argv: list[str]) -> tuple[Optional[str], dict[str, str]]:
    """``(config path, {key: raw string})`` from ``--key value`` / ``--key=value`` tokens.
    A boolean flag alone (``--bf16``) means true."""
    config, values, i = None, {}, 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected command-line argument {token!r}; use --key value")
        name, has_value, value = token[2:].partition("=")
        key = name.replace("-", "_")
        if key != "config" and key not in KEYS:
            raise _unknown_key(key, f"on the command line ({token})")
        takes_value = key == "config" or KEYS[key][1] is not bool
        if not has_value and i + 1 < len(argv):
            nxt = argv[i + 1]
            if takes_value or nxt.lower() in _BOOLS:
                has_value, value, i = True, nxt, i + 1
        if not has_value and takes_value:
            raise ConfigError(f"key {key!r} expects a value ({token} VALUE)")
        if key == "config":
            config = value
        else:
            values[key] = value if has_value else "true"
        i += 1
    return config, values


def parse_args(argv: Optional[list[str]] = None) -> RunConfig:
    """Defaults < ``--config`` file (the packaged demo without one) < the other flags.
    Cross-field checks need the world size: call ``validate(cfg, world_size)`` next."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        raise SystemExit(0)
    config, values = split_cli(argv)
    return apply_overrides(load_config(config), values, "on the command line", cli=True)


def help_text() -> str:
    """Usage and every flag with its type, the value a run without ``--config`` uses (the
    packaged demo config's where it sets one) and docstring."""
    lines = ["usage: python -m scalerlt_mcore.train [--config FILE.yaml] [--key VALUE ...]", "",
             f"Without --config the packaged demo config ({DEMO_CONFIG}) is applied: each "
             "flag's default below is the value such a run uses ('demo' marks the values the "
             "demo config sets, with the built-in default beside it). With --config FILE the "
             "built-in defaults apply under FILE.", ""]
    demo, builtin = to_dict(load_config(None)), to_dict(RunConfig())
    for section in dataclasses.fields(RunConfig):
        cls = section.default_factory
        lines.append(f"{section.name}: {' '.join(cls.__doc__.split())}")
        for key, doc in field_docs(cls).items():
            default = f"default {demo[key]!r}"
            if demo[key] != builtin[key]:
                default += f" (demo; built-in {builtin[key]!r})"
            lines.append(f"  {_flag(key)} {_type_name(KEYS[key][1])} ({default}): {doc}")
    return "\n".join(lines)


def _type_name(tp: Any) -> str:
    """``{a,b}`` for a choice, ``INT`` for int, ``INT|null`` for Optional[int],
    ``INT|{auto}`` for Union[int, Literal["auto"]], ..."""
    if _alternatives(tp):
        return "|".join(map(_type_name, _alternatives(tp)))
    if choices(tp):
        name = "{" + ",".join(map(str, choices(tp))) + "}"
    else:
        name = (_optional(tp) or tp).__name__.upper()
    return name + ("|null" if _optional(tp) else "")


# ----------------------------------------------------------------------- library objects
def looped_kwargs(cfg: RunConfig) -> dict:
    """The model section's values that are ``LoopedTransformerConfig`` fields (MCore's and
    the ``looped_*`` ones), by name."""
    names = {f.name for f in dataclasses.fields(LoopedTransformerConfig)}
    return {k: v for k, v in dataclasses.asdict(cfg.model).items() if k in names}


def model_config(cfg: RunConfig, device: str) -> LoopedTransformerConfig:
    """The MCore ``TransformerConfig`` (with ``looped_*`` fields) of a run; needs no process
    group, so ``validate`` builds it too."""
    m = cfg.model
    dtype = torch.bfloat16 if m.bf16 else torch.float16 if m.fp16 else torch.float32
    return LoopedTransformerConfig(**looped_kwargs(cfg), **_megatron_model_kwargs(m),
                                   params_dtype=dtype, pipeline_dtype=dtype,
                                   use_cpu_initialization=device == "cpu",
                                   perform_initialization=True)


def _megatron_model_kwargs(m: "ModelArgs") -> dict:
    """Megatron-LM flags whose TransformerConfig field has another name or form."""
    return dict(layernorm_epsilon=m.norm_epsilon, gated_linear_unit=m.swiglu,
                activation_func=F.silu if m.swiglu else F.gelu,
                add_bias_linear=not m.disable_bias_linear)


def library_kwargs(cfg: RunConfig, flags: dict[str, str]) -> dict:
    """``{library name: value of its key}`` for the keys of ``{key: library name}``."""
    flat = to_dict(cfg)
    return {name: flat[key] for key, name in flags.items()}


def objective_from(cfg: RunConfig) -> RLObjective:
    """The run's RL loss (``OBJECTIVE_FLAGS``)."""
    return RLObjective(**library_kwargs(cfg, OBJECTIVE_FLAGS))


def schedule_from(cfg: RunConfig, model=None, loss_per_position: Optional[float] = None):
    """The run's shared-prefix schedule and its planner (``SCHEDULE_FLAGS``): the memory
    budget in bytes, the loss's saved bytes per position (``loss_per_position``, by default
    the run's ``RLObjective.saved_per_position``) and, with ``shared_prefix_schedule: auto``,
    the cost model measured on ``model`` (on rank 0, shared by every rank; without a model,
    measured at the first plan)."""
    kwargs = library_kwargs(cfg, SCHEDULE_FLAGS)
    if kwargs["memory_budget"] is not None:
        kwargs["memory_budget"] *= 2**20  # MiB -> bytes
    if kwargs["schedule"] == "auto":
        kwargs["cost_model"] = shared_cost_model if model is None else shared_cost_model(model)
    if loss_per_position is None:
        loss_per_position = objective_from(cfg).saved_per_position
    return get_shared_prefix_forward_backward_func(**kwargs, loss_per_position=loss_per_position)


def task_from(cfg: RunConfig):
    """The run's task."""
    return get_task(cfg.rl.rl_task, **cfg.rl.rl_task_options)


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_type: str, tokenizer_model: Optional[str]):
    return build_tokenizer(tokenizer_type, tokenizer_model)


def tokenizer_from(cfg: RunConfig):
    """The run's tokenizer (built once per process for each type and model)."""
    return _tokenizer(*tokenizer_args(cfg))


def tokenizer_args(cfg: RunConfig) -> tuple[str, Optional[str]]:
    """(tokenizer_type, tokenizer_model) of the run: the flags, and where they are unset the
    tokenizer.json of a Hugging Face ``pretrained_checkpoint`` (else ``CharTokenizer``); a
    ``tokenizer_model`` alone means ``HuggingFaceTokenizer``."""
    kind, model = cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model
    pretrained = pretrained_tokenizer_json(cfg.logging.pretrained_checkpoint)
    if kind is None:
        kind = "HuggingFaceTokenizer" if model or pretrained else "CharTokenizer"
    if kind == "HuggingFaceTokenizer" and model is None:
        model = pretrained
    return kind, model


def pretrained_tokenizer_json(path: Optional[str]) -> Optional[str]:
    """The tokenizer.json of a Hugging Face checkpoint directory (config.json beside it), or
    None."""
    root = Path(path) if path else None
    if root is None or not (root / "config.json").is_file():
        return None
    file = root / "tokenizer.json"
    return str(file) if file.is_file() else None


def _tokenizer_size(cfg: RunConfig) -> Optional[int]:
    """The tokenizer's vocabulary size; None when it does not build (``_check_task`` says why)."""
    try:
        return tokenizer_from(cfg).vocab_size
    except (ValueError, OSError):
        return None


def prompts_per_step(cfg: RunConfig) -> int:
    """Prompts per RL step over all data-parallel ranks."""
    return cfg.rl.grpo_prompts_per_step or cfg.training.global_batch_size // cfg.rl.grpo_group_size


def eval_prompts(cfg: RunConfig) -> int:
    """Held-out prompts per evaluation: ``eval_iters`` batches of ``prompts_per_step``."""
    return cfg.training.eval_iters * prompts_per_step(cfg)


# ----------------------------------------------------------------------- validation
def validate(cfg: RunConfig, world_size: int) -> None:
    """Every check, run once: each key's type, then the library objects the run builds (their
    own checks, reported with the keys' names) and the app's cross-field checks. Raises one
    ConfigError listing all problems. Needs no process group: run it before creating one."""
    errors = _check_types(cfg)
    if not errors:
        errors = (_check_model(cfg, world_size) + _check_batches(cfg, world_size)
                  + _check_training(cfg.training) + _check_rl(cfg)
                  + _library_errors(objective_from, cfg, OBJECTIVE_FLAGS)
                  + _check_schedule(cfg)
                  + _check_pretrained(cfg))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def _check_types(cfg: RunConfig) -> list[str]:
    """Each value has its key's type (a choice: one of its values). ``parse_args`` checked
    what it read; this catches values set in Python."""
    errors = []
    for key, value in to_dict(cfg).items():
        try:
            _coerce(key, value, KEYS[key][1], cli=False)
        except ConfigError as e:
            errors.append(str(e))
    return errors


_LIBRARY_ERRORS = (ValueError, TypeError, AssertionError, NotImplementedError)


def _library_errors(build: Callable, cfg: RunConfig, flags: dict[str, str]) -> list[str]:
    """[] when ``build(cfg)`` constructs its library object, else the library's message with
    its names turned into the keys of ``{key: library name}``."""
    try:
        build(cfg)
    except _LIBRARY_ERRORS as e:
        return [_rename(str(e), flags)]
    return []


def _positive(section: Any, *keys: str, minimum: float = 1) -> list[str]:
    return [f"{k} must be >= {minimum}, got {getattr(section, k)}"
            for k in keys if getattr(section, k) < minimum]


def _check_model(cfg: RunConfig, world_size: int) -> list[str]:
    """The app's checks of the model section, then ``model_config``'s own (MCore's and the
    looped GPT's): the sizes it divides by must be >= 1 first."""
    m = cfg.model
    errors = _positive(m, "num_layers", "hidden_size", "num_attention_heads",
                       "max_position_embeddings", "tensor_model_parallel_size",
                       "make_vocab_size_divisible_by", "pipeline_model_parallel_size")
    if errors:
        return errors
    unsupported = _unsupported_parallelism(m)
    if unsupported:
        return unsupported
    if m.hidden_size % m.num_attention_heads:
        errors.append(f"hidden_size ({m.hidden_size}) must be divisible by "
                      f"num_attention_heads ({m.num_attention_heads})")
    groups = m.num_query_groups or m.num_attention_heads
    if groups < 1 or m.num_attention_heads % groups:
        errors.append(f"num_attention_heads ({m.num_attention_heads}) must be divisible by "
                      f"num_query_groups ({groups})")
    if world_size % m.tensor_model_parallel_size:
        errors.append(f"world size ({world_size}) must be divisible by "
                      f"tensor_model_parallel_size ({m.tensor_model_parallel_size})")
    if m.vocab_size is not None and m.vocab_size % m.tensor_model_parallel_size:
        errors.append(f"vocab_size ({m.vocab_size}) must be divisible by "
                      f"tensor_model_parallel_size ({m.tensor_model_parallel_size}): the "
                      f"output layer splits the vocabulary (leave vocab_size unset to pad the "
                      f"tokenizer's by make_vocab_size_divisible_by)")
    return errors + _library_errors(lambda c: model_config(c, "cpu"), cfg, LOOPED_FLAGS)


def _unsupported_parallelism(m: ModelArgs) -> list[str]:
    """Megatron's sequence and context parallelism, refused with the reason (before MCore's
    own checks, whose messages suggest other settings)."""
    errors = []
    if m.sequence_parallel:
        errors.append("sequence_parallel (--sequence-parallel) must be false: the looped GPT "
                      "does not support sequence parallelism")
    if m.context_parallel_size != 1:
        errors.append(f"context_parallel_size (--context-parallel-size) must be 1, got "
                      f"{m.context_parallel_size}: the looped GPT does not support context "
                      f"parallelism")
    return errors


def _check_batches(cfg: RunConfig, world_size: int) -> list[str]:
    t, group = cfg.training, cfg.rl.grpo_group_size
    errors = _positive(t, "micro_batch_size", "global_batch_size")
    errors += _positive(cfg.rl, "grpo_group_size")
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


def _check_schedule(cfg: RunConfig) -> list[str]:
    """The schedule's and its planner's own checks (the loss's bytes per position change none
    of them: a placeholder, so that an invalid objective is reported once, by its own check)."""
    return _library_errors(lambda c: schedule_from(c, loss_per_position=1.0), cfg,
                           SCHEDULE_FLAGS)


def _check_training(t: TrainingArgs) -> list[str]:
    errors = _positive(t, "train_iters")
    errors += _positive(t, "lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad",
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
    if t.ddp_bucket_size is not None and t.ddp_bucket_size < 1:
        errors.append(f"ddp_bucket_size must be >= 1 or null, got {t.ddp_bucket_size}")
    return errors


def _check_rl(cfg: RunConfig) -> list[str]:
    rl = cfg.rl
    errors = _positive(rl, "rl_max_response_length", "grpo_iterations")
    errors += _positive(rl, "rl_warmup_sft_steps", "grpo_kl_beta", minimum=0)
    errors += _positive(cfg.training, "eval_iters", "distributed_timeout_minutes")
    errors += _positive(cfg.training, "eval_interval", "exit_interval", "manual_gc_interval",
                        minimum=0)
    errors += _positive(cfg.logging, "save_interval", "save_keep_last", minimum=0)
    errors += _positive(cfg.logging, "log_interval")
    if rl.rl_warmup_sft_lr is not None and rl.rl_warmup_sft_lr <= 0:
        errors.append(f"rl_warmup_sft_lr must be > 0 or null, got {rl.rl_warmup_sft_lr}")
    if rl.rl_temperature <= 0:
        errors.append(f"rl_temperature must be > 0, got {rl.rl_temperature}")
    if not 0 < rl.rl_top_p <= 1:
        errors.append(f"rl_top_p must be in (0, 1], got {rl.rl_top_p}")
    if rl.rl_old_logprobs == "rollout" and rl.grpo_iterations != 1:
        errors.append(f"rl_old_logprobs 'rollout' needs grpo_iterations 1, got "
                      f"{rl.grpo_iterations} (the rollout's log-probs replace the scoring pass "
                      f"of a single update)")
    errors += _check_loop_credit(cfg)
    if rl.rl_rollout_exit != "none" and not cfg.model.looped_exit_gate:
        errors.append(f"rl_rollout_exit {rl.rl_rollout_exit} needs looped_exit_gate true")
    if not 0 < rl.rl_exit_threshold <= 1:
        errors.append(f"rl_exit_threshold must be in (0, 1], got {rl.rl_exit_threshold}")
    if rl.rl_advantage != "none" and rl.grpo_group_size == 1:
        errors.append(f"rl_advantage {rl.rl_advantage!r} needs grpo_group_size >= 2 "
                      "(a group of one has zero advantage)")
    return errors + _check_task(cfg)


def _check_loop_credit(cfg: RunConfig) -> list[str]:
    """What the loss needs of the model and the model's parts of the loss
    (``RLObjective.model_errors``: loop credit, exit gate), and truncated backprop's need of
    injection."""
    m, errors = cfg.model, []
    try:
        high = parse_loop_sampling(m.looped_num_loops_sampling, m.looped_num_loops)[2]
    except ValueError:
        high = None  # reported by _check_pretrained
    try:
        errors += [_rename(e, OBJECTIVE_FLAGS)
                   for e in objective_from(cfg).model_errors(m, max_loops=high)]
    except _LIBRARY_ERRORS:
        pass  # an invalid objective: reported by its own check
    # MCore DDP with overlapped reduction needs a gradient for every parameter every step
    if m.looped_backprop_loops > 0 and m.looped_injection == "none":
        errors.append("looped_backprop_loops > 0 needs looped_injection linear_concat (as "
                      "Huginn: without injection the truncated loops cut the embedding and "
                      "prelude off from every gradient)")
    return errors


def _check_task(cfg: RunConfig) -> list[str]:
    """The task and tokenizer build, the task's text encodes, and its longest prompt and
    answer (stated by the task, else measured on a sample) fit the lengths."""
    try:
        task = task_from(cfg)
    except ValueError as e:
        return [f"rl_task / rl_task_options: {e}"]
    try:
        tok = tokenizer_from(cfg)
    except (ValueError, OSError) as e:
        return [f"tokenizer_type / tokenizer_model: {e}"]
    try:
        prompt, answer = _task_lengths(task, tok)
    except ValueError as e:
        return [f"rl_task {cfg.rl.rl_task} with tokenizer_type "
                f"{tokenizer_args(cfg)[0]}: {e}"]
    errors = []
    if cfg.rl.rl_max_response_length < answer:
        errors.append(f"rl_max_response_length ({cfg.rl.rl_max_response_length}) is shorter "
                      f"than the task's longest answer ({answer})")
    needed = 1 + prompt + cfg.rl.rl_max_response_length
    if cfg.model.max_position_embeddings < needed:
        errors.append(f"max_position_embeddings ({cfg.model.max_position_embeddings}) must be "
                      f">= bos + longest prompt + rl_max_response_length ({needed})")
    return errors


def _task_lengths(task, tok) -> tuple[int, int]:
    """(longest prompt, longest answer) in tokens: the task's own bounds where it states them
    and the tokenizer has one token per character, else measured on 256 sampled problems."""
    measured = measure_lengths(task, tok.encode)  # also: every character encodes
    exact = task.max_prompt_chars is not None and (
        isinstance(tok, CharTokenizer) or tok.identity()["type"] == "ByteLevelTokenizer")
    return (task.max_prompt_chars, task.max_answer_chars) if exact else measured


def _check_pretrained(cfg: RunConfig) -> list[str]:
    """Architecture extras, loading flags and retrofitted recurrence."""
    m, lg = cfg.model, cfg.logging
    errors = _positive(m, "looped_loops_warmup_iters", minimum=0)
    errors += [f"{k} must be > 0, got {getattr(m, k)}"
               for k in ("norm_epsilon", "rotary_base", "rope_scaling_factor")
               if getattr(m, k) <= 0]
    if m.kv_channels is not None and m.kv_channels < 1:
        errors.append(f"kv_channels must be >= 1 or null, got {m.kv_channels}")
    tokens = _tokenizer_size(cfg)
    if m.vocab_size is not None and tokens is not None and m.vocab_size < tokens:
        errors.append(f"vocab_size ({m.vocab_size}) must be >= the tokenizer's ({tokens})")
    try:
        parse_loop_sampling(m.looped_num_loops_sampling, m.looped_num_loops)
    except ValueError as e:
        errors.append(str(e))
    if m.looped_retrofit is not None and not re.fullmatch(r"\d+,\d+,\d+", m.looped_retrofit):
        errors.append(f"looped_retrofit must be 'prelude,core,coda' (e.g. '2,4,2'), got "
                      f"{m.looped_retrofit!r}")
    needs = {"looped_retrofit": m.looped_retrofit, "use_checkpoint_args": lg.use_checkpoint_args}
    errors += [f"{k} needs pretrained_checkpoint" for k, v in needs.items()
               if v and not lg.pretrained_checkpoint]
    errors += [f"{k} needs load (the checkpoint it applies to)"
               for k in ("finetune", "no_load_optim", "no_load_rng")
               if getattr(lg, k) and not lg.load]
    t = cfg.training
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        errors.append("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler "
                      "exclude each other: the LR schedule comes from this run's flags or from "
                      "the checkpoint")
    return errors
