"""The host-sync counter (``model/host_syncs.py``): each op kind that makes the host wait for
the device on CUDA is counted on CPU too (a blocking host-to-device copy among them, seen on
``meta``); pure tensor ops and non-blocking uploads are not."""

import torch

from scalerlt_mcore.model.host_syncs import (
    HostSyncCounter,
    count_host_syncs,
    mark_host,
    upload,
    upload_indices,
)


def test_counts_a_scalar_read_as_one_and_tensor_ops_as_zero():
    t = torch.arange(6.0)
    value, counter = count_host_syncs(lambda: int(t.max()))
    assert value == 5 and counter.total == 1 and counter.counts["scalar"] == 1
    _, counter = count_host_syncs(lambda: (t * 2).softmax(-1).cumsum(0)[t.long() % 3])
    assert counter.total == 0


def test_counts_every_kind():
    t = torch.tensor([0.5, -1.0, 2.0])
    with HostSyncCounter() as c:
        bool(t.any())
        t.tolist()
        t.numpy()
        t.nonzero()
        t[t > 0]
        torch.multinomial(t.abs(), 1)
        torch.tensor([1.0, 2.0]).to("meta", non_blocking=True)  # an upload: not a sync
    assert dict(c.counts) == {"scalar": 1, "host_read": 2, "data_dependent": 3, "h2d": 1}
    assert c.total == 6
    c.reset()
    assert c.total == 0
    assert torch.Tensor.tolist is not None and "counted" not in torch.Tensor.tolist.__name__


def test_a_copy_out_of_a_device_is_counted():
    with HostSyncCounter() as c:
        try:
            torch.empty(3, device="meta").cpu()  # meta cannot be read: the op still dispatches
        except (NotImplementedError, RuntimeError):
            pass
    assert c.counts["d2h"] == 1 and c.total == 1


def test_host_resident_tensors_and_what_is_computed_from_them_are_not_counted():
    lengths = mark_host(torch.tensor([3, 5]))
    device_side = torch.tensor([1, 2])
    with HostSyncCounter() as c:
        span = int((lengths + 1).max())
        lengths.tolist()
        lengths += 1
        int(lengths.max())
        assert c.total == 0 and span == 6
        int((lengths + device_side).max())  # mixed: the sum lives on the device
    assert c.total == 1


def test_blocking_uploads_are_syncs_and_upload_is_not():
    """On CUDA a host-to-device copy with non_blocking=False ends in a stream synchronize, and
    ``torch.tensor`` of a list with a device copies blocking (unseen by dispatch)."""
    host = torch.tensor([1, 2])
    with HostSyncCounter() as c:
        host.to("meta")
        torch.empty(2, dtype=torch.long, device="meta").copy_(host)
        torch.tensor([1, 2], device="meta")
        torch.as_tensor([1, 2], device="meta")
        torch.tensor([1, 2], device="cpu")  # stays on the host
    assert dict(c.counts) == {"blocking_h2d": 4} and c.total == 4
    with HostSyncCounter() as c:
        moved = upload(host, "meta")
        torch.empty(2, dtype=torch.long, device="meta").copy_(host, non_blocking=True)
        parts = upload_indices([[3], [1, 2], []], "meta")
    assert dict(c.counts) == {"h2d": 3} and c.total == 0
    assert moved.device.type == "meta" and [p.shape for p in parts] == [(1,), (2,), (0,)]
    assert [p.tolist() for p in upload_indices([[3], [1, 2], []], "cpu")] == [[3], [1, 2], []]
