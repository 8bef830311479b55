"""Saved-tensor probe: peak bytes of tensors that autograd holds for backward during a step.

Counts each storage once while any graph node holds it; parameters are excluded (they are
resident anyway). Storages are told apart by identity, not address, so that tensors on
``meta`` (which have no address) count too. Tensors recomputed by activation checkpointing
during backward are not saved through these hooks and are not counted.
"""

import weakref

import torch


class _Held:
    __slots__ = ("probe", "key", "tensor", "__weakref__")

    def __init__(self, probe, key, tensor):
        self.probe, self.key, self.tensor = probe, key, tensor

    def __del__(self):
        self.probe._release(self.key)


class SavedTensorProbe:
    """``with SavedTensorProbe(model) as probe: step()``; then ``probe.peak_bytes``."""

    def __init__(self, model=None):
        params = model.parameters() if model is not None else []
        self._params = {p.untyped_storage()._cdata for p in params}
        self._live = {}  # storage ptr -> [bytes, refs]
        self.current_bytes = 0
        self.peak_bytes = 0
        self._held = weakref.WeakSet()  # what graph nodes still hold
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._params or storage.nbytes() == 0:
            return tensor
        entry = self._live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        entry[1] += 1
        held = _Held(self, key, tensor)
        self._held.add(held)
        return held

    def release(self) -> None:
        """Drop what a forward that is never backwarded still holds: a node that saved its own
        output holds itself through it, so that graph (its parameters, its process groups)
        would outlive the forward. Its backward cannot run afterwards."""
        for held in list(self._held):
            held.tensor = None

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key):
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current_bytes -= entry[0]
            del self._live[key]
