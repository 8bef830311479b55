"""``make gpu-check`` on CPU: its dry run (the same steps up to the first CUDA call), the
wheelhouse installer (pip into a throwaway prefix, or unpacking where the Python has no pip)
on a wheel built here, and the version rules that decide what to install."""

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_dry_run_runs_every_step_up_to_cuda(tmp_path):
    """CUDA tests collected and skipped with their reason, the benchmark's dry run written."""
    cmd = [sys.executable, "tools/gpu_check.py", "--dry-run", "--only", "A",
           "--work", str(tmp_path), "--wheelhouse", str(tmp_path / "no-wheelhouse")]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = run.stdout
    assert run.returncode == 0, f"{out[-3000:]}\n{run.stderr[-3000:]}"
    assert "installing from the wheelhouse: nothing (all present)" in out
    assert "needs a CUDA GPU" in out and re.search(r"\d+ skipped", out)
    assert not re.search(r"\d+ (passed|failed)", out)  # every CUDA test skipped on CPU
    assert "CUDA tests: ok" in out and "GPU benchmark: ok" in out
    assert "gpu-check (dry run): all steps passed" in out
    assert (tmp_path / "dry-run" / "gpu.json").is_file()
    assert "## Targets" in (tmp_path / "dry-run" / "gpu.md").read_text()


def _fake_wheel(folder: Path, name: str = "scalerlt_fakedep", version: str = "1.0") -> Path:
    """A minimal pure-Python wheel: one module and its dist-info."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 42\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
    return path


def _imports_fakedep(python: str, paths: list) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
    run = subprocess.run([python, "-c", "import scalerlt_fakedep as m; print(m.VALUE)"],
                         capture_output=True, text=True, env=env, timeout=60)
    return run.stdout.strip() or run.stderr


@pytest.mark.parametrize("with_pip", [True, False], ids=["pip", "unpack"])
def test_install_from_the_wheelhouse_into_a_prefix(tmp_path, with_pip):
    house = tmp_path / "house"
    house.mkdir()
    _fake_wheel(house)
    wheel = gpu_check.Wheel("scalerlt-fakedep", "1.0")
    assert gpu_check.needed([wheel]) == [wheel]
    python = sys.executable
    if not with_pip:  # a Python without pip: a venv made without it
        subprocess.run([sys.executable, "-m", "venv", "--without-pip",
                        "--system-site-packages", str(tmp_path / "venv")], check=True)
        python = str(tmp_path / "venv" / "bin" / "python")
    paths = gpu_check.install([wheel], house, tmp_path / "prefix", python=python)
    assert paths and all(tmp_path / "prefix" in p.parents for p in paths)
    assert _imports_fakedep(python, paths) == "42"


def test_missing_wheel_names_the_package_and_the_command(tmp_path):
    with pytest.raises(SystemExit, match=r"megatron-core==0.16.1 .* run `make wheelhouse`"):
        gpu_check.install([gpu_check.WHEELS[0]], tmp_path, tmp_path / "prefix")


def test_version_rules():
    assert gpu_check.version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert gpu_check.version_tuple("0.16.1rc2") == (0, 16, 1)
    Wheel = gpu_check.Wheel
    assert gpu_check.needed([Wheel("pytest", "9.2.0", "8.0")]) == []  # present and new enough
    too_old = Wheel("pytest", "999.0", "999.0")
    exact = Wheel("pytest", "0.1")  # no minimum: only the pinned version will do
    assert gpu_check.needed([too_old, exact]) == [too_old, exact]
    assert {w.dist for w in gpu_check.WHEELS} >= {"megatron-core", "pytest", "pytest-timeout"}
