"""The run's config: the sections in one ``RunConfig``, the flat key table, and ``validate``
(each section's check, which lives beside its section)."""

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .library import to_dict
from .logs import LoggingArgs, check_logging
from .model import ModelArgs, check_model
from .rl import RLArgs, check_rl
from .shared_prefix import SharedPrefixArgs, check_shared_prefix
from .tokenizer import TokenizerArgs, check_tokenizer
from .training import TrainingArgs, check_training
from .values import ConfigError, choices, coerce


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


CHOICES = {k: choices(tp) for k, (_, tp) in KEYS.items() if choices(tp)}
"""Allowed values of each key that is a choice (a ``Literal`` field)."""


def validate(cfg: RunConfig, world_size: int, gpu: Optional[bool] = None) -> None:
    """Every check, run once: each key's type, then each section's check (the library objects
    the run builds, their own checks reported with the keys' names, and the app's cross-field
    checks). Raises one ConfigError listing all problems. Needs no process group: run it
    before creating one. ``gpu``: the run is on GPUs (default: whether this host has one)."""
    gpu = torch.cuda.is_available() if gpu is None else gpu
    errors = _check_types(cfg)
    if not errors:
        errors = (check_model(cfg, world_size) + check_training(cfg, world_size)
                  + check_rl(cfg) + check_shared_prefix(cfg, gpu) + check_tokenizer(cfg)
                  + check_logging(cfg))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def _check_types(cfg: RunConfig) -> list[str]:
    """Each value has its key's type (a choice: one of its values). ``parse_args`` checked
    what it read; this catches values set in Python."""
    errors = []
    for key, value in to_dict(cfg).items():
        try:
            coerce(key, value, KEYS[key][1], cli=False)
        except ConfigError as e:
            errors.append(str(e))
    return errors
