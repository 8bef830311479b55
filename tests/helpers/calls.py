"""Counting a step's calls: the model's forwards by token count, and backward calls inside and
outside the schedule's ``no_sync`` (the sync-enabled part of a step)."""

import torch


class Calls:
    """Install with ``model.config.no_sync_func = calls.no_sync``; ``lengths``: the token count
    of every forward; ``synced`` / ``unsynced``: backward calls outside / inside no_sync."""

    def __init__(self, model, monkeypatch):
        self.lengths, self.synced, self.unsynced, self.in_no_sync = [], 0, 0, False
        model.embedding.register_forward_pre_hook(self._forward, with_kwargs=True)
        backward = torch.autograd.backward

        def counted(*args, **kwargs):
            if self.in_no_sync:
                self.unsynced += 1
            else:
                self.synced += 1
            return backward(*args, **kwargs)

        monkeypatch.setattr(torch.autograd, "backward", counted)

    def _forward(self, module, args, kwargs):
        self.lengths.append(kwargs.get("input_ids", args[0] if args else None).shape[1])

    def no_sync(self):
        calls = self

        class _Ctx:
            def __enter__(self):
                calls.in_no_sync = True

            def __exit__(self, *exc):
                calls.in_no_sync = False

        return _Ctx()
