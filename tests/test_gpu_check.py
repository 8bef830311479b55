"""``make gpu-check`` on CPU: its dry run through make (every stage, every output file), a
missing wheelhouse failing at once, a kernel case that crashes its process rerun alone with
``CUDA_LAUNCH_BLOCKING=1``, the wheelhouse installer (pip into a throwaway prefix, or unpacking
where the Python has no pip) on a wheel built here and the megatron-core choice; and the GPU
benchmark's fp32 agreement check (a whole-gradient bound; on a failure the JSON still written,
with the errors) and time budget."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
if str(ROOT) not in sys.path:  # `pytest` without `python -m`: the repo root holds benchmarks/
    sys.path.insert(0, str(ROOT))

ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _json(path: Path):
    return json.loads(path.read_text())


MCORE_HERE = importlib.metadata.version("megatron-core")
MCORE_ELSEWHERE = next(v for v in gpu_check.MCORE_VERSIONS if v != MCORE_HERE)


def test_dry_run_through_make_writes_every_file(tmp_path):
    """GPU_CHECK_DRY_RUN=1 make gpu-check OUT=dir: the four stages pass, the
    seven files (and nothing else) are written; every kernel case ran within its bound, on CPU,
    with its CUDA kernel on meta; the CUDA tests were collected and skipped; the benchmark and
    decode ran; the requested megatron-core was the one imported."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = ["make", "-s", "gpu-check", "GPU_CHECK_DRY_RUN=1", f"OUT={out}", f"MCORE={MCORE_HERE}",
           f"GPU_CHECK_PY={sys.executable}",
           f"GPU_CHECK_ARGS=--work {work} --wheelhouse {tmp_path / 'no-wheelhouse'}"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=560, env=ENV)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert "gpu-check (dry run): all stages passed" in run.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(gpu_check.OUT_FILES)
    assert len(gpu_check.OUT_FILES) <= 7 and all(p.is_file() for p in out.iterdir())

    summary = _json(out / "summary.json")
    assert summary["ok"] is True and summary["dry_run"] is True
    assert [(s["name"], s["rc"]) for s in summary["stages"]] == [
        ("setup", 0), ("kernels", 0), ("tests", 0), ("bench", 0)]
    assert all(s["seconds"] >= 0 for s in summary["stages"])
    cases = summary["kernel_cases"]
    assert len(cases) == 54 and {c.split("-")[0] for c in cases} == {"flash", "efficient",
                                                                      "chain"}
    for cid, c in cases.items():
        assert c["outcome"] == "passed" and c["margin"] > 1, (cid, c)
        assert c["first_run"]["problems"] == [], cid  # incl. the CUDA kernel's run on meta
    tests = summary["tests"]
    assert tests and all(t["outcome"] == "skipped" and "needs a CUDA GPU" in t["reason"]
                         for t in tests)
    assert any("test_main_job_two_steps_on_cuda" in t["name"] for t in tests)

    env = _json(out / "env.json")
    assert env["megatron_core"]["version"] and env["megatron_core"]["path"]
    assert "default" in env["sdpa_op_schemas"]["_scaled_dot_product_flash_attention_backward"]
    assert "flash_sdp_enabled" in env["sdpa_backends"] and env["mcore_requested"] == MCORE_HERE
    assert env["megatron_core"]["version"] == MCORE_HERE

    suites = {s.get("name"): s for s in ET.parse(work / "junit.xml").getroot().iter("testsuite")}
    assert len(suites["gpu-kernel-cases"].findall("testcase")) == 54
    assert "pytest" in suites  # pytest's own suite beside it
    assert "gpu_check_pytest" in (out / "tests.log").read_text()  # the peak-memory plugin

    bench = _json(out / "gpu.json")
    assert bench["meta"]["status"] == "complete" and "schedules" in bench["A"]
    profiled = bench["A"]["profile"]  # where a step's time goes: host ops (and kernels on CUDA)
    assert set(profiled) == {"naive", bench["A"]["joint_variant"]}
    assert all(p["wall_s"] > 0 and p["top_host_ms"] for p in profiled.values())
    assert bench["decode"]["prompt_once"]["tokens_per_s"] > 0
    md = (out / "gpu.md").read_text()
    assert "## Targets" in md and "## Rollout decode" in md and "## Where one step's" in md
    assert summary["bench"]["status"] == "complete"


def test_the_dry_run_imports_the_requested_megatron_core_or_refuses(tmp_path, monkeypatch):
    """The dry run runs under the interpreter holding the requested version (this one, else
    .venv-mcore<version>); with neither it stops naming the fix, and an interpreter that imports
    another version is refused by name, not run."""
    assert gpu_check.dry_run_python(MCORE_HERE) == sys.executable
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match=f"make test-mcore MCORE={MCORE_ELSEWHERE}"):
        gpu_check.dry_run_python(MCORE_ELSEWHERE)
    venv = tmp_path / f".venv-mcore{MCORE_ELSEWHERE}" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    assert gpu_check.dry_run_python(MCORE_ELSEWHERE) == str(venv / "python")

    monkeypatch.undo()
    out = tmp_path / "out"
    rc = gpu_check.main(["--dry-run", "--mcore", MCORE_ELSEWHERE, "--python", sys.executable,
                         "--out", str(out), "--work", str(tmp_path / "work"),
                         "--wheelhouse", str(tmp_path / "none")])
    summary = _json(out / "summary.json")
    assert rc == 1 and summary["ok"] is False and [s["name"] for s in summary["stages"]] == [
        "setup", "env"]
    assert (f"megatron-core {MCORE_ELSEWHERE} was requested but the stages import {MCORE_HERE}"
            in summary["error"])


def test_missing_wheelhouse_fails_at_once_with_the_fix(tmp_path):
    """A megatron-core this Python lacks (0.19.2 in .venv, 0.16.1 in .venv-mcore0.19.2) and no
    wheelhouse: the check stops before any stage, naming the fix."""
    out = tmp_path / "out"
    absent = next(v for v in gpu_check.MCORE_VERSIONS
                  if v != importlib.metadata.version("megatron-core"))
    start = time.monotonic()
    run = subprocess.run([sys.executable, "tools/gpu_check.py", "--out", str(out), "--mcore",
                          absent, "--wheelhouse", str(tmp_path / "none"), "--work",
                          str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True,
                         timeout=400, env=ENV)
    assert run.returncode == 1
    assert f"megatron-core=={absent} is not installed" in run.stderr
    assert "make wheelhouse" in run.stderr and "ignored paths that travel" in run.stderr
    summary = _json(out / "summary.json")
    assert summary["ok"] is False and "make wheelhouse" in summary["error"]
    assert time.monotonic() - start < 60  # no stage ran


FAKE_CASES = """
import json, os, sys
ids = sys.argv[sys.argv.index("--cases") + 1].split(",")
blocking = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
for cid in ids:
    if cid.endswith("crash"):
        print(json.dumps({"case": cid, "ok": False,
                          "raised": "illegal memory access" + (" (blocking)" if blocking else "")}))
        sys.exit(1)
    print(json.dumps({"case": cid, "ok": True, "margin": 3.0, "worst": 0.1, "bound": 0.3,
                      "seconds": 0.1, "blocking": blocking}))
"""


def test_crashing_case_and_the_cases_after_it_rerun_alone_with_launch_blocking(tmp_path,
                                                                                monkeypatch):
    fake = tmp_path / "fake_cases.py"
    fake.write_text(FAKE_CASES)
    monkeypatch.setattr(gpu_check, "_case_cmd",
                        lambda py, ids, dry: [py, str(fake), "--cases", ",".join(ids)])
    ids = ["flash-bf16-a", "flash-bf16-crash", "flash-bf16-c"]  # one batch: one process
    monkeypatch.setattr(gpu_check, "case_ids", lambda: ids)
    with open(tmp_path / "kernels.log", "w") as log:
        rc, cases = gpu_check.kernel_stage(sys.executable, dict(os.environ), log, False, 60)
    a, crash, c = (cases[i] for i in ids)
    assert rc == 1
    assert a["outcome"] == "passed" and "rerun_cuda_launch_blocking" not in a
    assert crash["outcome"] == "failed"
    assert crash["rerun_cuda_launch_blocking"]["raised"].endswith("(blocking)")
    assert c["first_run"]["ok"] is None  # its process ended before it
    assert c["outcome"] == "passed" and c["rerun_cuda_launch_blocking"]["blocking"] is True


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


def test_a_rerun_with_another_version_leaves_only_that_version_in_the_prefix(tmp_path):
    """MCORE=0.16.1 after a 0.19.2 run: the prefix holds one version (two dist-infos would
    leave the installed version to chance)."""
    house = tmp_path / "house"
    house.mkdir()
    for version in ("1.0", "2.0"):
        _fake_wheel(house, version=version)
    for version in ("2.0", "1.0"):
        paths = gpu_check.install([gpu_check.Wheel("scalerlt-fakedep", version)], house,
                                  tmp_path / "prefix")
    infos = sorted(p.name for p in (tmp_path / "prefix").rglob("*.dist-info"))
    assert infos == ["scalerlt_fakedep-1.0.dist-info"] and paths


@pytest.mark.parametrize("mcore", ["0.19.2", "0.16.1"])
def test_the_chosen_megatron_core_is_installed_from_the_wheelhouse(tmp_path, mcore):
    """MCORE picks the megatron-core wheel; another version, or one not in the wheelhouse,
    is an error naming the fix."""
    wanted = gpu_check.wheels(mcore)
    assert wanted[0] == gpu_check.Wheel("megatron-core", mcore)
    (tmp_path / f"megatron_core-{mcore}-cp312-cp312-manylinux_2_28_x86_64.whl").touch()
    assert gpu_check.wheel_file(wanted[0], tmp_path).name.startswith(f"megatron_core-{mcore}-")
    other = gpu_check.wheels("0.16.1" if mcore == "0.19.2" else "0.19.2")[0]
    with pytest.raises(SystemExit, match=rf"megatron-core=={other.pinned} .* `make wheelhouse`"):
        gpu_check.wheel_file(other, tmp_path)
    with pytest.raises(SystemExit, match=r"0\.18\.0 is not in the wheelhouse; choose one of "
                                         r"0\.19\.2, 0\.16\.1"):
        gpu_check.wheels("0.18.0")


def test_dry_run_checks_a_present_wheelhouse_and_installs_nothing(tmp_path):
    import argparse

    wheel = tmp_path / "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl"
    wheel.touch()
    args = argparse.Namespace(mcore="0.19.2", dry_run=True, wheelhouse=tmp_path,
                              work=tmp_path / "work", python=sys.executable)
    summary = gpu_check.Summary(tmp_path / "summary.json", True, "0.19.2", 10)
    py, env = gpu_check.setup(args, summary)
    assert py == sys.executable
    installed = importlib.metadata.version("megatron-core")
    note = summary.doc["setup"]["note"]
    assert summary.doc["setup"]["installed"] == [] and not (tmp_path / "work").exists()
    assert (str(wheel) in note) == (installed != "0.19.2")  # named where it would install
    assert str(ROOT / "tools") in env["PYTHONPATH"].split(os.pathsep)
    wheel.unlink()  # a wheelhouse without the chosen wheel: the GPU machine would fail
    if installed != "0.19.2":
        with pytest.raises(SystemExit, match="megatron-core==0.19.2"):
            gpu_check.setup(args, summary)


def test_wheelhouse_downloads_both_megatron_core_wheels_for_cpython_312():
    cmds = gpu_check.wheelhouse_commands(Path("/tmp/house"))
    mcore = [c[-1] for c in cmds if c[-1].startswith("megatron-core==")]
    assert mcore == ["megatron-core==0.19.2", "megatron-core==0.16.1"]  # one pip call each
    for c in cmds:
        assert {"download", "--no-deps", "--only-binary=:all:"} <= set(c)
        assert c[c.index("--python-version") + 1] == "3.12" and "/tmp/house" in c
    assert any("pytest-timeout==" in a for c in cmds for a in c)


def test_version_rules():
    assert gpu_check.version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert gpu_check.version_tuple("0.16.1rc2") == (0, 16, 1)
    Wheel = gpu_check.Wheel
    assert gpu_check.needed([Wheel("pytest", "9.2.0", "8.0")]) == []  # present and new enough
    too_old = Wheel("pytest", "999.0", "999.0")
    exact = Wheel("pytest", "0.1")  # no minimum: only the pinned version will do
    assert gpu_check.needed([too_old, exact]) == [too_old, exact]
    assert {w.dist for w in gpu_check.WHEELS} >= {"megatron-core", "pytest", "pytest-timeout"}


# ---- the GPU benchmark's agreement check and time budget --------------------------------------

class _TwoTensors(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(4))
        self.norm = torch.nn.Parameter(torch.zeros(4))  # a gradient that cancels to ~1e-6


def _setting(model, big: float, norm: float):
    def step():
        model.big.grad = torch.full((4,), big)
        model.norm.grad = torch.full((4,), norm)
        return torch.tensor(1.0)

    return step


def test_agreement_bounds_the_whole_gradient_not_each_tensor():
    """A cancelling gradient of 1e-6 off by 1e-3 of itself (its kernels' summation order) is
    1e-9 of the gradient's largest entry: within 1e-5 over the whole gradient, though 1e-3
    per tensor; 1e-4 off on the largest entry is not."""
    from benchmarks.measure import AgreementError, check_agreement

    model = _TwoTensors()
    naive = _setting(model, 1.0, 1e-6)
    errors = check_agreement({"naive": naive, "joint": _setting(model, 1.0, 1e-6 * 1.001)},
                             model)
    assert errors["joint"]["grad"] == pytest.approx(1e-9, rel=1e-3)
    assert errors["joint"]["worst_tensor"] == "norm"
    assert errors["joint"]["worst_tensor_error"] == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(AgreementError, match="joint disagrees with naive") as err:
        check_agreement({"naive": naive, "joint": _setting(model, 1.0001, 1e-6)}, model)
    assert err.value.errors["joint"]["grad"] == pytest.approx(1e-4, rel=1e-3)


def test_benchmark_writes_its_json_with_the_errors_when_schedules_disagree(tmp_path):
    """Tolerance 0: fp32 rounding differs between the schedules, so the check fails; the JSON
    and markdown are still written, with every schedule's measured errors, and the exit
    status is 2."""
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--only", "A",
                          "--reps", "1", "--warmup", "0", "--tolerance", "0", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=560, env=ENV)
    assert run.returncode == 2, run.stderr[-3000:]
    doc = _json(out)
    assert doc["meta"]["status"] == "failed" and "disagree" in doc["meta"]["error"]
    agreement = doc["A"]["agreement"]
    assert agreement and all("grad" in e and "loss" in e for e in agreement.values())
    assert max(e["grad"] for e in agreement.values()) > 0
    assert "**failed**" in out.with_suffix(".md").read_text()


def test_timed_repetitions_shrink_to_the_time_budget(monkeypatch):
    import contextlib

    from benchmarks import measure
    from benchmarks.gpu import timed_rounds
    from benchmarks.workloads import Workload

    monkeypatch.setattr(measure, "gc_paused", contextlib.nullcontext)  # no collections: fast
    wl = Workload("A", group_size=2, prompt_length=4, response_length=2, wave_size=1,
                  repetitions=6)
    steps = {"a": lambda: time.sleep(0.01), "b": lambda: time.sleep(0.01)}
    assert [len(t) for t in timed_rounds(steps, wl, 1, None, budget_s=0.0).values()] == [1, 1]
    assert [len(t) for t in timed_rounds(steps, wl, 0, None, budget_s=None).values()] == [6, 6]
    assert [len(t) for t in timed_rounds(steps, wl, 0, None, budget_s=60.0).values()] == [6, 6]
