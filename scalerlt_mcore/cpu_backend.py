"""Opt-in CPU backend for Megatron-Core: run real MCore modules on CPU with gloo.

MCore (0.16.1 and 0.19.2 tested) assumes a CUDA device. `enable_cpu_backend()` redirects the
CUDA-only calls it makes so that, in a process without CUDA, "the CUDA device" is the CPU:

- `torch.cuda` functions that raise without CUDA (current device, RNG state, streams, sync)
  are replaced by CPU equivalents. Nothing that worked before changes meaning.
- MCore functions that create tensors with a hard-coded ``device='cuda'`` or check
  ``param.type() == 'torch.cuda.FloatTensor'`` are wrapped and called through under
  `_CudaAsCpu`, a torch-function mode active only for the duration of that call.

Every patch is keyed by the MCore versions it was written for (`_patch_table`): a version gets
exactly its rows, and a version that was not tested is refused. Every deviation is listed, per
version, in patches/README.md. Nothing is patched at import time.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch.overrides import TorchFunctionMode

from .mcore_compat import TESTED_MCORE, found_mcore_version, require_mcore, resolve

_MARKER = "_scalerlt_cpu_backend"  # set on torch.cuda once every patch is applied
_MISSING = object()  # an attribute the owner did not define itself (inherited)

# "module:attr" of every applied patch, in order; filled by enable_cpu_backend().
APPLIED: list[str] = []


def cpu_backend_enabled() -> bool:
    """True when enable_cpu_backend() has patched this process."""
    return bool(getattr(torch.cuda, _MARKER, False))


def enable_cpu_backend() -> bool:
    """Apply the CPU backend; return True when applied (now or before), False with CUDA.

    All or nothing: if a patch fails to apply, every patch applied so far is restored and the
    error re-raised, so a retry starts from stock MCore. Raises RuntimeError for a
    megatron-core version not in TESTED_MCORE.
    """
    if torch.cuda.is_available():
        return False
    version = require_mcore("scalerlt_mcore CPU backend")
    if cpu_backend_enabled():
        return True
    undo = []  # one restore callable per applied patch, in order
    try:
        for target, replacement in _patch_table(version):
            undo.append(_apply(target, replacement))
        undo.append(_quiet_rng_fork_warning())
    except BaseException:
        for restore in reversed(undo):
            restore()
        raise
    setattr(torch.cuda, _MARKER, True)
    return True


def _apply(target: str, replacement):
    """Replace one attribute; `replacement(original)` builds the new value. Returns a callable
    that puts the owner's own attribute back exactly (or removes the override of an inherited
    one) and drops the target from APPLIED."""
    owner, name = resolve(target)
    own = vars(owner).get(name, _MISSING)
    setattr(owner, name, replacement(getattr(owner, name)))
    APPLIED.append(target)

    def restore() -> None:
        if own is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, own)
        APPLIED.remove(target)

    return restore


# --- torch.cuda replacements (each raises without CUDA in stock torch) ---------------------


def _current_device(original):
    """torch.cuda.current_device: MCore allocates params and grad buffers on it; use the CPU."""
    return lambda: torch.device("cpu")


def _get_rng_state(original):
    """torch.cuda.get_rng_state: the RNG tracker forks the CUDA generator; use the CPU one."""
    return lambda device="cuda": torch.get_rng_state()


def _set_rng_state(original):
    """torch.cuda.set_rng_state: the RNG tracker restores the CUDA generator; use the CPU one."""
    return lambda new_state, device="cuda": torch.set_rng_state(new_state)


def _manual_seed(original):
    """torch.cuda.manual_seed: the RNG tracker seeds the CUDA generator; seed the CPU one."""
    return lambda seed: torch.default_generator.manual_seed(int(seed))


def _mcore_get_rng_state(original):
    """random._get_cuda_rng_state: reads torch.cuda.default_generators; use the CPU generator."""
    return lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()


def _mcore_set_rng_state(original):
    """random._set_cuda_rng_state: writes the CUDA generator; use the CPU generator."""
    return lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


class _CpuStream:
    """Stand-in for torch.cuda.Stream: CPU ops are synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _stream_class(original):
    """torch.cuda.Stream: DDP makes a communication stream; use a no-op one."""
    return _CpuStream


def _current_stream(original):
    """torch.cuda.current_stream/default_stream: DDP orders grad reduction on it; no-op."""
    return lambda device=None: _CpuStream()


def _stream_context(original):
    """torch.cuda.stream(s): DDP runs bucket reduction under a side stream; no-op context."""
    return lambda stream=None: contextlib.nullcontext()


def _synchronize(original):
    """torch.cuda.synchronize: CPU work is already synchronous."""
    return lambda device=None: None


class _DropRngForkWarning(logging.Filter):
    """Drops MCore's 'CPU RNG state changed within GPU RNG context' warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_LOGGER = "megatron.core.tensor_parallel.random"
RNG_FILTER = f"{_RNG_LOGGER}:logger (filter)"  # ledger target of the filter (every version)


def _quiet_rng_fork_warning():
    """RNG tracker fork warns when the CPU generator moves inside a fork; here the tracked
    generator *is* the CPU generator, so every dropout inside a fork would warn. Returns the
    callable that removes the filter again."""
    logger, drop = logging.getLogger(_RNG_LOGGER), _DropRngForkWarning()
    logger.addFilter(drop)
    APPLIED.append(RNG_FILTER)

    def restore() -> None:
        logger.removeFilter(drop)
        APPLIED.remove(RNG_FILTER)

    return restore


# --- MCore functions called through under _CudaAsCpu -----------------------------------------


def _is_cuda(device) -> bool:
    """True for 'cuda', 'cuda:N' and torch.device('cuda', N)."""
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaAsCpu(TorchFunctionMode):
    """Inside one wrapped MCore call: ``device='cuda'`` means CPU; with `cuda_type_names`,
    a CPU tensor's ``.type()`` answers with its CUDA name (e.g. 'torch.cuda.FloatTensor')."""

    def __init__(self, cuda_type_names: bool = False):
        super().__init__()
        self.cuda_type_names = cuda_type_names

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.cuda_type_names and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0])
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _cuda_type_name(tensor: torch.Tensor) -> str:
    """'torch.FloatTensor' -> 'torch.cuda.FloatTensor' for CPU tensors."""
    name = torch.Tensor.type(tensor)
    if tensor.device.type == "cpu":
        return name.replace("torch.", "torch.cuda.", 1)
    return name


def _call_through(cuda_type_names: bool = False):
    """Build a replacement that calls the original under `_CudaAsCpu`."""

    def replacement(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            with _CudaAsCpu(cuda_type_names):
                return original(*args, **kwargs)

        return wrapper

    return replacement


_OPT = "megatron.core.optimizer.optimizer"
_CLIP = "megatron.core.optimizer.clip_grads"
_SCALER = "megatron.core.optimizer.grad_scaler"
_SOFTMAX = "megatron.core.fusions.fused_softmax"


def _patch_table(version: str | None = None) -> list[tuple[str, object]]:
    """The patches for MCore `version` (default: the installed one) as (target 'module:attr',
    replacement builder), in order. Mirrors patches/README.md."""
    version = version or found_mcore_version()
    return [(target, build) for target, build, versions in _PATCHES if version in versions]


_ALL = TESTED_MCORE
_V19 = ("0.19.2",)  # rows for code that megatron-core 0.19 added

# (target, replacement builder, MCore versions it applies to)
_PATCHES: list[tuple[str, object, tuple]] = [
    ("torch.cuda:current_device", _current_device, _ALL),
    ("torch.cuda:get_rng_state", _get_rng_state, _ALL),
    ("torch.cuda:set_rng_state", _set_rng_state, _ALL),
    ("torch.cuda:manual_seed", _manual_seed, _ALL),
    ("megatron.core.tensor_parallel.random:_get_cuda_rng_state", _mcore_get_rng_state, _ALL),
    ("megatron.core.tensor_parallel.random:_set_cuda_rng_state", _mcore_set_rng_state, _ALL),
    ("torch.cuda:Stream", _stream_class, _ALL),
    ("torch.cuda:current_stream", _current_stream, _ALL),
    ("torch.cuda:default_stream", _current_stream, _ALL),
    ("torch.cuda:stream", _stream_context, _ALL),
    ("torch.cuda:synchronize", _synchronize, _ALL),
    # causal / sliding-window softmax masks on device="cuda" (imported by name there)
    (f"{_SOFTMAX}:get_default_causal_mask", _call_through(), _ALL),
    (f"{_SOFTMAX}:get_sliding_window_causal_mask", _call_through(), _ALL),
    # found_inf, _dummy_overflow_buf, _scale_one on device='cuda'
    (f"{_OPT}:MixedPrecisionOptimizer.__init__", _call_through(), _ALL),
    # _scale on device='cuda'
    (f"{_OPT}:FP32Optimizer.__init__", _call_through(), _ALL),
    # param.type() == 'torch.cuda.FloatTensor' checks while building param groups
    (f"{_OPT}:Float16OptimizerWithFloat16Params.__init__", _call_through(True), _ALL),
    ("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
     _call_through(True), _ALL),
    # separate grad-norm group flag on device='cuda', all-reduced before every clipped step
    (f"{_OPT}:MegatronOptimizer.has_grad_norm_group", _call_through(), _V19),
    # grad-norm / clip / zero-count buffers on device='cuda' (optimizer.py imports by name);
    # clip asserts grad.type() == 'torch.cuda.FloatTensor'
    (f"{_OPT}:get_grad_norm_fp32", _call_through(), _ALL),
    (f"{_OPT}:clip_grad_by_total_norm_fp32", _call_through(True), _ALL),
    (f"{_OPT}:count_zeros_fp32", _call_through(), _ALL),
    (f"{_CLIP}:get_grad_norm_fp32", _call_through(), _ALL),
    (f"{_CLIP}:clip_grad_by_total_norm_fp32", _call_through(True), _ALL),
    (f"{_CLIP}:count_zeros_fp32", _call_through(), _ALL),
    # loss-scale tensors on device='cuda' (fp16 only)
    (f"{_SCALER}:MegatronGradScaler.__init__", _call_through(), _ALL),
    (f"{_SCALER}:DynamicGradScaler.__init__", _call_through(), _ALL),
    # total_num_tokens on device='cuda'
    ("megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
     _call_through(), _ALL),
]
