"""The memory layouts PyTorch's CUDA attention kernels assume, checked on ``meta``.

The CUDA fused ops' ``meta`` kernels reproduce the CUDA ops' output layouts (flash writes its
output [B, H, M, D] stored as [B, M, H, D]; the memory-efficient op likewise). Some backward
kernels then read their inputs by computed offsets, ignoring strides (docs/design.md, "The
CUDA path"):

- flash-attention 2's backward reads ``logsumexp`` at ``(b*H + h)*M + row``: it must be
  contiguous;
- the memory-efficient backward reads ``out`` with a row stride of ``H*D``: ``out`` [B, H, M, D]
  must be stored batch-major, i.e. ``out.transpose(1, 2)`` contiguous;
- both need the last dimension of q, k, v, out and grad_out dense (stride 1).

A ``TorchDispatchMode`` intercepts the aten ops the cascade calls while its forward and backward
run on ``meta`` and asserts each layout, over every (kernel, half dtype, K/V grouping, prefix
batch, prefix-leaf dtype). A cascade that hands a kernel a view of the wrong layout gives wrong
gradients on a GPU with no error; here it fails.
"""

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scalerlt_mcore.model import kernels

aten = torch.ops.aten
META = torch.device("meta")
FLASH_BWD = aten._scaled_dot_product_flash_attention_backward.default
EFFICIENT_BWD = aten._scaled_dot_product_efficient_attention_backward.default
FORWARDS = (aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default)


def _dense_last(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1


def _batch_major(t: torch.Tensor) -> bool:
    """[B, H, M, D] stored as [B, M, H, D] (row stride H*D)."""
    return t.transpose(1, 2).is_contiguous()


class LayoutChecker(TorchDispatchMode):
    """Records every violation of a kernel's assumed layout as 'op: what'."""

    def __init__(self):
        super().__init__()
        self.violations, self.seen = [], []

    def _require(self, op, ok: bool, what: str):
        if not ok:
            self.violations.append(f"{op}: {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FORWARDS:
            self.seen.append(func)
            for name, t in zip(("query", "key", "value"), args[:3]):
                self._require(func, _dense_last(t), f"{name} last dim strided {t.stride()}")
        elif func is FLASH_BWD:
            self.seen.append(func)
            dout, q, k, v, out, lse = args[:6]
            for name, t in zip(("grad_out", "query", "key", "value", "out"),
                               (dout, q, k, v, out)):
                self._require(func, _dense_last(t), f"{name} last dim strided {t.stride()}")
            self._require(func, lse.is_contiguous(),
                          f"logsumexp {tuple(lse.shape)} strides {lse.stride()} not contiguous")
        elif func is EFFICIENT_BWD:
            self.seen.append(func)
            dout, q, k, v, _bias, out, lse = args[:7]
            for name, t in zip(("grad_out", "query", "key", "value"), (dout, q, k, v)):
                self._require(func, _dense_last(t), f"{name} last dim strided {t.stride()}")
            self._require(func, _batch_major(out),
                          f"out {tuple(out.shape)} strides {out.stride()} not batch-major")
            self._require(func, lse.is_contiguous(),
                          f"logsumexp {tuple(lse.shape)} strides {lse.stride()} not contiguous")
        return func(*args, **kwargs)


HEADS = 8
GROUPINGS = {"group_per_head": 8, "gqa": 2, "one_group": 1}
CASES = list(itertools.product(("flash", "efficient"), (torch.bfloat16, torch.float16),
                               GROUPINGS, ("Bp1", "BpB"), ("query_dtype", "fp32")))


def _ids(case) -> str:
    kernel, dtype, grouping, bp, leaves = case
    return f"{kernel}-{str(dtype)[6:]}-{grouping}-{bp}-{leaves}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_cascade_hands_each_cuda_kernel_its_layout(case):
    kernel, dtype, grouping, bp, leaves = case
    S, B, P, hn, groups = 6, 4, 5, 16, GROUPINGS[grouping]
    Bp = 1 if bp == "Bp1" else B
    leaf_dtype = dtype if leaves == "query_dtype" else torch.float32

    def leaf(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt, device=META, requires_grad=True)

    q, k, v = leaf(S, B, HEADS, hn), leaf(S, B, groups, hn), leaf(S, B, groups, hn)
    pk, pv = leaf(P, Bp, groups, hn, dt=leaf_dtype), leaf(P, Bp, groups, hn, dt=leaf_dtype)
    checker = LayoutChecker()
    with checker:
        out = kernels.cascade_prefix_attention(q, k, v, pk, pv, hn ** -0.5, kernel=kernel)
        out.backward(torch.empty_like(out))
    assert {FLASH_BWD if kernel == "flash" else EFFICIENT_BWD} <= set(checker.seen)
    assert checker.violations == []
    for t in (q, k, v, pk, pv):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype


def test_the_checker_catches_each_wrong_layout():
    """The checker itself: a strided log-sum-exp to flash, a head-major out to efficient."""
    q = torch.empty(2, 4, 32, 16, dtype=torch.bfloat16, device=META)
    head_major_out = torch.empty(2, 4, 32, 16, dtype=torch.bfloat16, device=META)
    strided_lse = torch.empty(4, 2, 32, device=META).transpose(0, 1)  # [2, 4, 32] strided
    checker = LayoutChecker()
    with checker:
        FLASH_BWD(q, q, q, q, q, strided_lse, torch.empty(0, device=META),
                  torch.empty(0, device=META), 32, 32, 0.0, False,
                  torch.empty(2, dtype=torch.int64, device=META),
                  torch.empty((), dtype=torch.int64, device=META), scale=0.25)
        EFFICIENT_BWD(q, q, q, q, None, head_major_out, torch.empty(2, 4, 32, device=META),
                      torch.empty(2, dtype=torch.int64, device=META),
                      torch.empty((), dtype=torch.int64, device=META), 0.0,
                      [True, True, True, False], False, scale=0.25)
    assert len(checker.violations) == 2
    assert "logsumexp" in checker.violations[0] and "batch-major" in checker.violations[1]


def test_kernels_bind_the_default_overloads():
    """torch 2.13 adds a ``.quantized`` overload of the flash op: the kernels call ``.default``."""
    for kernel in kernels.LSE_KERNELS.values():
        for op in (kernel.forward_op, kernel.backward_op):
            assert isinstance(op, torch._ops.OpOverload) and op._overloadname == "default"
            assert op.__name__.split(".")[0] in kernels.OP_SIGNATURES


def test_an_unsupported_op_schema_is_an_error_naming_the_op():
    kernels.check_op_schemas()  # this torch's schemas are the supported ones
    changed = dict(kernels.OP_SIGNATURES)
    positional, keywords, n_out = changed["_scaled_dot_product_flash_attention_backward"]
    changed["_scaled_dot_product_flash_attention_backward"] = (positional, keywords, n_out + 1)
    with pytest.raises(RuntimeError, match=r"aten\._scaled_dot_product_flash_attention_backward"
                                           r"\.default has an unsupported schema"):
        kernels.check_op_schemas(changed)
