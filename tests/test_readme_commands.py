"""Every command in the README's ``bash`` blocks works as written, shortened.

The commands run in README order in one scratch directory (``configs/`` and ``examples/`` linked
in), so a later command finds what an earlier one wrote (the demo's checkpoint for ``generate``,
the tiny Llama for the pretrained starts). The main job runs in this process through its
command-line entry (``cli``) with ``SHORT`` appended (one step, one evaluation batch, no plot);
a torchrun command is parsed and validated at its world size (its launch is run by
``tests/app/test_train_e2e.py`` and ``tests/app/test_train_signals.py``). A command the test
cannot run here is in ``NOT_RUN`` with the reason; any other command is a failure, so a new
README command needs a runner or a reason.
"""

import contextlib
import io
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHORT = ["--train-iters", "1", "--eval-iters", "1", "--eval-interval", "0", "--no-plot", "true"]
"""Appended to every main-job command: one step, one evaluation batch, no plot."""

NOT_RUN = {
    "make test": "the test suite itself",
    "make wheelhouse": "downloads wheels (needs the network)",
    "make gpu-check": "needs a CUDA GPU (tests/test_gpu_check.py runs its dry run)",
    "GPU_CHECK_DRY_RUN=1 make gpu-check": "run by tests/test_gpu_check.py",
    "python3 tools/gpu_check.py --out": "needs a CUDA GPU (tests/test_gpu_check.py runs its dry "
                                        "run through the same script)",
    "pip install -e '.[gpu]'": "Transformer Engine compiles against CUDA (no GPU here)",
    "examples/launch_h20_8gpu.sh": "8 GPUs (not run)",
    "torchrun --nnodes 2": "two nodes: tests/app/test_train_signals.py launches a job this way, "
                           "both agents on localhost",
    "python -m scalerlt_mcore.train --config configs/retrofit_tiny_llama.yaml "
    "--pretrained-checkpoint /path/to/gpt_checkpoint": "a placeholder for the user's stock "
    "GPTModel checkpoint (tests/app/test_pretrained_app.py runs that path)",
    **dict.fromkeys(
        [f"torchrun --nproc-per-node 8 -m scalerlt_mcore.train --config configs/{name}"
         for name in ("ouro_1.4b_h20.yaml", "huginn_0125_h20.yaml", "nanbeige_4.2_3b_h20.yaml")],
        "8 GPUs and a placeholder for the public checkpoint (a download); "
        "tests/app/test_h20_configs.py validates each at 8 ranks and runs an RL step on meta"),
    "python -m scalerlt_mcore.train --pretrained-checkpoint /path/to/Ouro-1.4B": "a "
    "placeholder for the user's Ouro checkpoint (a download; tests/app/test_looped_app.py runs "
    "that path on a tiny Ouro written here)",
}
"""Command prefix -> why this test does not run it."""


def commands(text: str) -> list[str]:
    """The commands of the ``bash`` blocks: continuation lines joined, comments dropped."""
    out, fenced, pending = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = line.strip() == "```bash"
            continue
        if not fenced:
            continue
        pending += line.rstrip().removesuffix("\\")
        if not line.rstrip().endswith("\\"):
            words = shlex.split(pending, comments=True)
            if words:
                out.append(shlex.join(words))
            pending = ""
    return out


def test_commands_are_read_from_the_blocks():
    text = ("x\n```bash\nmake demo   # a comment\npython a.py \\\n    --b 'c d'  # more\n```\n"
            "```yaml\nnot: a command\n```\n")
    assert commands(text) == ["make demo", "python a.py --b 'c d'"]


def _not_run(command: str):
    return next((why for prefix, why in NOT_RUN.items() if command.startswith(prefix)), None)


def _train(argv: list[str], run_dir: str) -> str:
    """The main job's command line in this process; -> stdout (SystemExit on a user error)."""
    from scalerlt_mcore.app.train import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli(argv if "--help" in argv else argv + SHORT + ["--run-dir", run_dir])
        except SystemExit as e:
            if e.code:
                raise
    return out.getvalue()


def _torchrun(words: list[str]) -> str:
    from scalerlt_mcore.app.config import parse_args, validate

    nproc = int(words[words.index("--nproc-per-node") + 1])
    validate(parse_args(words[words.index("scalerlt_mcore.train") + 1:]), nproc)
    return ""


def _generate(argv: list[str]) -> str:
    from scalerlt_mcore.generate import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli(argv)
    assert out.getvalue().startswith("loop 1 | "), out.getvalue()
    return out.getvalue()


def _script(words: list[str]) -> str:
    out, argv = io.StringIO(), sys.argv
    sys.argv = words[1:]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(ROOT / words[1]), run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


def _run(command: str, n: int, scratch: Path) -> str:
    """Run one README command (``/tmp/...`` paths moved into ``scratch``); -> its output."""
    words = [w.replace("/tmp/", f"{scratch}/tmp/") for w in shlex.split(command)]
    train = ["python", "-m", "scalerlt_mcore.train"]
    if words == ["make", "demo"]:
        recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].splitlines()[1]
        assert recipe.strip() == "$(PY) -m scalerlt_mcore.train", recipe
        return _train([], f"runs/{n}")
    if words[:3] == train:
        return _train(words[3:], f"runs/{n}")
    if words[0] == "torchrun":
        return _torchrun(words)
    if words[:3] == ["python", "-m", "scalerlt_mcore.generate"]:
        return _generate(words[3:])
    if words[0] == "python" and words[1].startswith("examples/"):
        return _script(words)
    if words[:3] == ["python", "-m", "scalerlt_mcore.export"]:
        from scalerlt_mcore.export import main

        main(words[3:])
        return ""
    raise AssertionError(f"no runner for README command {command!r}: add one, or a reason to "
                         f"NOT_RUN")


def test_every_readme_command_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path)
    failures, ran = [], 0
    for n, command in enumerate(commands(README.read_text())):
        if _not_run(command):
            continue
        try:
            _run(command, n, tmp_path)
            ran += 1
        except (Exception, SystemExit) as e:
            failures.append(f"{command}\n    -> {type(e).__name__}: {e}\n"
                            f"    {capsys.readouterr().err[-600:]}")
    assert not failures, "README commands that fail:\n" + "\n".join(failures)
    assert ran >= 12, ran


def test_the_readme_multi_node_line_is_the_tested_launch():
    from helpers.train_runs import TWO_NODES

    line = next(c for c in commands(README.read_text()) if c.startswith("torchrun --nnodes 2"))
    assert shlex.join(TWO_NODES) in line, (TWO_NODES, line)


def test_an_unknown_command_needs_a_runner_or_a_reason(tmp_path):
    with pytest.raises(AssertionError, match="no runner for README command 'ls -l'"):
        _run("ls -l", 0, tmp_path)
