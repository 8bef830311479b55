"""Run and checkpoint directories: created (or checked) before any training, so that a path
that cannot be written is one clear error at start, and every run gets a directory of its own.
"""

import itertools
import os
from pathlib import Path

from .config import ConfigError, default_run_dir


def check_writable(path, key: str) -> Path:
    """Create directory ``path`` (and its parents) if needed and write a probe file in it; a
    directory that cannot be written raises a ``ConfigError`` naming the key (``save``,
    ``run_dir``)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}: cannot write to {path} ({e.strerror or e})") from None
    return path


def make_run_dir(requested=None, previous=None) -> Path:
    """The run's directory, created: ``requested`` (``--run-dir``) as given; else, when
    resuming, the checkpoint's run directory ``previous`` if it still exists (its metrics go
    on); else a new ``runs/<timestamp>``, suffixed ``-2``, ``-3``, ... when that name is taken.
    A new directory is created atomically, so runs started in the same second get one each."""
    if requested or (previous and Path(previous).is_dir()):
        return check_writable(requested or previous, "run_dir")
    base = default_run_dir()
    for n in itertools.count(1):
        path = Path(base if n == 1 else f"{base}-{n}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"run_dir: cannot create {path} ({e.strerror or e})") from None
        return path
