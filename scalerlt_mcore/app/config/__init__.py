"""The run's configuration, one module per job:

- ``model.py``, ``training.py``, ``shared_prefix.py``, ``rl.py``, ``tokenizer.py``,
  ``logs.py``: the sections (dataclasses with a docstring per key), each with its check;
- ``run.py``: ``RunConfig`` (the sections), the flat key table (``KEYS``) and ``validate``;
- ``parsing.py``: defaults < flat YAML file < Megatron-style command line, and the help;
- ``values.py``: one value read as its key's type; ``ConfigError``;
- ``library.py``: the sections' help (their fields' docstrings), the maps from key to library
  field and the library's errors (``FieldError``) in the keys' names;
- ``builders.py``: one builder per library object (``model_config``, ``objective_from``,
  ``schedule_from``, ``sampling_from``, ``task_from``, ``tokenizer_from``).

    cfg = parse_args(["--config", "configs/cpu_2rank.yaml", "--lr", "1e-3"])
    validate(cfg, world_size)          # every check, once, before any process group exists
    save_resolved(cfg, run_dir)        # run_dir/config.yaml, re-loadable with --config
"""

from .builders import (
    eval_prompts,
    library_kwargs,
    looped_kwargs,
    model_config,
    objective_from,
    pretrained_tokenizer_json,
    prompts_per_step,
    sampling_from,
    schedule_from,
    task_from,
    tokenizer_args,
    tokenizer_from,
)
from .library import (
    OBJECTIVE_FLAGS,
    SAMPLING_FLAGS,
    SCHEDULE_FLAGS,
    field_docs,
    in_key_names,
    to_dict,
)
from .logs import LoggingArgs
from .model import ModelArgs
from .parsing import (
    DEMO_CONFIG,
    apply_overrides,
    cli_flags,
    default_run_dir,
    demo_config_text,
    help_text,
    load_config,
    parse_args,
    read_yaml,
    save_resolved,
    split_cli,
)
from .rl import RLArgs
from .run import CHOICES, KEYS, SECTIONS, RunConfig, validate
from .shared_prefix import SharedPrefixArgs
from .tokenizer import TokenizerArgs
from .training import TrainingArgs
from .values import ConfigError, choices

__all__ = [
    "CHOICES", "DEMO_CONFIG", "KEYS", "OBJECTIVE_FLAGS", "SAMPLING_FLAGS", "SCHEDULE_FLAGS",
    "SECTIONS", "ConfigError", "LoggingArgs", "ModelArgs", "RLArgs", "RunConfig",
    "SharedPrefixArgs", "TokenizerArgs", "TrainingArgs", "apply_overrides", "choices",
    "cli_flags", "default_run_dir", "demo_config_text", "eval_prompts", "field_docs",
    "help_text", "in_key_names", "library_kwargs", "load_config", "looped_kwargs",
    "model_config", "objective_from", "parse_args", "pretrained_tokenizer_json",
    "prompts_per_step", "read_yaml", "sampling_from", "save_resolved", "schedule_from",
    "split_cli", "task_from", "to_dict", "tokenizer_args", "tokenizer_from", "validate",
]
