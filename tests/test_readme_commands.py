"""Every command in the ``bash`` blocks of README.md and docs/*.md works as written, shortened.

Each page's commands run in page order in a scratch directory of their own (``configs/`` and
``examples/`` linked in), so a later command finds what an earlier one of the same page wrote
(the demo's checkpoint for ``generate``, the tiny Llama for the pretrained starts). The main
job runs in this process through its command-line entry (``cli``) with ``SHORT`` appended (one
step, one evaluation batch, no plot); a torchrun command is parsed and validated at its world
size (its launch is run by ``tests/app/test_train_e2e.py`` and ``tests/app/test_train_signals.py``);
the plan command (``python -m scalerlt_mcore.plan``) runs in this process and must find that the
run fits.

A command this test cannot run is checked instead (``check``): its flags exist in the parser
of what it calls, its config, script and data files exist, its ``make`` target and ``pip``
extra exist. That holds for every command of a block marked ``gpu`` (```` ```bash gpu ````:
it needs a CUDA GPU, or places a GPU machine's files) and for the commands in ``NOT_RUN``, each
with the reason. Any other command without a runner is a failure, so a new command needs one,
a reason, or a ``gpu`` block. ``python`` blocks are compiled and their imports resolved.
"""

import ast
import contextlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHORT = ["--train-iters", "1", "--eval-iters", "1", "--eval-interval", "0", "--no-plot", "true"]
"""Appended to every main-job command: one step, one evaluation batch, no plot."""
TRAIN = ["python", "-m", "scalerlt_mcore.train"]
PLAN = ["python", "-m", "scalerlt_mcore.plan"]

NOT_RUN = {
    "make test": "the test suite itself",
    "python -m scalerlt_mcore.train --config configs/retrofit_tiny_llama.yaml "
    "--pretrained-checkpoint /path/to/gpt_checkpoint": "a placeholder for the user's stock "
    "GPTModel checkpoint (tests/app/test_pretrained_app.py runs that path)",
    "python -m scalerlt_mcore.train --pretrained-checkpoint /path/to/Ouro-1.4B": "a "
    "placeholder for the user's Ouro checkpoint (a download; tests/app/test_looped_app.py runs "
    "that path on a tiny Ouro written here)",
    "torchrun --nnodes 2": "two nodes: tests/app/test_train_signals.py launches a job this way, "
                           "both agents on localhost",
    "python -c 'import tyro;": "needs tyro 1.0.17, not a dependency (docs/config.md says why "
                               "it is shown)",
    "python -m scalerlt_mcore.engine": "a serving engine that waits for its trainer: "
                                       "tests/app/test_engine.py runs the pair",
    "python -m scalerlt_mcore.train --config configs/demo_cpu.yaml --rl-rollout-source engine":
        "waits for its engine: tests/app/test_engine.py runs the pair",
}
"""Command prefix -> why this test checks it instead of running it."""


def blocks(text: str) -> list[tuple[str, str, list[str]]]:
    """(language, marks, lines) of each fenced block: ```` ```bash gpu ```` -> ("bash", "gpu")."""
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                info = line[3:].split()
                current = (info[0] if info else "", " ".join(info[1:]), [])
            else:
                out.append(current)
                current = None
        elif current is not None:
            current[2].append(line)
    return out


def commands(text: str) -> list[tuple[str, bool]]:
    """(command, in a ``gpu`` block) of the ``bash`` blocks: continuation lines joined,
    comments dropped."""
    out = []
    for language, marks, lines in blocks(text):
        if language != "bash":
            continue
        pending = ""
        for line in lines:
            pending += line.rstrip().removesuffix("\\")
            if not line.rstrip().endswith("\\"):
                words = shlex.split(pending, comments=True)
                if words:
                    out.append((shlex.join(words), "gpu" in marks.split()))
                pending = ""
    return out


def test_commands_are_read_from_the_blocks():
    text = ("x\n```bash\nmake demo   # a comment\npython a.py \\\n    --b 'c d'  # more\n```\n"
            "```yaml\nnot: a command\n```\n```bash gpu\ntorchrun x\n```\n")
    assert commands(text) == [("make demo", False), ("python a.py --b 'c d'", False),
                              ("torchrun x", True)]


def _not_run(command: str):
    return next((why for prefix, why in NOT_RUN.items() if command.startswith(prefix)), None)


# ---- running ---------------------------------------------------------------------------------


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


def _plan(argv: list[str]) -> str:
    """The plan command in this process; it must find that the run fits (status 0)."""
    from scalerlt_mcore.app.plan import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    assert code == 0, out.getvalue()
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
    """Run one command (``/tmp/...`` paths moved into ``scratch``); -> its output."""
    words = [w.replace("/tmp/", f"{scratch}/tmp/") for w in shlex.split(command)]
    if words == ["make", "demo"]:
        recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].splitlines()[1]
        assert recipe.strip() == "$(PY) -m scalerlt_mcore.train", recipe
        return _train([], f"runs/{n}")
    if words[:3] == TRAIN:
        return _train(words[3:], f"runs/{n}")
    if words[0] == "torchrun":
        return _torchrun(words)
    if words[:3] == ["python", "-m", "scalerlt_mcore.generate"]:
        return _generate(words[3:])
    if words[:3] == PLAN:
        return _plan(words[3:])
    if words[0] == "python" and words[1].startswith("examples/"):
        return _script(words)
    if words[:3] == ["python", "-m", "scalerlt_mcore.export"]:
        from scalerlt_mcore.export import main

        main(words[3:])
        return ""
    raise AssertionError(f"no runner for command {command!r}: add one, a reason to NOT_RUN, "
                         f"or mark its block gpu")


# ---- checking what is not run ----------------------------------------------------------------


def _parser_flags(module: str) -> set[str]:
    """The ``--flags`` an argparse entry declares (read from its source)."""
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", (ROOT / module).read_text()))


def _check_files(words: list[str]) -> None:
    """Every word naming a file of this repository (configs/, examples/, tools/, benchmarks/)
    names one that exists."""
    for word in words:
        path = word.partition("=")[2] or word
        if re.match(r"(configs|examples|tools|benchmarks)/", path):
            assert (ROOT / path).exists(), f"{path} does not exist"


def _check_train_args(argv: list[str]) -> None:
    from scalerlt_mcore.app.config import parse_args

    parse_args(argv)  # unknown flags, bad values and a missing --config file are errors


def _check_make(words: list[str]) -> None:
    target = next(w for w in words[words.index("make") + 1:] if "=" not in w)
    assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), flags=re.M), \
        f"no make target {target!r}"


def _check_script(words: list[str]) -> None:
    """``examples/launch_h20_8gpu.sh``: executable, and its torchrun line checked."""
    script = ROOT / words[0]
    assert script.is_file() and script.stat().st_mode & 0o111, f"{words[0]} is not executable"
    text = script.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("torchrun"))
    check(shlex.join(w for w in shlex.split(line) if w != "$@"))


def check(command: str) -> None:
    """Check a command without running it: what it names exists (see the module docstring)."""
    words = shlex.split(command)
    words = words[:words.index("|")] if "|" in words else words
    _check_files(words)
    if "make" in words:
        return _check_make(words)
    if words[:2] == ["pip", "install"]:
        extra = re.fullmatch(r"\.\[(\w+)\]", words[-1]).group(1)
        extras = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
        assert re.search(rf"^{extra} = \[", extras, flags=re.M), f"no extra {extra!r} in pyproject"
        return None
    if words[0].endswith(".sh"):
        return _check_script(words)
    if words[:2] == ["python", "-c"]:
        compile(words[2], "<command>", "exec")
        return None
    if words[0] == "torchrun" or words[:3] == TRAIN:
        return _check_train_args(words[words.index("scalerlt_mcore.train") + 1:])
    if words[:3] == ["python", "-m", "scalerlt_mcore.engine"]:  # the main job's flags
        return _check_train_args(words[3:])
    if words[:3] == PLAN:  # its own flags, then the main job's
        from scalerlt_mcore.app.plan import plan_parser

        return _check_train_args(plan_parser().parse_known_args(words[3:])[1])
    module = ({"scalerlt_mcore.export": "scalerlt_mcore/export.py",
               "scalerlt_mcore.generate": "scalerlt_mcore/generate.py"}.get(words[2])
              if words[1] == "-m" else words[1])
    if words[0] in ("python", "python3") and module:
        flags = {w.partition("=")[0] for w in words if w.startswith("--")}
        unknown = flags - _parser_flags(module)
        assert not unknown, f"{module} has no {sorted(unknown)}"
        return None
    raise AssertionError(f"no check for command {command!r}")


# ---- the tests -------------------------------------------------------------------------------


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_command_runs_or_is_checked(page, tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path)
    failures = []
    for n, (command, gpu) in enumerate(commands(page.read_text())):
        try:
            if gpu or _not_run(command):
                check(command)
            else:
                _run(command, n, tmp_path)
        except (Exception, SystemExit) as e:
            failures.append(f"{command}\n    -> {type(e).__name__}: {e}\n"
                            f"    {capsys.readouterr().err[-600:]}")
    assert not failures, f"{_page_id(page)}: commands that fail:\n" + "\n".join(failures)


def test_the_pages_have_the_commands_they_had():
    """The run commands did not vanish when the README moved into docs/: at least as many as
    the README ran before, and each GPU block is checked."""
    found = [(c, gpu) for page in PAGES for c, gpu in commands(page.read_text())]
    run = [c for c, gpu in found if not gpu and not _not_run(c)]
    assert len(run) >= 21, run  # the 21 the README ran before
    assert sum(gpu for _, gpu in found) >= 8


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_python_blocks_compile_and_import(page):
    for language, _, lines in blocks(page.read_text()):
        if language != "python":
            continue
        for node in ast.parse("\n".join(lines), page.name).body:
            if isinstance(node, ast.ImportFrom):
                module = __import__(node.module, fromlist=["_"])
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"


def test_the_multi_node_line_is_the_tested_launch():
    from helpers.train_runs import TWO_NODES

    text = (ROOT / "docs" / "running.md").read_text()
    line = next(c for c, _ in commands(text) if c.startswith("torchrun --nnodes 2"))
    assert shlex.join(TWO_NODES) in line, (TWO_NODES, line)


def test_an_unknown_command_needs_a_runner_or_a_reason(tmp_path):
    with pytest.raises(AssertionError, match="no runner for command 'ls -l'"):
        _run("ls -l", 0, tmp_path)


@pytest.mark.parametrize("command, error", [
    ("torchrun --nproc-per-node 8 -m scalerlt_mcore.train --config configs/nope.yaml", "nope"),
    ("python -m scalerlt_mcore.train --no-such-flag 1", "no_such_flag"),
    ("make no-such-target", "no make target"),
    ("pip install -e '.[nope]'", "no extra"),
    ("python3 tools/gpu_check.py --no-such-option x", "no-such-option"),
    ("python -m scalerlt_mcore.export --no-such-option x", "no-such-option"),
    ("python -m scalerlt_mcore.plan --config configs/h20_8gpu.yaml --no-such-flag 1",
     "no_such_flag"),
])
def test_a_checked_command_that_names_nothing_fails(command, error):
    with pytest.raises((Exception, SystemExit), match=error):
        check(command)
