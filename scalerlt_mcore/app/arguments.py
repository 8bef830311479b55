"""Run configuration: dataclasses, a flat YAML file, command-line overrides, one validate.

Precedence: dataclass defaults < YAML file < command line. Without ``--config`` the YAML
file is the packaged demo (``scalerlt_mcore/configs/demo_cpu.yaml``, a tiny CPU run).

Layout: the YAML file is **flat**, one Megatron-style key per line (``num_layers: 2``), the
same names as the command-line flags (``--num-layers 2``). Keys are unique across the
sections of ``RunConfig`` (``model``, ``training``, ``shared_prefix``, ``rl``, ``logging``),
which exist only in Python; a grouped file (``model: {num_layers: 2}``) is rejected.

    cfg = parse_args(["--config", "configs/cpu_2rank.yaml", "--lr", "1e-3"])
    validate(cfg, world_size)          # every cross-field check, once
    save_resolved(cfg, run_dir)        # run_dir/config.yaml, re-loadable with --config
"""

import ast
import dataclasses
import difflib
import inspect
import sys
import textwrap
import time
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A configuration that cannot be read or does not make sense; the message names the key."""


@dataclass
class ModelArgs:
    """The looped GPT (Megatron names where Megatron has them)."""

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
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute`` or ``rope``."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` or ``RMSNorm``."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weights instead of the embedding's."""
    transformer_impl: str = "local"
    """Layer backend: ``local`` (PyTorch, runs on CPU) or ``transformer_engine`` (GPU)."""
    bf16: bool = False
    """Train in bfloat16 mixed precision."""
    fp16: bool = False
    """Train in float16 mixed precision."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size: each layer's heads and MLP, and the vocabulary, split over this
    many ranks (the data-parallel size is the world size divided by it)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times tensor_model_parallel_size (as Megatron);
    padding ids are never sampled and never labels."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size; the looped GPT supports only 1."""
    looped_num_loops: int = 2
    """R: how many times the core block is applied."""
    looped_num_prelude_layers: int = 0
    """Layers run once on the embedded input before the first loop."""
    looped_num_coda_layers: int = 0
    """Head layers applied after every loop, before the shared readout."""
    looped_injection: str = "none"
    """How the embedded input re-enters every loop: ``none`` or ``linear_concat``."""
    looped_prefix_attention: str = "cascade"
    """Attention of responses to the shared prompt K/V: ``cascade`` or ``concat``."""


@dataclass
class TrainingArgs:
    """Optimizer, batch sizes and distributed training."""

    micro_batch_size: int = 8
    """Responses per forward/backward on one rank."""
    global_batch_size: int = 32
    """Responses per RL step, summed over data-parallel ranks (prompts x rl_group_size)."""
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
    """RL steps (rollout batches)."""
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

    shared_prefix_schedule: str = "joint_replay"
    """``joint_replay`` (prompt computed once, one replay backward) or ``naive``."""
    shared_prefix_wave_size: int = 4
    """Responses per wave in joint replay."""
    shared_prefix_checkpoint_waves: bool = False
    """Recompute each wave in backward instead of keeping its activations."""


@dataclass
class RLArgs:
    """Task, sampling and the policy-gradient loss."""

    rl_task: str = "modular_arithmetic"
    """Task name (``scalerlt_mcore.rl.tasks.TASKS``)."""
    rl_task_options: dict = field(default_factory=dict)
    """Options of the task, e.g. ``{modulus: 7}``; on the command line a YAML mapping,
    which replaces (does not merge with) the file's."""
    rl_group_size: int = 8
    """G: responses sampled per prompt."""
    rl_max_response_length: int = 4
    """Most tokens sampled per response (eos included)."""
    rl_temperature: float = 1.0
    """Sampling temperature."""
    rl_top_p: float = 1.0
    """Nucleus-sampling threshold; 1 disables it."""
    rl_advantage: str = "grpo"
    """``grpo`` ((r - mean) / std per group), ``dr_grpo`` (r - mean) or ``none`` (r)."""
    rl_loss_normalization: str = "token_mean"
    """Loss reduction over a group: ``token_mean``, ``seq_mean`` or ``constant``
    (sum / (G * rl_max_response_length))."""
    rl_clip_low: float = 0.2
    """PPO clip range below 1: ratio >= 1 - rl_clip_low."""
    rl_clip_high: float = 0.2
    """PPO clip range above 1: ratio <= 1 + rl_clip_high."""
    rl_kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the initial policy; 0 disables it."""
    rl_ppo_epochs: int = 1
    """Optimizer steps per rollout batch."""
    rl_loop_weights: str = "final"
    """Which loops' readouts the loss uses: ``final``, ``uniform`` or ``progressive``
    (weight proportional to the loop index)."""
    rl_partial_credit: bool = False
    """Reward wrong answers with the fraction of correct positions."""
    rl_warmup_sft_steps: int = 0
    """Supervised steps on (prompt, answer) pairs before RL."""
    rl_eval_every: int = 10
    """Greedy evaluation every this many steps; 0 disables it."""
    rl_eval_prompts: int = 64
    """Prompts per evaluation."""


@dataclass
class LoggingArgs:
    """Checkpoints, run directory and logs."""

    save: Optional[str] = None
    """Checkpoint directory to save to; None: no checkpoints."""
    load: Optional[str] = None
    """Checkpoint directory to resume from."""
    save_interval: int = 0
    """Save every this many steps; 0: only at the end (when ``save`` is set)."""
    run_dir: Optional[str] = None
    """Where logs, plots and the resolved config go; None: ``runs/<timestamp>``."""
    log_interval: int = 1
    """Log every this many steps."""
    no_plot: bool = False
    """Do not write the training-curve plot."""


@dataclass
class RunConfig:
    """Everything a run needs, in sections; file and flag names are the flat field names."""

    model: ModelArgs = field(default_factory=ModelArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    shared_prefix: SharedPrefixArgs = field(default_factory=SharedPrefixArgs)
    rl: RLArgs = field(default_factory=RLArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)


SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))
CHOICES = {
    "position_embedding_type": ("learned_absolute", "rope"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "transformer_impl": ("local", "transformer_engine"),
    "looped_injection": ("none", "linear_concat"),
    "looped_prefix_attention": ("cascade", "concat"),
    "shared_prefix_schedule": ("joint_replay", "naive"),
    "rl_advantage": ("grpo", "dr_grpo", "none"),
    "rl_loss_normalization": ("token_mean", "seq_mean", "constant"),
    "rl_loop_weights": ("final", "uniform", "progressive"),
}
"""Allowed values of the string fields that are a choice."""

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


# ----------------------------------------------------------------------- reading values
def _coerce(key: str, value: Any, tp: Any, cli: bool) -> Any:
    """``value`` as type ``tp``; strings from the command line are parsed."""
    if typing.get_origin(tp) is typing.Union:
        if value is None or (cli and value.lower() in ("none", "null")):
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    parsed = _parse(value, tp, cli)
    if parsed is _INVALID:
        raise ConfigError(f"key {key!r} expects {tp.__name__}, got {value!r}")
    return parsed


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


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string under each field) of dataclass ``cls``."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def help_text() -> str:
    """Usage and every flag with its type, default and docstring."""
    lines = ["usage: python -m scalerlt_mcore.train [--config FILE.yaml] [--key VALUE ...]", ""]
    for section in dataclasses.fields(RunConfig):
        cls = section.default_factory
        lines.append(f"{section.name}: {cls.__doc__}")
        docs, defaults = field_docs(cls), dataclasses.asdict(cls())
        for key in docs:
            lines.append(f"  {_flag(key)} (default {defaults[key]!r}): {docs[key]}")
    return "\n".join(lines)


# ----------------------------------------------------------------------- validation
def validate(cfg: RunConfig, world_size: int) -> None:
    """Every cross-field check, run once; raises one ConfigError listing all problems."""
    errors = (_check_choices(cfg) + _check_model(cfg.model, world_size)
              + _check_batches(cfg, world_size) + _check_training(cfg.training)
              + _check_rl(cfg))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def _check_choices(cfg: RunConfig) -> list[str]:
    flat = to_dict(cfg)
    return [f"{k} must be one of {allowed}, got {flat[k]!r}"
            for k, allowed in CHOICES.items() if flat[k] not in allowed]


def _positive(section: Any, *keys: str, minimum: float = 1) -> list[str]:
    return [f"{k} must be >= {minimum}, got {getattr(section, k)}"
            for k in keys if getattr(section, k) < minimum]


def _check_model(m: ModelArgs, world_size: int) -> list[str]:
    errors = _positive(m, "num_layers", "hidden_size", "num_attention_heads",
                       "max_position_embeddings", "tensor_model_parallel_size",
                       "make_vocab_size_divisible_by", "looped_num_loops")
    errors += _positive(m, "looped_num_prelude_layers", "looped_num_coda_layers", minimum=0)
    if m.pipeline_model_parallel_size != 1:
        errors.append(f"pipeline_model_parallel_size must be 1 (the looped GPT has no "
                      f"pipeline parallelism), got {m.pipeline_model_parallel_size}")
    if m.bf16 and m.fp16:
        errors.append("bf16 and fp16 are both set; choose one")
    if m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads:
        errors.append(f"hidden_size ({m.hidden_size}) must be divisible by "
                      f"num_attention_heads ({m.num_attention_heads})")
    groups = m.num_query_groups or m.num_attention_heads
    if groups < 1 or m.num_attention_heads % groups:
        errors.append(f"num_attention_heads ({m.num_attention_heads}) must be divisible by "
                      f"num_query_groups ({groups})")
    if m.tensor_model_parallel_size >= 1 and world_size % m.tensor_model_parallel_size:
        errors.append(f"world size ({world_size}) must be divisible by "
                      f"tensor_model_parallel_size ({m.tensor_model_parallel_size})")
    return errors


def _check_batches(cfg: RunConfig, world_size: int) -> list[str]:
    t, group = cfg.training, cfg.rl.rl_group_size
    errors = _positive(t, "micro_batch_size", "global_batch_size")
    errors += _positive(cfg.rl, "rl_group_size")
    errors += _positive(cfg.shared_prefix, "shared_prefix_wave_size")
    dp = max(world_size // max(cfg.model.tensor_model_parallel_size, 1), 1)
    if errors:
        return errors
    if t.global_batch_size % (dp * group):
        errors.append(f"global_batch_size ({t.global_batch_size}) must be divisible by "
                      f"data-parallel size x rl_group_size ({dp} x {group} = {dp * group})")
    elif (t.global_batch_size // dp) % t.micro_batch_size:
        errors.append(f"responses per rank (global_batch_size / data-parallel size = "
                      f"{t.global_batch_size // dp}) must be divisible by micro_batch_size "
                      f"({t.micro_batch_size})")
    return errors


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
    if t.ddp_bucket_size is not None and t.ddp_bucket_size < 1:
        errors.append(f"ddp_bucket_size must be >= 1 or null, got {t.ddp_bucket_size}")
    return errors


def _check_rl(cfg: RunConfig) -> list[str]:
    rl = cfg.rl
    errors = _positive(rl, "rl_max_response_length", "rl_ppo_epochs", "rl_eval_prompts")
    errors += _positive(rl, "rl_warmup_sft_steps", "rl_eval_every", "rl_kl_coef", minimum=0)
    errors += _positive(cfg.logging, "save_interval", minimum=0)
    errors += _positive(cfg.logging, "log_interval")
    for k in ("rl_clip_low", "rl_clip_high", "rl_temperature"):
        if getattr(rl, k) <= 0:
            errors.append(f"{k} must be > 0, got {getattr(rl, k)}")
    if not 0 < rl.rl_top_p <= 1:
        errors.append(f"rl_top_p must be in (0, 1], got {rl.rl_top_p}")
    if rl.rl_advantage != "none" and rl.rl_group_size == 1:
        errors.append(f"rl_advantage {rl.rl_advantage!r} needs rl_group_size >= 2 "
                      "(a group of one has zero advantage)")
    return errors + _check_task(cfg)


def _check_task(cfg: RunConfig) -> list[str]:
    from scalerlt_mcore.rl.tasks import get_task

    try:
        task = get_task(cfg.rl.rl_task, **cfg.rl.rl_task_options)
    except ValueError as e:
        return [f"rl_task / rl_task_options: {e}"]
    errors = []
    if cfg.rl.rl_max_response_length < task.max_answer_chars:
        errors.append(f"rl_max_response_length ({cfg.rl.rl_max_response_length}) is shorter "
                      f"than the task's longest answer ({task.max_answer_chars})")
    needed = 1 + task.max_prompt_chars + cfg.rl.rl_max_response_length
    if cfg.model.max_position_embeddings < needed:
        errors.append(f"max_position_embeddings ({cfg.model.max_position_embeddings}) must be "
                      f">= bos + longest prompt + rl_max_response_length ({needed})")
    return errors
