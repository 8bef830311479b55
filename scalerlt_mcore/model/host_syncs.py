"""Counting host syncs: the ops that make the host wait for the device.

On a GPU every read of a device value on the host (``t.item()``, ``int(t)``, ``bool(t)``,
``t.tolist()``, ``t.cpu()``) waits for the device queue to drain, so the host can no longer run
ahead of the GPU (and a CUDA graph cannot be captured around it). ``HostSyncCounter`` is a
``TorchDispatchMode`` that counts such ops by kind while it is active, whatever the device:
on CPU it counts what *would* be a sync on CUDA, which is what the CPU tests and
``benchmarks/decode.py`` measure. Counted:

- ``scalar``: a tensor value read on the host (``aten._local_scalar_dense``, ``aten.item``,
  ``aten.is_nonzero``, ``aten.equal``);
- ``d2h``: a copy from a device to the host (``_to_copy`` / ``copy_`` / ``to`` landing on the
  CPU from another device);
- ``blocking_h2d``: a copy from the host to a device that the host waits for: ``non_blocking``
  False (PyTorch synchronises the stream after it), or on CUDA from pageable memory; and
  ``torch.tensor`` / ``torch.as_tensor`` of Python data with a device (built on the host,
  copied blocking, unseen by dispatch);
- ``host_read``: ``Tensor.tolist`` / ``Tensor.numpy`` (on CUDA, a ``.cpu().numpy()`` then
  counts twice: an upper bound);
- ``data_dependent``: ops whose output shape or validity check needs a device value on the
  host (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without
  ``output_size``, ``multinomial`` (its input check reads ``.item()``), indexing with a
  boolean mask).

A non-blocking host-to-device copy (``upload``: from pinned memory on CUDA) is not a sync
(counted apart as ``h2d``, not in ``total``).

Tensors that live on the host on every device (a decoding cache's ``lengths``, the positions
computed from them) are marked with ``mark_host``: ops whose tensor inputs are all marked run
on the host on CUDA too, so they are not counted, and their outputs are marked in turn.
"""

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SCALAR_OPS = frozenset({aten._local_scalar_dense.default, aten.item.default,
                        aten.is_nonzero.default, aten.equal.default})
DATA_DEPENDENT_OPS = frozenset({
    aten.nonzero.default, aten.masked_select.default, aten.multinomial.default,
    aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
    aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor,
})
COPY_OPS = frozenset({aten._to_copy.default, aten.copy_.default, aten.copy.default})
INDEX_OPS = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default})
SYNC_KINDS = ("scalar", "d2h", "host_read", "data_dependent", "blocking_h2d")
"""The kinds that ``total`` adds up."""


_HOST = "_scalerlt_host_resident"


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a host-resident tensor (on every device; see the module docstring)."""
    setattr(t, _HOST, True)
    return t


def _on_host(t: torch.Tensor) -> bool:
    return getattr(t, _HOST, False)


def _tensors(args, kwargs) -> list:
    flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    return [a for a in flat if isinstance(a, torch.Tensor)]


def _device(x):
    return x.device if isinstance(x, torch.Tensor) else None


def _copy_direction(func, args, kwargs):
    """'d2h', 'h2d', 'blocking_h2d' or None for a copy op (read before it runs: a copy out of
    ``meta`` raises)."""
    if func is aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        dst, non_blocking = None if dst is None else torch.device(dst), kwargs.get("non_blocking")
    else:  # copy_(dst, src, non_blocking) / copy(self, src, non_blocking)
        dst, src, non_blocking = _device(args[0]), args[1], args[2] if len(args) > 2 else False
    if not isinstance(src, torch.Tensor) or dst is None or src.device == dst:
        return None
    if dst.type == "cpu" and src.device.type != "cpu":
        return "d2h"
    if src.device.type == "cpu" and dst.type != "cpu":
        pageable = dst.type == "cuda" and not src.is_pinned()
        return "blocking_h2d" if not non_blocking or pageable else "h2d"
    return None


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostSyncCounter(TorchDispatchMode):
    """Counts host syncs by kind (``counts``; ``total``: every kind in ``SYNC_KINDS``).

    ``with HostSyncCounter() as c: ...; c.total``. ``reset()`` starts a new count (e.g. after
    a warm-up)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()
        self._patched = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return sum(self.counts[k] for k in SYNC_KINDS)

    def reset(self) -> None:
        self.counts.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args, kwargs)
        on_host = bool(inputs) and all(_on_host(t) for t in inputs)
        if not on_host:
            self._count(func, args, kwargs)  # first: the op may raise (a sync on ``meta``)
        out = func(*args, **kwargs)
        if on_host:
            for t in _tensors(out, {}):
                mark_host(t)
        return out

    def _count(self, func, args, kwargs) -> None:
        if func in SCALAR_OPS:
            self.counts["scalar"] += 1
        elif func in DATA_DEPENDENT_OPS:
            self.counts["data_dependent"] += 1
        elif func in COPY_OPS:
            direction = _copy_direction(func, args, kwargs)
            if direction is not None:
                self.counts[direction] += 1
        elif func in INDEX_OPS and _has_bool_index(args):
            self.counts["data_dependent"] += 1

    def __enter__(self):
        self._patched.__enter__()
        for name in ("tolist", "numpy"):
            self._patched.enter_context(_counting_method(self, name))
        for name in ("tensor", "as_tensor"):
            self._patched.enter_context(_counting_factory(self, name))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patched.__exit__(*exc)


@contextlib.contextmanager
def _counting_method(counter: HostSyncCounter, name: str):
    """``torch.Tensor.<name>`` counted as a ``host_read`` while the counter is active."""
    real = getattr(torch.Tensor, name)

    def counted(self, *args, **kwargs):
        if not _on_host(self):
            counter.counts["host_read"] += 1
        return real(self, *args, **kwargs)

    setattr(torch.Tensor, name, counted)
    try:
        yield
    finally:
        setattr(torch.Tensor, name, real)


@contextlib.contextmanager
def _counting_factory(counter: HostSyncCounter, name: str):
    """``torch.<name>`` of Python data onto a device counted as a ``blocking_h2d`` while the
    counter is active (a tensor or array argument's copy is dispatched, so counted there)."""
    real = getattr(torch, name)

    def counted(data, *args, **kwargs):
        device = kwargs.get("device", args[1] if name == "as_tensor" and len(args) > 1 else None)
        python = not isinstance(data, torch.Tensor) and not hasattr(data, "__array__")
        if python and device is not None and torch.device(device).type != "cpu":
            counter.counts["blocking_h2d"] += 1
        return real(data, *args, **kwargs)

    setattr(torch, name, counted)
    try:
        yield
    finally:
        setattr(torch, name, real)


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """``host`` on ``device`` without making the host wait: copied non-blocking, from pinned
    memory when ``device`` is CUDA (a copy from pageable memory may wait for the stream)."""
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def upload_indices(lists: list, device) -> list:
    """Index lists as long tensors on ``device``: one ``upload``, split into views."""
    flat = torch.tensor([i for rows in lists for i in rows], dtype=torch.long, device="cpu")
    return list(upload(flat, device).split([len(rows) for rows in lists]))


def count_host_syncs(fn, *args, **kwargs) -> tuple:
    """Run ``fn(*args, **kwargs)`` under a ``HostSyncCounter`` -> (its result, the counter)."""
    with HostSyncCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter
