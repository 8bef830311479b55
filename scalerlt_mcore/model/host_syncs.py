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
- ``host_read``: ``Tensor.tolist`` / ``Tensor.numpy`` (on CUDA, a ``.cpu().numpy()`` then
  counts twice: an upper bound);
- ``data_dependent``: ops whose output shape or validity check needs a device value on the
  host (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without
  ``output_size``, ``multinomial`` (its input check reads ``.item()``), indexing with a
  boolean mask).

A host-to-device copy is not a sync (counted apart as ``h2d``, not in ``total``).

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
SYNC_KINDS = ("scalar", "d2h", "host_read", "data_dependent")
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
    """'d2h', 'h2d' or None for a copy op (read before it runs: a copy out of ``meta``
    raises)."""
    if func is aten._to_copy.default:
        src, dst = _device(args[0]), kwargs.get("device")
        dst = None if dst is None else torch.device(dst)
    else:  # copy_(dst, src) / copy(self, src)
        dst, src = _device(args[0]), _device(args[1])
    if src is None or dst is None or src == dst:
        return None
    if dst.type == "cpu" and src.type != "cpu":
        return "d2h"
    if src.type == "cpu" and dst.type != "cpu":
        return "h2d"
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


def count_host_syncs(fn, *args, **kwargs) -> tuple:
    """Run ``fn(*args, **kwargs)`` under a ``HostSyncCounter`` -> (its result, the counter)."""
    with HostSyncCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter
