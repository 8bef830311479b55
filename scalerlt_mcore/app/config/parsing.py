"""Reading a run's config: the flat YAML file, the command line and the help.

Precedence: dataclass defaults < YAML file < command line. Without ``--config`` the YAML file
is the packaged demo (``scalerlt_mcore/configs/demo_cpu.yaml``, a tiny CPU run). The file is
**flat**, one Megatron-style key per line (``num_layers: 2``), the same names as the flags
(``--num-layers 2``); a grouped file (``model: {num_layers: 2}``) is rejected. Unknown keys
are errors naming the key, with the closest known one. docs/config.md says why this is
written here rather than taken from a library."""

import dataclasses
import difflib
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Optional

import yaml

from .library import field_docs, to_dict
from .run import KEYS, SECTIONS, RunConfig
from .values import BOOLS, ConfigError, coerce, type_name

DEMO_CONFIG = "demo_cpu.yaml"
"""The packaged config used when no ``--config`` is given."""


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
        setattr(getattr(cfg, section), key, coerce(key, value, tp, cli))
    return cfg


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
            if takes_value or nxt.lower() in BOOLS:
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
            lines.append(f"  {_flag(key)} {type_name(KEYS[key][1])} ({default}): {doc}")
    return "\n".join(lines)
