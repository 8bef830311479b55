"""Build a test environment with another megatron-core than `.venv`'s: `make test-mcore`.

megatron-core 0.17 and later declare Python >= 3.12 and publish only cp312 wheels, while a
machine may have an older Python (this project's CI has 3.11). Their Python sources run on 3.11
(the parts this project imports do; the wheel's one compiled extension, the datasets index
helper, is not used here), so this script makes `.venv-mcore<version>` with the machine's
python3 and:

1. installs the CPU torch wheel (`torch==2.13.0`, as `make test`), triton (imported by MCore
   0.19's inference code at import time) and the project's dependencies and test extras, less
   megatron-core;
2. downloads that megatron-core's cp312 wheel without its dependencies and unpacks its Python
   sources and metadata into the venv's site-packages (compiled `.so` files left out);
3. installs the project itself, editable, without dependencies.

Usage: ``python3 tools/mcore_env.py VERSION VENV``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU wheel, as `make test` installs; never an unpinned torch
TRITON = "triton==3.8.0"


def project_requirements() -> list[str]:
    """pyproject.toml's dependencies and test extras, less megatron-core."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    return [r for r in wanted if re.split(r"[\s\[<>=!~;]", r)[0] != "megatron-core"]


def pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args],
                   check=True)


def site_packages(venv: Path) -> Path:
    """The venv's purelib directory, as its own interpreter reports it."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True,
                         capture_output=True, text=True).stdout
    return Path(out.strip())


def download_wheel(venv: Path, version: str, into: Path) -> Path:
    """megatron-core `version`'s CPython 3.12 wheel for this platform, no dependencies."""
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "download", "-q", "--no-deps",
                    "--python-version", "3.12", "--only-binary=:all:", "-d", str(into),
                    f"megatron-core=={version}"], check=True)
    (wheel,) = into.glob(f"megatron_core-{version}-*.whl")
    return wheel


def unpack_sources(wheel: Path, site: Path) -> int:
    """Extract every member of `wheel` but compiled extensions into `site`; the count."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if not m.endswith(".so")]
        zf.extractall(site, members)
    return len(members)


def main(version: str, venv: Path) -> None:
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip(venv, TORCH, TRITON)
    pip(venv, *project_requirements())
    wheel = download_wheel(venv, version, venv / "wheels")
    site = site_packages(venv)
    count = unpack_sources(wheel, site)
    print(f"mcore_env: unpacked {count} files of {wheel.name} into {site}")
    pip(venv, "--no-deps", "-e", str(ROOT))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python3 tools/mcore_env.py VERSION VENV")
    main(sys.argv[1], Path(sys.argv[2]).resolve())
