"""Static device check over the package (library and app): every tensor factory and
``torch.Generator`` names its device, or is on the host-side allowlist below with a reason.

A factory without ``device=`` builds on the CPU whatever device its inputs are on: on a GPU
that is a device-mismatch error at the first op mixing the two (or a silent host round trip).
The meta-device tests (test_device_meta.py) run the pure-tensor functions; this check also
covers the data-dependent rest (rollouts, the trainer). ``*_like`` and ``Tensor.new_*``
factories inherit their device and are not listed.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "scalerlt_mcore"
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "randn", "rand",
             "randint", "randperm", "eye", "linspace", "logspace", "empty_strided",
             "scalar_tensor", "Generator"}

# (file relative to the package, enclosing function, factory) -> why it is host-side.
ALLOWLIST = {
    ("model/block.py", "LinearConcatInjection.__init__", "eye"):
        "parameter initialisation on the host (as MCore's use_cpu_initialization); the app "
        "moves the built model with model.to(device)",
    ("model/block.py", "LinearConcatInjection.__init__", "zeros"):
        "parameter initialisation on the host, as above",
    ("app/checkpoint.py", "_restore_adam_step", "tensor"):
        "torch Adam keeps its per-parameter step count as a host tensor (capturable=False)",
    ("app/checkpoint.py", "_init_adam_state", "tensor"):
        "torch Adam's step count, a host tensor, as above",
}


def factory_calls(source: str, filename: str = "<source>") -> list:
    """[(enclosing function, factory, line)] of factory calls without a ``device=`` keyword."""
    tree = ast.parse(source, filename)
    from_torch = {alias.asname or alias.name for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module == "torch"
                  for alias in node.names if alias.name in FACTORIES}
    found = []

    def visit(node, scope: list):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [*scope, child.name]
            if isinstance(child, ast.Call):
                name = _factory_name(child.func, from_torch)
                if name and not any(k.arg == "device" for k in child.keywords):
                    found.append((".".join(scope) or "<module>", name, child.lineno))
            visit(child, inner)

    visit(tree, [])
    return found


def _factory_name(func, from_torch: set):
    if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "torch" and func.attr in FACTORIES):
        return func.attr
    if isinstance(func, ast.Name) and func.id in from_torch:
        return func.id
    return None


def test_checker_finds_factories_without_device():
    source = (
        "import torch\nfrom torch import zeros as z\n"
        "def f(x, d):\n"
        "    a = torch.zeros(3)\n"
        "    g = torch.Generator()\n"
        "    b = z(2, dtype=torch.long)\n"
        "    c = torch.arange(4, device=d)\n"
        "    e = torch.zeros_like(x) + x.new_zeros(3)\n"
        "class K:\n"
        "    def m(self):\n"
        "        return torch.tensor([1], device='cpu'), torch.full((2,), 1.0)\n"
    )
    assert factory_calls(source) == [("f", "zeros", 4), ("f", "Generator", 5), ("f", "z", 6),
                                     ("K.m", "full", 11)]


def test_every_factory_in_the_package_names_its_device():
    unexplained, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for scope, name, line in factory_calls(path.read_text(), str(path)):
            key = (rel, scope, name)
            if key in ALLOWLIST:
                used.add(key)
            else:
                unexplained.append(f"scalerlt_mcore/{rel}:{line} {scope}: torch.{name}(...)")
    assert not unexplained, ("tensor factories without device= (pass the device of the data "
                             "they meet, or device='cpu' for host-side values, or allowlist "
                             "them with a reason):\n" + "\n".join(unexplained))
    assert used == set(ALLOWLIST), f"stale allowlist entries: {set(ALLOWLIST) - used}"
    assert all(reason.strip() for reason in ALLOWLIST.values())
