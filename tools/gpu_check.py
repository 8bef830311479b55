"""The GPU acceptance check: ``make gpu-check OUT=dir`` (and ``make wheelhouse``, which fills
the wheelhouse it installs from).

One command on a machine with one CUDA GPU and no network whose ``python3`` holds a CUDA build
of torch; it never creates the CPU virtual environment, and writes everything under ``--out``
(seven files, no folders, so that a ``tee`` log fits a machine that returns eight):
``env.json``, one log per stage (``kernels.log``, ``tests.log``, ``bench.log``), ``gpu.json`` /
``gpu.md`` and ``summary.json``; pytest's JUnit XML stays in ``--work``.

0. setup: megatron-core ``--mcore`` (0.19.2 by default, or 0.16.1) and any missing pure-Python
   package (the test runner among them) from the git-ignored wheelhouse ``.wheelhouse/``
   (``pip install --no-index``; unpacked when that Python has no pip) into the git-ignored
   prefix ``.gpu-check/prefix``, put on PYTHONPATH; a missing wheel fails at once, naming
   ``make wheelhouse``. Then ``env.json``: versions, GPU, SDPA op schemas and backend flags;
1. kernels: the CUDA cascade kernel cases of ``tools/gpu_kernel_cases.py``, a few processes
   at once, each case that fails (or did not run after a case crashed its process) rerun
   alone with ``CUDA_LAUNCH_BLOCKING=1``;
2. tests: ``pytest -m cuda`` (per-test timeout, ``-rA``, durations, JUnit, each test's peak
   GPU memory through ``tools/gpu_check_pytest.py``);
3. bench: ``benchmarks/gpu.py`` (workload A by default, hidden 1024, bf16, within the time
   left, and the rollout decode micro-benchmark).

``summary.json`` (each stage's return code and duration, each case's and test's outcome and
margin) is rewritten after every stage; the whole run keeps within ``--budget-s`` (330 s: with
a machine's start, two runs fit 15 minutes of GPU time; the dry run 600 s).

``GPU_CHECK_DRY_RUN=1`` (or ``--dry-run``): the same stages on a CPU machine under the
interpreter that holds the requested megatron-core (this one, or ``.venv-mcore<version>``, which
``make test-mcore MCORE=<version>`` builds): nothing installed (the wheelhouse, where present,
is checked), the kernel cases at
smaller sizes on the CPU fused kernel against the same reference with the CUDA kernels on
``meta``, the CUDA tests collected and skipped, the benchmark's ``--dry-run``.

    python3 tools/gpu_check.py wheelhouse                  # on a machine with package access
    python3 tools/gpu_check.py --out DIR [--mcore 0.16.1] [--dry-run]     # the check
"""

import argparse
import concurrent.futures
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
WHEELHOUSE = ROOT / ".wheelhouse"
WORK = ROOT / ".gpu-check"
MCORE_VERSIONS = ("0.19.2", "0.16.1")
"""The megatron-core versions the wheelhouse holds; the first is the default."""
PLATFORM = ("--python-version", "3.12", "--implementation", "cp", "--platform",
            "manylinux_2_28_x86_64")
OUT_FILES = ("env.json", "kernels.log", "tests.log", "bench.log", "gpu.json", "gpu.md",
             "summary.json")
"""Everything the check writes under --out: seven, so that a ``tee`` log beside them fits the
eight files a GPU machine returns."""
BUDGET_S, DRY_RUN_BUDGET_S = 330, 600
"""The whole run's time: 5.5 minutes, so that with a machine's 1-2 minute start a rerun fits
the 15 minutes of GPU time a session gets (the first H200 run took 144 s); the dry run's (a CPU
shared with other jobs)."""
KERNELS_SHARE, TESTS_SHARE, BENCH_MIN_SHARE = 1 / 6, 1 / 2, 2 / 9
"""Of the budget: at most 55 s of 330 for the kernel cases, 165 s for the tests, at least
73 s kept for the benchmark."""
TEST_TIMEOUT_S = 120
FIX = ("run `make wheelhouse` (python3 tools/gpu_check.py wheelhouse) on a machine with package "
       "access, and bring .wheelhouse/ with the working tree (it is git-ignored: name it among "
       "the ignored paths that travel)")


@dataclass(frozen=True)
class Wheel:
    """A package the check installs from the wheelhouse when the machine lacks it."""

    dist: str
    """Distribution name."""
    pinned: str
    """The version the wheelhouse holds."""
    minimum: str = ""
    """Oldest installed version that will do ("" : only the pinned one)."""


SUPPORT = (
    Wheel("packaging", "26.4", "24.2"),  # megatron-core needs >= 24.2
    Wheel("pytest", "9.2.0", "8.0"),
    Wheel("pluggy", "1.7.0", "1.5"),
    Wheel("iniconfig", "2.3.1", "1.0"),
    Wheel("pygments", "2.21.0", "2.7.2"),
    Wheel("pytest-timeout", "2.4.0", "2.0"),
)
"""Pure-Python packages (the test runner and megatron-core's one dependency the machine may
lack); the machine's own are used when new enough."""
ON_THE_MACHINE = ("torch", "numpy", "yaml", "tqdm", "psutil", "matplotlib", "safetensors")
"""Modules the check machine brings (binary wheels, not in the wheelhouse)."""


def wheels(mcore: str = MCORE_VERSIONS[0]) -> tuple:
    """What the check needs: megatron-core ``mcore`` (exactly) and the support packages."""
    if mcore not in MCORE_VERSIONS:
        raise SystemExit(f"gpu-check: megatron-core {mcore} is not in the wheelhouse; choose "
                         f"one of {', '.join(MCORE_VERSIONS)} (MCORE=...)")
    return (Wheel("megatron-core", mcore), *SUPPORT)


WHEELS = wheels()


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


def needed(wanted=WHEELS) -> list:
    """The wheels whose distribution is absent or too old (or, pinned, another version) in
    this interpreter."""
    out = []
    for w in wanted:
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
        where = "not in" if wheelhouse.is_dir() else "not installed, and there is no"
        raise SystemExit(f"gpu-check: {w.dist}=={w.pinned} is not installed and {where} "
                         f"{wheelhouse}: {FIX}")
    return found[-1]


def install(todo: list, wheelhouse: Path, prefix: Path, python: str = sys.executable) -> list:
    """Install ``todo`` (no dependencies, nothing from an index) into ``prefix``, emptied
    first (no other megatron-core left from an earlier run); returns the folders to put on
    PYTHONPATH."""
    if not todo:
        return []
    files = [wheel_file(w, wheelhouse) for w in todo]
    shutil.rmtree(prefix, ignore_errors=True)
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
    import importlib.util

    missing = [m for m in ON_THE_MACHINE if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"gpu-check: this Python lacks {', '.join(missing)} (the check "
                         f"machine brings them with its CUDA torch)")
    if dry_run:
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu-check: no CUDA GPU visible to this Python's torch "
                         f"{torch.__version__} (GPU_CHECK_DRY_RUN=1 runs the CPU dry run)")


# ---- the environment (``python tools/gpu_check.py env``, in the stages' environment) ---------

SDPA_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward")


def _try(fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - recorded, not fatal
        return f"unavailable ({type(err).__name__}: {err})"


def _driver_version() -> str:
    def nvml():
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version

    def smi():
        run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True)
        return run.stdout.strip()

    found = _try(nvml)
    return found if not found.startswith("unavailable") else _try(smi)


def environment() -> dict:
    """What the stages run on: Python, torch, CUDA, driver, NCCL, the GPU, megatron-core (its
    version and where it is imported from), the aten SDPA ops' schemas, SDPA backend flags."""
    import importlib.util
    import platform

    import torch

    cuda = torch.cuda.is_available()
    bk = torch.backends.cuda
    flags = {name: _try(getattr(bk, name)) for name in (
        "flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled",
        "cudnn_sdp_enabled", "is_flash_attention_available") if hasattr(bk, name)}
    flags["matmul.allow_tf32"] = bk.matmul.allow_tf32
    spec = importlib.util.find_spec("megatron.core")
    return {
        "python": sys.version, "executable": sys.executable, "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cudnn": _try(torch.backends.cudnn.version),
        "nccl": _try(lambda: ".".join(map(str, torch.cuda.nccl.version()))) if cuda else None,
        "driver": _driver_version() if cuda else None,
        "gpu": {"name": torch.cuda.get_device_name(),
                "capability": list(torch.cuda.get_device_capability()),
                "memory_bytes": torch.cuda.get_device_properties(0).total_memory,
                "count": torch.cuda.device_count()} if cuda else None,
        "megatron_core": {"version": _try(lambda: importlib.metadata.version("megatron-core")),
                          "path": spec.origin if spec else None},
        "sdpa_op_schemas": {name: _schemas(name) for name in SDPA_OPS},
        "sdpa_backends": flags,
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "apex": importlib.util.find_spec("apex") is not None,
    }


def _schemas(name: str) -> dict:
    packet = getattr(torch_ops(), name, None)
    if packet is None:
        return {"missing": True}
    return {ov: str(getattr(packet, ov)._schema) for ov in packet.overloads()}


def torch_ops():
    import torch

    return torch.ops.aten


# ---- running a stage -------------------------------------------------------------------------

class Clock:
    """The run's time budget."""

    def __init__(self, budget_s: float):
        self.start, self.budget = time.monotonic(), budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()


def run_logged(cmd: list, log, env: dict, timeout: float) -> tuple:
    """Run ``cmd`` (its own process group) with stdout+stderr appended to the open file
    ``log``; (return code or "timeout after N s", seconds). The whole group is killed on
    timeout."""
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        rc = f"timeout after {timeout:.0f} s"
        log.write(f"\n== killed: {rc}\n")
    log.flush()
    return rc, time.monotonic() - start


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def capture(cmd: list, env: dict, timeout: float) -> tuple:
    """(return code or timeout text, stdout, stderr) of ``cmd`` in its own process group."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout))
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        return f"timeout after {timeout:.0f} s", out, err


# ---- stage 1: the kernel cases ---------------------------------------------------------------

def case_ids() -> list:
    sys.path.insert(0, str(TOOLS))
    from gpu_kernel_cases import BY_ID

    return list(BY_ID)


def case_batches(ids: list, dry_run: bool) -> list:
    """One process per kernel and dtype on the GPU (four at once); one in the dry run."""
    if dry_run:
        return [ids]
    batches: dict = {}
    for cid in ids:
        batches.setdefault("-".join(cid.split("-")[:2]), []).append(cid)
    return list(batches.values())


def _case_cmd(py: str, ids: list, dry_run: bool) -> list:
    cmd = [py, str(TOOLS / "gpu_kernel_cases.py"), "--cases", ",".join(ids)]
    return cmd + (["--device", "cpu", "--small"] if dry_run else ["--device", "cuda"])


def _parse_cases(stdout: str) -> dict:
    found = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            found[r["case"]] = r
    return found


def run_cases(py: str, env: dict, batches: list, log, deadline: float, blocking: bool,
              dry_run: bool) -> dict:
    """Run each batch of case ids in its own process, up to four at once; case id -> result
    (``{"ok": None, "raised": "not run ..."}`` where the process ended before it)."""
    if blocking:
        env = {**env, "CUDA_LAUNCH_BLOCKING": "1"}

    def one(ids):
        return ids, capture(_case_cmd(py, ids, dry_run), env, deadline - time.monotonic())

    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for ids, (rc, out, err) in pool.map(one, batches):
            log.write(f"\n== cases {','.join(ids)}{' (CUDA_LAUNCH_BLOCKING=1)' if blocking else ''}"
                      f": rc {rc}\n{out}{err[-6000:]}\n")
            found = _parse_cases(out)
            for cid in ids:
                results[cid] = found.get(cid, {
                    "case": cid, "ok": None,
                    "raised": f"not run: its process ended first (rc {rc})"})
    log.flush()
    return results


def kernel_stage(py: str, env: dict, log, dry_run: bool, timeout: float) -> tuple:
    """(rc, {case id: outcome}): the cases in batches, then each failed or unrun case alone
    with CUDA_LAUNCH_BLOCKING=1."""
    deadline = time.monotonic() + timeout
    ids = case_ids()
    first = run_cases(py, env, case_batches(ids, dry_run), log, deadline, False, dry_run)
    again = [cid for cid in ids if not first[cid]["ok"]]
    rerun = run_cases(py, env, [[c] for c in again], log, deadline, True, dry_run) if again else {}
    cases = {cid: case_outcome(first[cid], rerun.get(cid)) for cid in ids}
    return (0 if all(c["outcome"] == "passed" for c in cases.values()) else 1), cases


def case_outcome(first: dict, rerun) -> dict:
    """passed / failed (a first-run failure stays a failure, whatever the rerun says), the
    margin (bound / worst relative error), and both runs' raw results."""
    final = first if first.get("ok") is not None or rerun is None else rerun
    failed = first.get("ok") is False or final.get("ok") is not True
    out = {"outcome": "failed" if failed else "passed", "margin": final.get("margin"),
           "worst": final.get("worst"), "bound": final.get("bound"),
           "seconds": final.get("seconds"), "first_run": first}
    if rerun is not None:
        out["rerun_cuda_launch_blocking"] = rerun
    return out


# ---- stage 2: the CUDA tests -----------------------------------------------------------------

def cuda_test_files() -> list:
    """The test files with CUDA tests (``pytest.mark.cuda``): only they are collected."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.cuda" in p.read_text())


def tests_cmd(py: str, junit: Path) -> list:
    return [py, "-m", "pytest", *cuda_test_files(), "-m", "cuda", "-rA", "--durations=0",
            f"--timeout={TEST_TIMEOUT_S}", f"--junitxml={junit}", "-o", "junit_logging=system-out",
            "-p", "gpu_check_pytest", "-p", "no:cacheprovider"]


def pytest_results(junit: Path) -> list:
    """[{name, outcome, seconds, peak_gpu_memory_bytes, printed}] from pytest's JUnit XML;
    ``printed``: what the test printed (its measured errors and margins)."""
    if not junit.is_file():
        return []
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = (node.get("message") or "")[:500]
                break
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        printed = "\n".join(line for n in case.iter("system-out")
                            for line in (n.text or "").splitlines()
                            if line.strip() and not re.fullmatch(r"-+ Captured .* -+", line))
        row = {"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
               "seconds": float(case.get("time") or 0),
               "peak_gpu_memory_bytes": props.get("peak_gpu_memory_bytes"),
               "printed": printed[-1500:]}
        if outcome != "passed":
            row["reason"] = reason
        out.append(row)
    return out


def write_junit(path: Path, pytest_junit: Path, cases: dict) -> None:
    """junit.xml: pytest's suites and one suite of the kernel cases."""
    root = ET.Element("testsuites")
    if pytest_junit.is_file():
        got = ET.parse(pytest_junit).getroot()
        root.extend(got if got.tag == "testsuites" else [got])
    suite = ET.SubElement(root, "testsuite", name="gpu-kernel-cases", tests=str(len(cases)),
                          failures=str(sum(c["outcome"] != "passed" for c in cases.values())))
    for cid, c in cases.items():
        tc = ET.SubElement(suite, "testcase", classname="tools.gpu_kernel_cases", name=cid,
                           time=f"{c.get('seconds') or 0:.3f}")
        if c["outcome"] != "passed":
            raw = c.get("rerun_cuda_launch_blocking") or c["first_run"]
            ET.SubElement(tc, "failure", message=str(raw.get("raised") or raw.get("errors")))
        ET.SubElement(tc, "system-out").text = json.dumps(c["first_run"])
    ET.ElementTree(root).write(path, encoding="unicode", xml_declaration=True)


# ---- stage 3: the benchmark --------------------------------------------------------------------

def bench_cmd(py: str, out: Path, only: str, budget_s: float, dry_run: bool) -> list:
    cmd = [py, "-m", "benchmarks.gpu", "--only", only, "--hidden", "1024", "--out",
           str(out / "gpu.json"), "--budget-s", f"{budget_s:.0f}", "--decode"]
    return cmd + (["--dry-run", "--reps", "1", "--warmup", "0"] if dry_run else [])


# ---- the check -------------------------------------------------------------------------------

class Summary:
    """summary.json, rewritten after every stage."""

    def __init__(self, path: Path, dry_run: bool, mcore: str, budget_s: float):
        self.path = path
        self.doc = {"dry_run": dry_run, "mcore_requested": mcore, "budget_s": budget_s,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "ok": None, "stages": [], "kernel_cases": {}, "tests": [], "bench": None}

    def stage(self, name: str, rc, seconds: float, **extra) -> None:
        self.doc["stages"].append({"name": name, "rc": rc, "seconds": round(seconds, 1),
                                   **extra})
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.doc, indent=1, default=str))


def setup(args, summary: Summary) -> tuple:
    """Resolve and install the packages; (the stages' interpreter, their environment)."""
    start = time.monotonic()
    todo = needed(wheels(args.mcore))
    if not args.dry_run:  # fail at once, before any work, when a wheel is missing
        for w in todo:
            wheel_file(w, args.wheelhouse)
    check_machine(args.dry_run)
    py = args.python or (dry_run_python(args.mcore) if args.dry_run else sys.executable)
    if args.dry_run:  # nothing installed: the requested version's venv runs
        files = {w.dist: str(wheel_file(w, args.wheelhouse)) for w in todo
                 if args.wheelhouse.is_dir()}
        note = (f"dry run under {py}: nothing installed; the wheelhouse holds {files}" if files
                else f"dry run under {py}: nothing installed (the GPU machine needs "
                     f"{args.wheelhouse}: {FIX})")
        paths, installed = [], []
    else:
        paths = install(todo, args.wheelhouse, args.work / "prefix")
        installed = [f"{w.dist}=={w.pinned}" for w in todo]
        note = "installed from the wheelhouse: " + (", ".join(installed) or "nothing")
    print(f"gpu-check: {note}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [*map(str, paths), str(ROOT), str(TOOLS),
         *filter(None, [os.environ.get("PYTHONPATH")])])}
    summary.doc["setup"] = {"installed": installed, "note": note, "python": py}
    summary.stage("setup", 0, time.monotonic() - start)
    return py, env


def dry_run_python(mcore: str) -> str:
    """The interpreter holding megatron-core ``mcore``: this one, else ``.venv-mcore<mcore>``
    (``make test-mcore MCORE=<mcore>`` builds it); never silently another version."""
    try:
        have = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        have = None
    if have is not None and version_tuple(have) == version_tuple(mcore):
        return sys.executable
    venv = ROOT / f".venv-mcore{mcore}" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    raise SystemExit(f"gpu-check: the dry run asks for megatron-core {mcore}, but "
                     f"{sys.executable} has {have} and {venv.parents[1].name} does not exist: "
                     f"build it with `make test-mcore MCORE={mcore}`, or pass --mcore {have}")


def imported_mcore_error(doc: dict, mcore: str):
    """A one-line error when the stages' interpreter imports another megatron-core than the
    one requested (None when it is the requested one)."""
    got = (doc.get("megatron_core") or {}).get("version")
    if got is not None and version_tuple(got) == version_tuple(mcore):
        return None
    where = (doc.get("megatron_core") or {}).get("path") or doc.get("error", "")[-300:]
    return f"gpu-check: megatron-core {mcore} was requested but the stages import {got} ({where})"


def write_env(py: str, env: dict, out: Path, summary: Summary, mcore: str) -> dict:
    rc, stdout, err = capture([py, str(TOOLS / "gpu_check.py"), "env"], env, 120)
    try:
        doc = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        doc = {"error": f"rc {rc}: {stdout[-2000:]}{err[-3000:]}"}
    doc["mcore_requested"] = mcore
    doc["setup"] = summary.doc.get("setup")
    (out / "env.json").write_text(json.dumps(doc, indent=1))
    summary.doc["env"] = {k: doc.get(k) for k in ("torch", "torch_cuda", "driver", "nccl",
                                                  "gpu", "megatron_core")}
    print(f"gpu-check: torch {doc.get('torch')}, CUDA {doc.get('torch_cuda')}, GPU "
          f"{(doc.get('gpu') or {}).get('name', 'none')}, megatron-core "
          f"{(doc.get('megatron_core') or {}).get('version')}", flush=True)
    return doc


def _stage_done(name: str, rc, seconds: float, log_path: Path, summary: Summary) -> None:
    print(f"== gpu-check {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {seconds:.0f} s "
          f"(log {log_path.name})", flush=True)
    if name == "kernels":  # one line per case: what a machine returning only stdout shows
        for cid, c in summary.doc["kernel_cases"].items():
            raw = c.get("rerun_cuda_launch_blocking") or c["first_run"]
            why = raw.get("raised") or "; ".join(raw.get("problems") or [])
            print(f"   {c['outcome']:6} {cid:28} worst {_g(c['worst'])} bound {_g(c['bound'])} "
                  f"margin {_g(c['margin'])} {why[:300]}", flush=True)
    elif rc != 0:  # the end of the log
        print("".join(log_path.read_text(errors="replace").splitlines(True)[-40:]), flush=True)


def _g(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def run(args) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in OUT_FILES:  # a rerun into the same folder starts clean
        (out / name).unlink(missing_ok=True)
    clock = Clock(args.budget_s)
    summary = Summary(out / "summary.json", args.dry_run, args.mcore, args.budget_s)
    try:
        py, env = setup(args, summary)
    except (SystemExit, subprocess.CalledProcessError) as err:
        return _stop(summary, "setup", str(err.code if isinstance(err, SystemExit) else err),
                     clock)
    mismatch = imported_mcore_error(write_env(py, env, out, summary, args.mcore), args.mcore)
    if mismatch:
        return _stop(summary, "env", mismatch, clock)
    failed = []

    def stage(name, log_name, fn, timeout):
        start = time.monotonic()
        with open(out / log_name, "w") as log:
            try:
                rc, seconds, extra = fn(log, timeout)
            except Exception as err:  # noqa: BLE001 - the check's own failure is a result too
                log.write(traceback.format_exc())
                rc, seconds, extra = f"crashed: {type(err).__name__}: {err}", 0.0, {}
        seconds = seconds or time.monotonic() - start
        summary.stage(name, rc, seconds, log=log_name, timeout_s=round(timeout), **extra)
        _stage_done(name, rc, seconds, out / log_name, summary)
        if rc != 0:
            failed.append(name)

    def kernels(log, timeout):
        start = time.monotonic()
        rc, cases = kernel_stage(py, env, log, args.dry_run, timeout)
        summary.doc["kernel_cases"] = cases
        write_junit(junit, Path("/nonexistent"), cases)
        return rc, time.monotonic() - start, {}

    junit = args.work / "junit.xml"  # pytest's suites and the kernel cases' (not returned)
    pytest_junit = args.work / "pytest-junit.xml"
    pytest_junit.parent.mkdir(parents=True, exist_ok=True)
    pytest_junit.unlink(missing_ok=True)

    def tests(log, timeout):
        rc, seconds = run_logged(tests_cmd(py, pytest_junit), log, env, timeout)
        summary.doc["tests"] = pytest_results(pytest_junit)
        write_junit(junit, pytest_junit, summary.doc["kernel_cases"])
        return rc, seconds, {}

    def bench(log, timeout):
        rc, seconds = run_logged(bench_cmd(py, out, args.only, timeout - 20, args.dry_run),
                                 log, env, timeout)
        if not (out / "gpu.json").is_file():  # it died before writing: say so there too
            log.flush()
            tail = (out / "bench.log").read_text(errors="replace")[-3000:]
            error = f"benchmarks.gpu wrote nothing (rc {rc}); the end of bench.log:\n{tail}"
            (out / "gpu.json").write_text(json.dumps({"meta": {"status": "failed",
                                                                "error": error}}, indent=1))
            (out / "gpu.md").write_text(f"# GPU benchmark: failed\n\n```\n{error}\n```\n")
        summary.doc["bench"] = bench_summary(out / "gpu.json")
        return rc, seconds, {}

    budget, bench_min = args.budget_s, BENCH_MIN_SHARE * args.budget_s
    stage("kernels", "kernels.log", kernels,
          min(KERNELS_SHARE * budget, clock.left() - 2 * bench_min))
    stage("tests", "tests.log", tests, min(TESTS_SHARE * budget, clock.left() - bench_min))
    stage("bench", "bench.log", bench, clock.left() - 5)
    if not junit.is_file():
        write_junit(junit, pytest_junit, summary.doc["kernel_cases"])
    summary.doc.update(ok=not failed, failed=failed, total_s=round(clock.elapsed(), 1))
    summary.write()
    print(f"\ngpu-check{' (dry run)' if args.dry_run else ''}: "
          f"{'FAILED: ' + ', '.join(failed) if failed else 'all stages passed'} in "
          f"{clock.elapsed():.0f} s; results in {out}", flush=True)
    return 1 if failed else 0


def _stop(summary: Summary, stage: str, error: str, clock: Clock) -> int:
    """Record ``stage`` as failed with ``error`` before any test stage ran; exit status 1."""
    summary.doc.update(ok=False, error=error)
    summary.stage(stage, 1, clock.elapsed())
    print(error, file=sys.stderr)
    return 1


def bench_summary(path: Path):
    """The benchmark's status, targets and decode figures from gpu.json."""
    if not path.is_file():
        return {"status": "no gpu.json written"}
    doc = json.loads(path.read_text())
    meta = doc.get("meta", {})
    return {k: meta.get(k) for k in ("status", "error", "targets", "bench_seconds")} | {
        "decode": doc.get("decode")}


def wheelhouse_commands(wheelhouse: Path = WHEELHOUSE) -> list:
    """pip downloads of the wheelhouse for the check machine (CPython 3.12, x86_64): one per
    megatron-core version (two versions of one package cannot share a pip call), one for the
    support packages."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            *PLATFORM, "-d", str(wheelhouse)]
    return ([[*base, f"megatron-core=={v}"] for v in MCORE_VERSIONS]
            + [[*base, *[f"{w.dist}=={w.pinned}" for w in SUPPORT]]])


def fill_wheelhouse(wheelhouse: Path = WHEELHOUSE) -> int:
    for cmd in wheelhouse_commands(wheelhouse):
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            return rc
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=("check", "wheelhouse", "env"), default="check")
    p.add_argument("--out", type=Path, default=WORK / "out",
                   help="folder of everything the check writes (default .gpu-check/out)")
    p.add_argument("--mcore", default=os.environ.get("MCORE") or MCORE_VERSIONS[0],
                   help=f"megatron-core version: {' or '.join(MCORE_VERSIONS)} (default "
                        f"{MCORE_VERSIONS[0]})")
    p.add_argument("--dry-run", action="store_true",
                   default=os.environ.get("GPU_CHECK_DRY_RUN", "") not in ("", "0"),
                   help="CPU dry run (default from GPU_CHECK_DRY_RUN)")
    p.add_argument("--only", default="A", help="benchmark workloads (default A; A,B for both)")
    p.add_argument("--python", default=None,
                   help="the stages' interpreter (default: this one on a GPU; in the dry run "
                        "the one holding --mcore's version)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"the whole run's time (default {BUDGET_S} s; dry run "
                        f"{DRY_RUN_BUDGET_S} s)")
    p.add_argument("--wheelhouse", type=Path, default=WHEELHOUSE, help="default .wheelhouse")
    p.add_argument("--work", type=Path, default=WORK,
                   help="install prefix and scratch files (default .gpu-check)")
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = DRY_RUN_BUDGET_S if args.dry_run else BUDGET_S
    if args.command == "wheelhouse":
        return fill_wheelhouse(args.wheelhouse)
    if args.command == "env":
        print(json.dumps(environment(), default=str))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
