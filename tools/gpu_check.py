"""The GPU acceptance check: ``make gpu-check`` (and ``make wheelhouse``, which fills the
wheelhouse it installs from).

Runs on a machine with one CUDA GPU and no network whose ``python3`` holds a CUDA build of
torch (DESIGN.md section 8). It never creates the CPU virtual environment:

1. packages: megatron-core and any missing pure-Python dependency (the test runner among them)
   are installed from the git-ignored wheelhouse ``.wheelhouse/`` into the git-ignored prefix
   ``.gpu-check/prefix`` (``pip install --no-index --find-links``; unpacked when that Python
   has no pip), which goes on PYTHONPATH; what the machine already has is used as it is;
2. the CUDA tests: ``pytest -m cuda tests/test_cuda.py``;
3. the GPU benchmark, workloads A and B, hidden 1024, bf16:
   ``benchmarks/results/gpu.json`` and ``gpu.md``.

``GPU_CHECK_DRY_RUN=1`` (or ``--dry-run``): the same steps on a CPU machine with the project's
.venv, up to the first CUDA call: packages resolved (nothing to install), the CUDA tests
collected and skipped, the benchmark's ``--dry-run`` (outputs under ``.gpu-check/dry-run``).

    python3 tools/gpu_check.py wheelhouse     # on a machine with package access
    python3 tools/gpu_check.py [--dry-run]    # the check
"""

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = ROOT / ".wheelhouse"
WORK = ROOT / ".gpu-check"
PLATFORM = ("--python-version", "3.12", "--platform", "manylinux_2_28_x86_64")


@dataclass(frozen=True)
class Wheel:
    """A package the check installs from the wheelhouse when the machine lacks it."""

    dist: str
    """Distribution name."""
    pinned: str
    """The version the wheelhouse holds."""
    minimum: str = ""
    """Oldest installed version that will do ("" : only the pinned one)."""


WHEELS = (
    Wheel("megatron-core", "0.16.1"),
    Wheel("packaging", "26.4", "24.2"),  # megatron-core needs >= 24.2
    Wheel("pytest", "9.2.0", "8.0"),
    Wheel("pluggy", "1.7.0", "1.5"),
    Wheel("iniconfig", "2.3.1", "1.0"),
    Wheel("pygments", "2.21.0", "2.7.2"),
    Wheel("pytest-timeout", "2.4.0", "2.0"),
)
ON_THE_MACHINE = ("torch", "numpy", "yaml", "tqdm", "psutil", "matplotlib")
"""Modules the check machine brings (binary wheels, not in the wheelhouse)."""


def version_tuple(version: str) -> tuple:
    """The leading numeric release of a version string: '2.11.0+cu130' -> (2, 11, 0)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() < len(piece):  # '1rc2': the release ends here
            break
    return tuple(parts)


def needed(wheels=WHEELS) -> list:
    """The wheels whose distribution is absent or too old in this interpreter."""
    out = []
    for w in wheels:
        try:
            have = importlib.metadata.version(w.dist)
        except importlib.metadata.PackageNotFoundError:
            out.append(w)
            continue
        ok = (version_tuple(have) >= version_tuple(w.minimum) if w.minimum
              else version_tuple(have) == version_tuple(w.pinned))
        if not ok:
            out.append(w)
    return out


def wheel_file(w: Wheel, wheelhouse: Path) -> Path:
    stem = f"{w.dist.replace('-', '_').lower()}-{w.pinned}-"
    found = sorted(p for p in wheelhouse.glob("*.whl") if p.name.lower().startswith(stem))
    if not found:
        raise SystemExit(f"gpu-check: {w.dist}=={w.pinned} is not installed and not in "
                         f"{wheelhouse}: run `make wheelhouse` on a machine with package "
                         f"access and bring the folder along")
    return found[-1]


def install(wheels: list, wheelhouse: Path, prefix: Path, python: str = sys.executable) -> list:
    """Install ``wheels`` (no dependencies, nothing from an index) into ``prefix``; returns
    the folders to put on PYTHONPATH."""
    if not wheels:
        return []
    files = [wheel_file(w, wheelhouse) for w in wheels]
    has_pip = subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode
    if has_pip == 0:
        subprocess.run([python, "-m", "pip", "install", "--no-index", "--find-links",
                        str(wheelhouse), "--no-deps", "--ignore-installed", "--prefix",
                        str(prefix), "--no-warn-script-location", "--disable-pip-version-check",
                        "-q", *[str(f) for f in files]], check=True)
    else:  # a wheel is a zip of the site-packages tree
        print(f"gpu-check: {python} has no pip; unpacking the wheels into {prefix}/site")
        for f in files:
            zipfile.ZipFile(f).extractall(prefix / "site")
    return sorted({p.parent for p in prefix.rglob("*.dist-info")})


def check_machine(dry_run: bool) -> None:
    missing = [m for m in ON_THE_MACHINE if _absent(m)]
    if missing:
        raise SystemExit(f"gpu-check: this Python lacks {', '.join(missing)} (the check "
                         f"machine brings them with its CUDA torch)")
    if dry_run:
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA GPU visible to this Python's torch "
                         f"{torch.__version__} (GPU_CHECK_DRY_RUN=1 runs the CPU dry run)")
    print(f"gpu-check: torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)


def _absent(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def steps(dry_run: bool, only: str, work: Path = WORK) -> list:
    """(name, command, timeout s) of the check's steps."""
    py = sys.executable
    tests = [py, "-m", "pytest", "-q", "-rs", "-m", "cuda", "tests/test_cuda.py",
             "-p", "no:cacheprovider"]
    out = work / "dry-run" / "gpu.json" if dry_run else ROOT / "benchmarks/results/gpu.json"
    bench = [py, "-m", "benchmarks.gpu", "--only", only, "--hidden", "1024", "--out", str(out)]
    if dry_run:
        bench += ["--dry-run", "--reps", "1", "--warmup", "0"]
    return [("CUDA tests", tests, 360), ("GPU benchmark", bench, 420)]


def run(dry_run: bool, only: str = "A,B", wheelhouse: Path = WHEELHOUSE,
        work: Path = WORK) -> int:
    t0 = time.perf_counter()
    check_machine(dry_run)
    todo = needed()
    print("gpu-check: installing from the wheelhouse: "
          + (", ".join(f"{w.dist}=={w.pinned}" for w in todo) or "nothing (all present)"),
          flush=True)
    paths = install(todo, wheelhouse, work / "prefix")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*map(str, paths), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    failed = []
    for name, cmd, timeout in steps(dry_run, only, work):
        start = time.perf_counter()
        print(f"\n== gpu-check: {name}: {' '.join(cmd[1:])}", flush=True)
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout} s"
        print(f"== gpu-check: {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    total = time.perf_counter() - t0
    print(f"\ngpu-check{' (dry run)' if dry_run else ''}: "
          f"{'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'} in {total:.0f} s")
    return 1 if failed else 0


def fill_wheelhouse(wheelhouse: Path = WHEELHOUSE) -> int:
    """Download every wheel of ``WHEELS`` for the check machine (CPython 3.12, x86_64)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           *PLATFORM, "-d", str(wheelhouse), *[f"{w.dist}=={w.pinned}" for w in WHEELS]]
    return subprocess.run(cmd).returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=("check", "wheelhouse"), default="check")
    p.add_argument("--dry-run", action="store_true",
                   default=os.environ.get("GPU_CHECK_DRY_RUN", "") not in ("", "0"),
                   help="CPU dry run (default from GPU_CHECK_DRY_RUN)")
    p.add_argument("--only", default="A,B", help="benchmark workloads (default A,B)")
    p.add_argument("--wheelhouse", type=Path, default=WHEELHOUSE, help="default .wheelhouse")
    p.add_argument("--work", type=Path, default=WORK,
                   help="install prefix and dry-run outputs (default .gpu-check)")
    args = p.parse_args(argv)
    if args.command == "wheelhouse":
        return fill_wheelhouse(args.wheelhouse)
    return run(args.dry_run, args.only, args.wheelhouse, args.work)


if __name__ == "__main__":
    sys.exit(main())
