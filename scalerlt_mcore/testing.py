"""Test harness: MCore model-parallel state on CPU/gloo, in-process or on spawned ranks.

- `model_parallel_context()`: world size 1 in the calling process (unit tests); with a TP
  degree t > 1, rank 0 of t on PyTorch's fake backend (models on ``meta`` only).
- `run_distributed(fn, world_size)`: `world_size` spawned processes, one per rank; returns
  each rank's return value and re-raises a rank's exception with its traceback.

Both enable the CPU backend, initialise model parallelism (PP=1, TP as given) and seed
MCore's RNG tracker, and always destroy the model-parallel state and the process group
afterwards. `model_parallel_context` also lets go of what its models would otherwise keep
alive for the rest of the process (its process groups: each gloo group holds threads and
sockets): MCore's caches (``_release_cached_models``) and the backward hooks of every MCore
DDP built inside it (``_releasable_ddp_hooks``).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from contextlib import contextmanager

import torch
import torch.distributed as dist

from scalerlt_mcore.cpu_backend import enable_cpu_backend
from scalerlt_mcore.mcore_compat import require_mcore


def _init_mcore(seed: int, tensor_model_parallel_size: int = 1, gloo: bool = True) -> None:
    """Model parallelism (TP as given, PP=1) on the current process group, RNG tracker
    seeded (MCore seeds each TP rank's tracker differently, as on GPUs). ``gloo`` False: no
    gloo groups beside the default backend's (a fake group has no peers to meet)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        create_gloo_process_groups=gloo)
    model_parallel_cuda_manual_seed(seed)


_GROUPS_KEPT_BY_DESTROY = ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                           "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO")
"""MCore's module globals that ``destroy_model_parallel`` leaves set (0.16.1 and 0.19.2)."""


def _destroy_mcore() -> None:
    """Destroy model-parallel state and the default process group, whichever exist, and drop
    the models MCore's caches still hold (``_release_cached_models``)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _drop_kept_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    _release_cached_models()


def _drop_kept_groups() -> None:
    """Unset what ``destroy_model_parallel`` leaves set: each group would keep its gloo threads
    polling."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        for name in _GROUPS_KEPT_BY_DESTROY:
            setattr(parallel_state, name, None)


def _release_cached_models() -> None:
    """MCore's ``RotaryEmbedding.forward`` (and the YaRN variant's) is an ``lru_cache`` keyed by
    the module: it keeps the last 32 RoPE models alive after their context, and with them the
    process groups their parallel state holds (each gloo group: three threads polling its
    sockets, and the sockets). Over a test suite that is thousands of threads (megatron-core
    0.19 models hold about 50 groups each) that slow every later test and exhaust file
    descriptors. Clearing the caches lets the groups go with the models."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    for cls in (RotaryEmbedding, YarnRotaryEmbedding):
        cache_clear = getattr(cls.forward, "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


class _ReleasableHook:
    """An MCore DDP backward hook that can be let go of (``hook = None``); after that, calling
    it is an error naming the cause."""

    __slots__ = ("hook",)

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, *args):
        if self.hook is None:
            raise RuntimeError("an MCore DistributedDataParallel built inside "
                               "model_parallel_context ran a backward pass after the context "
                               "exited (its process groups are destroyed)")
        return self.hook(*args)


@contextmanager
def _releasable_ddp_hooks():
    """Every backward hook an MCore ``DistributedDataParallel`` registers while this is active
    calls through a `_ReleasableHook`, which lets go of the hook on exit.

    DDP registers one hook per parameter on the parameter's ``AccumulateGrad`` autograd node;
    the hook closes over the DDP. The node is C++: Python's gc sees the node's hooks only while
    Python holds the node's only reference, and the distributed optimizer's parameter shards
    (views of the parameters) reference it too. With the optimizer reachable from the DDP (the
    config holds ``optimizer.scale_loss``, as in Megatron's training loop), DDP, model,
    optimizer, buffers and process groups form a cycle the gc cannot see, alive until the
    process exits. Letting go of the hooks breaks it. Written for the DDP of megatron-core
    0.16.1 and 0.19.2 (patches/README.md, "Test harness"), where ``_make_backward_post_hook``
    makes each of them; the method is restored on exit.
    """
    from megatron.core.distributed import DistributedDataParallel

    require_mcore("scalerlt_mcore.testing: releasing MCore DDP backward hooks")
    current = vars(DistributedDataParallel)["_make_backward_post_hook"]
    make = getattr(current, "stock", current)  # nested: the innermost context owns the hooks
    made = []

    def _make_backward_post_hook(self, param):
        made.append(_ReleasableHook(make(self, param)))
        return made[-1]

    _make_backward_post_hook.stock = make
    DistributedDataParallel._make_backward_post_hook = _make_backward_post_hook
    try:
        yield
    finally:
        DistributedDataParallel._make_backward_post_hook = current
        for hook in made:
            hook.hook = None


@contextmanager
def releasing_models():
    """What is built inside is not kept alive after it by MCore's caches, MCore's leftover
    module globals or MCore DDP's backward hooks (module docstring): for code that sets up
    model parallelism itself, as the main job run in-process does."""
    try:
        with _releasable_ddp_hooks():
            yield
    finally:
        _release_cached_models()
        _drop_kept_groups()


@contextmanager
def model_parallel_context(seed: int = 1234, tensor_model_parallel_size: int = 1):
    """MCore model-parallel state in this one process, destroyed on exit with its process
    group; the models built inside it keep neither alive after it (module docstring).

    TP 1: a world size 1 gloo group. TP t > 1: PyTorch's fake backend as rank 0 of t (its
    collectives do nothing), for models on ``meta``: rank 0's shard shapes, no values (what
    the plan command measures a TP degree by)."""
    if dist.is_initialized():
        raise RuntimeError("model_parallel_context: a process group is already initialised")
    if tensor_model_parallel_size < 1:
        raise ValueError(f"model_parallel_context: tensor_model_parallel_size must be >= 1, "
                         f"got {tensor_model_parallel_size}")
    enable_cpu_backend()
    _init_process_group(tensor_model_parallel_size)
    try:
        with _releasable_ddp_hooks():
            _init_mcore(seed, tensor_model_parallel_size, gloo=tensor_model_parallel_size == 1)
            yield
    finally:
        _destroy_mcore()


def _init_process_group(world_size: int) -> None:
    """This process as rank 0 of ``world_size``: gloo alone, else the fake backend."""
    if world_size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def thread_count() -> int:
    """Threads of this process (``/proc/self/task``; 0 where there is no /proc): a leaked
    process group shows as its gloo threads."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _to_cpu(value):
    """Detached CPU copies of every tensor in nested lists/tuples/dicts."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _worker(rank, world_size, port, seed, tp, timeout, fn, args, kwargs, results):
    """One rank: init gloo + MCore, run fn, report ('ok', pickled value) or ('error', text)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        enable_cpu_backend()
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            _init_mcore(seed, tp)
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            _destroy_mcore()
        results.put((rank, "ok", pickle.dumps(_to_cpu(value))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world_size: int = 2, *args, timeout: float = 500, mcore_seed: int = 1234,
                    tensor_model_parallel_size: int = 1, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on `world_size` spawned gloo ranks, with
    MCore's model parallelism initialised for ``tensor_model_parallel_size`` (data-parallel
    size world_size / tensor_model_parallel_size).

    `fn` must be picklable (a module-level function). Returns the per-rank return values in
    rank order. A rank's exception is re-raised here with its traceback; after `timeout`
    seconds every rank is killed and TimeoutError is raised.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(r, world_size, port, mcore_seed, tensor_model_parallel_size, timeout,
                          fn, args, kwargs, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, time.monotonic() + timeout)
    finally:
        _kill(procs)


def _collect(procs, results, world_size: int, deadline: float) -> list:
    """Per-rank values in rank order; raise on the first error, a dead rank, or the deadline."""
    values, dead_polls = {}, 0
    while len(values) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError("run_distributed: ranks did not finish in time") from None
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
            dead_polls = dead_polls + 1 if dead else 0
            if dead_polls > 10:  # 2 s grace for a report sent just before exit
                raise RuntimeError(f"rank {dead[0]} exited with code "
                                   f"{procs[dead[0]].exitcode} without a result") from None
            continue
        if status == "error":
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
        values[rank] = pickle.loads(payload)
    return [values[r] for r in range(world_size)]


def _kill(procs) -> None:
    """Terminate, then kill, every rank still running."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
