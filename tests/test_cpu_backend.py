"""The opt-in CPU backend: explicit, idempotent, all or nothing, version-checked, and each
patch works. The MCore workarounds outside it: ledgered, registered and version-guarded."""

import ast
import importlib
import inspect
import json
import logging
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import megatron.core
import pytest
import torch

import scalerlt_mcore
from scalerlt_mcore import cpu_backend, mcore_compat
from scalerlt_mcore.cpu_backend import cpu_backend_enabled, enable_cpu_backend
from scalerlt_mcore.mcore_compat import resolve

LEDGER = Path(__file__).resolve().parents[1] / "patches" / "README.md"

# Runs in a fresh interpreter: ids of every patch target before importing scalerlt_mcore,
# after importing all of it, and after enable_cpu_backend().
_IMPORT_PROBE = """
import importlib, json, pkgutil, sys
targets = json.loads(sys.argv[1])
def ids():
    out = []
    for target in targets:
        module, _, path = target.partition(":")
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)
        out.append(id(obj))
    return out
stock = ids()
import scalerlt_mcore
for info in pkgutil.walk_packages(scalerlt_mcore.__path__, "scalerlt_mcore."):
    importlib.import_module(info.name)
imported = ids()
from scalerlt_mcore.cpu_backend import cpu_backend_enabled, enable_cpu_backend
enabled_at_import = cpu_backend_enabled()
enable_cpu_backend()
print(json.dumps({"imported": [a == b for a, b in zip(stock, imported)],
                  "enabled": [a != b for a, b in zip(stock, ids())],
                  "enabled_at_import": enabled_at_import}))
"""


def _targets() -> list[str]:
    return [target for target, _ in cpu_backend._patch_table()]


def test_not_applied_at_import_and_every_target_patched_when_enabled():
    """Importing all of scalerlt_mcore patches nothing; enabling replaces every target."""
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, json.dumps(_targets())],
        capture_output=True, text=True, timeout=400, check=True,
    )
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not probe["enabled_at_import"]
    assert all(probe["imported"]), [t for t, ok in zip(_targets(), probe["imported"]) if not ok]
    assert all(probe["enabled"]), [t for t, ok in zip(_targets(), probe["enabled"]) if not ok]


def test_enable_twice_is_a_noop():
    assert enable_cpu_backend() is True
    patched = {t: getattr(*resolve(t)) for t in _targets()}
    applied = list(cpu_backend.APPLIED)
    assert enable_cpu_backend() is True
    assert cpu_backend_enabled()
    assert cpu_backend.APPLIED == applied
    assert all(getattr(*resolve(t)) is obj for t, obj in patched.items())


@pytest.mark.parametrize("version", ["0.17.0", "0.19.1", "0.20.0"])
def test_untested_mcore_version_is_refused(monkeypatch, version):
    """A version that was not tested is refused, naming the tested versions and the found one."""
    monkeypatch.setattr(megatron.core, "__version__", version)
    with pytest.raises(RuntimeError, match=r"CPU backend is written for megatron-core 0\.16\.1 "
                       rf"and 0\.19\.2; found megatron-core {re.escape(version)}"):
        enable_cpu_backend()


def test_patch_table_keyed_by_version():
    """Each tested version gets its own rows: 0.19.2 adds the grad-norm-group flag."""
    old, new = ([t for t, _ in cpu_backend._patch_table(v)] for v in ("0.16.1", "0.19.2"))
    extra = "megatron.core.optimizer.optimizer:MegatronOptimizer.has_grad_norm_group"
    assert extra in new and extra not in old
    assert cpu_backend._patch_table("0.18.0") == []


def test_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert enable_cpu_backend() is False


def _ledger_rows(pattern: str) -> list[tuple[str, str, tuple]]:
    """(number, target, MCore versions) of each ledger table row whose number matches."""
    rows = re.findall(rf"^\| ({pattern}) \| `([^`]+)` \| ([^|]+) \|", LEDGER.read_text(),
                      flags=re.M)
    return [(n, t, tuple(v.strip() for v in versions.split(","))) for n, t, versions in rows]


def test_ledger_lists_every_patch():
    """patches/README.md has one row per patch of each tested version, keyed by version: the
    rows naming the installed version are exactly the applied patches."""
    enable_cpu_backend()
    rows = _ledger_rows(r"\d+")
    assert [int(n) for n, _, _ in rows] == list(range(1, len(rows) + 1))
    found = mcore_compat.found_mcore_version()
    assert sorted(t for _, t, v in rows if found in v) == sorted(cpu_backend.APPLIED)
    for version in mcore_compat.TESTED_MCORE:
        listed = sorted(t for _, t, v in rows if version in v)
        table = [t for t, _ in cpu_backend._patch_table(version)] + [cpu_backend.RNG_FILTER]
        assert listed == sorted(table), version
    assert all(set(v) <= set(mcore_compat.TESTED_MCORE) for _, _, v in rows)


def _import_all() -> list[str]:
    """Import every scalerlt_mcore module (registering every workaround); the registry."""
    for info in pkgutil.walk_packages(scalerlt_mcore.__path__, "scalerlt_mcore."):
        importlib.import_module(info.name)
    return list(mcore_compat.WORKAROUNDS)


def test_ledger_lists_every_workaround():
    """patches/README.md has one W row per registered workaround, numbered W1.., every cell
    (behaviour, what it does, tests, when it can go) filled."""
    rows = re.findall(r"^\| (W\d+) \| `([^`]+)` \|(.*)\|$", LEDGER.read_text(), flags=re.M)
    assert [row[0] for row in rows] == [f"W{i + 1}" for i in range(len(rows))]
    assert sorted(row[1] for row in rows) == sorted(_import_all())
    for number, target, rest in rows:
        cells = [cell.strip() for cell in rest.split(" | ")]
        assert len(cells) == 5 and all(cells), (number, target, cells)
    keyed = {t: v for _, t, v in _ledger_rows(r"W\d+")}
    assert keyed == {t: mcore_compat.WORKAROUND_VERSIONS[t] for t in keyed}


def test_every_workaround_refuses_another_mcore_version(monkeypatch):
    """Each registered workaround raises naming itself and the found version; the guard runs
    before the arguments are looked at."""
    targets = _import_all()
    assert len(targets) == 5, targets
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    for target in targets:
        written_for = " and ".join(mcore_compat.WORKAROUND_VERSIONS[target])
        with pytest.raises(RuntimeError, match=re.escape(f"{target} is written for megatron-core "
                           f"{written_for}; found megatron-core 0.17.0")):
            getattr(*resolve(target))()


# Runs in a fresh interpreter (the tests' own process has the backend enabled): a patch table
# with a bad target in the middle, then the real table; each builder records what it wrapped.
_ROLLBACK_PROBE = """
import json, logging
from scalerlt_mcore import cpu_backend
from scalerlt_mcore.mcore_compat import resolve
BAD = "megatron.core.optimizer.optimizer:NoSuchOptimizer.__init__"
table = cpu_backend._patch_table
targets = [t for t, _ in table()]
logger = logging.getLogger("megatron.core.tensor_parallel.random")
built = {}  # target -> [(original, replacement)] per build
def current():
    return [getattr(*resolve(t)) for t in targets]
def owned():
    return [name in vars(owner) for owner, name in map(resolve, targets)]
def filters():
    return sum(isinstance(f, cpu_backend._DropRngForkWarning) for f in logger.filters)
def recording(target, build):
    def record(original):
        built.setdefault(target, []).append((original, build(original)))
        return built[target][-1][1]
    return record
def table_with(version=None, bad_at=None):
    rows = [(t, recording(t, b)) for t, b in table(version)]
    if bad_at is not None:
        rows.insert(bad_at, (BAD, lambda original: original))
    return rows
def state():
    return {"marker": cpu_backend.cpu_backend_enabled(), "applied": list(cpu_backend.APPLIED),
            "filters": filters(), "built": {t: len(b) for t, b in built.items()}}
stock, stock_owned = current(), owned()
cpu_backend._patch_table = lambda version: table_with(version, len(targets) // 2)
try:
    cpu_backend.enable_cpu_backend()
    error = None
except AttributeError as err:
    error = str(err)
failed = {**state(), "error": error, "owned": owned() == stock_owned,
          "stock": [a is b for a, b in zip(current(), stock)]}
built.clear()
cpu_backend._patch_table = table_with
enabled = cpu_backend.enable_cpu_backend()
retry = {**state(), "enabled": enabled,
         "from_stock": [built[t][0][0] is s for t, s in zip(targets, stock)],
         "installed": [built[t][0][1] is c for t, c in zip(targets, current())]}
print(json.dumps({"targets": targets, "failed": failed, "retry": retry}))
"""


def test_failed_patch_restores_everything_and_retry_applies_once():
    """A patch failing halfway restores every patch applied before it (marker unset, APPLIED
    empty, no logging filter); the retry then wraps each stock target exactly once."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", _ROLLBACK_PROBE], capture_output=True,
                          text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    targets, failed, retry = probe["targets"], probe["failed"], probe["retry"]
    assert "NoSuchOptimizer" in failed["error"]
    assert failed["built"] == {t: 1 for t in targets[: len(targets) // 2]}  # failed mid-table
    assert all(failed["stock"]) and failed["owned"]
    assert (failed["marker"], failed["applied"], failed["filters"]) == (False, [], 0)
    assert retry["enabled"] and retry["marker"] and retry["filters"] == 1
    assert retry["built"] == {t: 1 for t in targets}
    assert all(retry["from_stock"]) and all(retry["installed"])
    assert retry["applied"] == [*targets, "megatron.core.tensor_parallel.random:logger (filter)"]


def _is_context(node) -> bool:
    """`inference_context`, `kwargs['inference_context']` or `kwargs.get('inference_context')`."""
    if isinstance(node, ast.Name):
        return node.id == "inference_context"
    key = node.slice if isinstance(node, ast.Subscript) else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        key = node.args[0] if node.func.attr == "get" and node.args else None
    return isinstance(key, ast.Constant) and key.value == "inference_context"


def _context_reads(cls) -> set:
    """Attributes read of an inference context in the source of `cls`'s MCore classes."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.startswith("megatron."):
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
            names |= {node.attr for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and _is_context(node.value)}
    return names


def test_loopkv_answers_what_mcore_asks():
    """LoopKV (ledger W1) answers exactly what MCore's TransformerLayer reads of an inference
    context, and MCore's Attention never sees it: LoopedSelfAttention overrides forward and
    calls no MCore method that takes an inference context."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from scalerlt_mcore.model.attention import LoopedSelfAttention
    from scalerlt_mcore.model.kv import LoopKV

    assert _context_reads(TransformerLayer) == set(LoopKV.MCORE_METHODS)
    ctx = LoopKV()
    assert [getattr(ctx, m)() for m in LoopKV.MCORE_METHODS] == [False, True, False]
    takes_context = {name for base in LoopedSelfAttention.__mro__[1:]
                     if base.__module__.startswith("megatron.")
                     for name, fn in vars(base).items() if inspect.isfunction(fn)
                     and "inference_context" in inspect.signature(fn).parameters}
    tree = ast.parse(textwrap.dedent(inspect.getsource(LoopedSelfAttention)))
    called = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "self"}
    assert "forward" in takes_context and "forward" in vars(LoopedSelfAttention)
    assert called and not called & takes_context, called & takes_context


def test_rng_tracker_uses_cpu_generator(mcore_single, caplog):
    """Seeded like MCore on GPU: default stream = seed, fork = seed + 2718 (TP rank 0)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    default = torch.Generator().manual_seed(1234)
    forked = torch.Generator().manual_seed(1234 + 2718)
    with caplog.at_level(logging.WARNING):
        first = torch.rand(3)
        with get_cuda_rng_tracker().fork():
            inside = torch.rand(3)
        after = torch.rand(3)
    assert torch.equal(first, torch.rand(3, generator=default))
    assert torch.equal(inside, torch.rand(3, generator=forked))
    assert torch.equal(after, torch.rand(3, generator=default))
    assert "RNG" not in caplog.text


def test_streams_and_sync_are_noops():
    enable_cpu_backend()
    assert torch.cuda.current_device() == torch.device("cpu")
    side = torch.cuda.Stream(device=torch.cuda.current_device())
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.default_stream())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def test_softmax_masks_on_cpu():
    from megatron.core.fusions import fused_softmax

    enable_cpu_backend()
    causal = fused_softmax.get_default_causal_mask(4)
    assert causal.device.type == "cpu"
    assert torch.equal(causal, torch.ones(4, 4).triu(1).bool())
    assert fused_softmax.get_sliding_window_causal_mask(4, 4, (2, 0)).device.type == "cpu"


def test_clip_grads_module_functions(mcore_single):
    from megatron.core import parallel_state
    from megatron.core.optimizer import clip_grads

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    group = parallel_state.get_data_parallel_group()
    grads = [p.grad for p in params]
    norm = clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=group)
    assert norm == pytest.approx(5.0)
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
    assert params[0].grad[0].item() == pytest.approx(0.6, rel=1e-5)
    assert clip_grads.count_zeros_fp32(params, grad_stats_parallel_group=group) == 5


def _tiny_gpt(dtype: torch.dtype):
    """2-layer GPT in MCore DDP (no distributed optimizer), in `dtype` via Float16Module."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16, params_dtype=dtype,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
    if dtype != torch.float32:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


_OPTIMIZERS = {  # dtype -> (MCore optimizer class, grad scaler class)
    torch.float32: ("FP32Optimizer", "NoneType"),
    torch.bfloat16: ("Float16OptimizerWithFloat16Params", "NoneType"),
    torch.float16: ("Float16OptimizerWithFloat16Params", "DynamicGradScaler"),
}


@pytest.mark.parametrize("dtype", list(_OPTIMIZERS))
def test_non_distributed_optimizers_step(mcore_single, dtype):
    """FP32Optimizer, Float16OptimizerWithFloat16Params (bf16; fp16 with a grad scaler)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = _tiny_gpt(dtype)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, log_num_zeros_in_grad=True, initial_loss_scale=2.0**7,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    (inner,) = optimizer.chained_optimizers
    scaler = getattr(inner, "grad_scaler", None)
    assert (type(inner).__name__, type(scaler).__name__) == _OPTIMIZERS[dtype]
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(0, 64, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    optimizer.scale_loss(loss).backward()
    model.finish_grad_sync()
    ok, grad_norm, num_zeros = optimizer.step()
    assert ok and grad_norm > 0 and num_zeros is not None
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
