"""The package's floors (docs/architecture.md): a module may import only from its own floor
or lower ones. Every module of the package must belong to a floor."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "scalerlt_mcore"

FLOORS = {
    "cpu_backend": 0,  # opt-in MCore patches for CPU hosts
    "mcore_compat": 0,  # version-guarded MCore workarounds
    "model": 1,  # the looped GPT
    "shared_prefix": 2,  # joint replay: no RL knowledge
    "rl": 3,  # RL building blocks
    "testing": 4,  # gloo test harness
    "app": 5,  # the main job
    "train": 6,  # ``python -m scalerlt_mcore.train``
    "generate": 6,  # ``python -m scalerlt_mcore.generate``
    "export": 6,  # ``python -m scalerlt_mcore.export``
    "plan": 6,  # ``python -m scalerlt_mcore.plan``
    "engine": 6,  # ``python -m scalerlt_mcore.engine``
}
"""First component under ``scalerlt_mcore`` -> floor."""


def _part(module: str) -> str:
    """'scalerlt_mcore.rl.objective' -> 'rl'; the package itself -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list:
    """(line, absolute module) of every ``scalerlt_mcore`` import in ``path``."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
            out += [(node.lineno, n) for n in names]
    return [(line, m) for line, m in out if m.split(".")[0] == "scalerlt_mcore"]


def _modules() -> list:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_floor():
    missing = {_part(_module_name(p)) for p in _modules()} - set(FLOORS) - {""}
    assert not missing, f"modules with no floor (add them to FLOORS and the docs): {missing}"


def test_no_import_goes_up_a_floor():
    violations = []
    for path in _modules():
        me = _part(_module_name(path))
        if me == "":
            continue
        for line, target in _imports(path):
            other = _part(target)
            if other and FLOORS.get(other, 99) > FLOORS[me]:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({me}, floor "
                                  f"{FLOORS[me]}) imports {target} (floor {FLOORS.get(other)})")
    assert not violations, "\n".join(violations)


def test_the_checker_sees_a_violation():
    """The walker resolves relative imports: an upward import in a library file is found."""
    fake = PACKAGE / "shared_prefix" / "group.py"
    src = "from ..rl.objective import RLObjective\nfrom .. import app\n"
    # Resolve as if the source lived at shared_prefix/group.py.
    resolved = [m for _, m in _imports_as(fake, src)]
    assert "scalerlt_mcore.rl.objective" in resolved and "scalerlt_mcore.app" in resolved


def _imports_as(path: Path, source: str) -> list:
    original = Path.read_text
    try:
        Path.read_text = lambda self, *a, **k: source if self == path else original(self, *a, **k)
        return _imports(path)
    finally:
        Path.read_text = original


def test_schedule_has_no_rl_knowledge():
    """The schedules take the loss from the caller's forward_step_func, the group carries no
    loss's tensors (a loss declares its own, ``SharedPrefixGroup.EXTRAS``) and the planner takes
    the loss's saved bytes from its caller: no RL objective terms in their code or data."""
    for name in ("schedule.py", "naive.py", "scoring.py", "group.py", "planner.py"):
        text = (PACKAGE / "shared_prefix" / name).read_text()
        found = re.findall(r"\b(ppo|kl_coef|kl|RLObjective|clip_\w+|advantages?|old_logprobs|"
                           r"ref_logprobs|GRPO|RL_\w+)\b", text)
        assert not found, f"shared_prefix/{name} mentions {sorted(set(found))}"


def test_tests_import_helpers_not_other_test_files():
    """What test files share lives in tests/helpers/; a test file imports no other test file
    (its tests would run twice, and moving one test breaks another)."""
    tests = Path(__file__).resolve().parent
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(tests)} imports {n}" for n in names
                          if n.split(".")[-1].startswith("test_") or n == "conftest"]
    assert not offenders, offenders
