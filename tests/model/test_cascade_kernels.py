"""The fused cascade kernels' algebra on CPU, and how a kernel is chosen.

The CUDA kernels (``CudaFlashKernel``, ``CudaEfficientKernel``) run the same autograd Function
as the CPU flash kernel. Here their ops are replaced by PyTorch's CPU flash ops wrapped in the
CUDA ops' calling conventions (the flash op's nine outputs and ``cum_seq``/``max_q`` backward
arguments; the memory-efficient op's log-sum-exp padded to a multiple of 32 queries, with
garbage in the padding): values and gradients must equal an explicit masked softmax written
here. The wrappers check every argument the Function passes, so a wrong calling convention
fails here. The real CUDA ops run on ``meta`` in test_device_meta.py and on a GPU in
test_cuda.py.
"""

import logging
import math
import re

import pytest
import torch

from scalerlt_mcore.model import kernels
from scalerlt_mcore.model.config import CASCADE_KERNELS, LoopedTransformerConfig

aten = torch.ops.aten
CPU_FWD = aten._scaled_dot_product_flash_attention_for_cpu
CPU_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward


def explicit_prefix_attention(q, k, v, pk, pv, scale):
    """Masked softmax over [prefix; own keys] in plain PyTorch: prefix all visible, own keys
    causal, GQA by repeating K/V heads. Returns [B, heads, S, d]."""
    S, B, heads, _ = q.shape
    P, rep = pk.shape[0], heads // k.shape[2]
    keys = torch.cat([pk.expand(-1, B, -1, -1), k]).repeat_interleave(rep, dim=2)  # [P+S,B,h,d]
    vals = torch.cat([pv.expand(-1, B, -1, -1), v]).repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, keys) * scale
    future = torch.ones(S, P + S, dtype=torch.bool).triu(diagonal=P + 1)
    return torch.einsum("bhqk,kbhd->bhqd", scores.masked_fill(future, -math.inf).softmax(-1),
                        vals)


# ---- the CPU flash ops in the CUDA ops' calling conventions ---------------------------------


def flash_forward(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
    assert dropout_p == 0.0 and return_debug_mask is False
    out, lse = CPU_FWD(q, k, v, 0.0, is_causal, scale=scale)
    rng = torch.tensor([q.shape[2], k.shape[2]])  # tagged: the backward must get it back
    return out, lse, None, None, q.shape[2], k.shape[2], rng, torch.tensor(0), torch.empty(0)


def flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
                   seed, offset, *, scale):
    assert cum_q is None and cum_k is None and dropout_p == 0.0
    assert (max_q, max_k) == (q.shape[2], k.shape[2]) == tuple(seed.tolist())
    assert lse.shape == q.shape[:3] and out.shape == q.shape
    return CPU_BWD(dout, q, k, v, out, lse, 0.0, is_causal, scale=scale)


def _padded(M: int) -> int:
    return -(-M // 32) * 32


def efficient_forward(q, k, v, bias, compute_lse, dropout_p, is_causal, *, scale):
    assert bias is None and compute_lse is True and dropout_p == 0.0
    out, lse = CPU_FWD(q, k, v, 0.0, is_causal, scale=scale)
    M = q.shape[2]
    lse_pad = torch.full((*lse.shape[:-1], _padded(M)), math.nan, dtype=lse.dtype)
    lse_pad[..., :M] = lse  # the padding holds garbage: it must never be read
    return out, lse_pad, torch.tensor(M), torch.tensor(0)


def efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                       is_causal, *, scale):
    M = q.shape[2]
    assert bias is None and dropout_p == 0.0 and int(seed) == M
    assert list(grad_input_mask) == [True, True, True, False]
    assert lse.shape == (*q.shape[:2], _padded(M)), "log-sum-exp not in the padded layout"
    dq, dk, dv = CPU_BWD(dout, q, k, v, out, lse[..., :M].contiguous(), 0.0, is_causal,
                         scale=scale)
    return dq, dk, dv, None


class _OnCpu:
    """A CUDA kernel class whose ops are the CPU wrappers above: takes CPU tensors of any
    float dtype (the CPU flash op's range)."""

    device_types = ("cpu",)

    def _unsupported_dtype(self, q):
        return None


class CpuAsCudaFlash(_OnCpu, kernels.CudaFlashKernel):
    pass


class CpuAsCudaEfficient(_OnCpu, kernels.CudaEfficientKernel):
    pass


SUBSTITUTED = {
    "flash": CpuAsCudaFlash(flash_forward, flash_backward),
    "efficient": CpuAsCudaEfficient(efficient_forward, efficient_backward),
    "cpu_flash": kernels.CpuFlashKernel(),
}


def _inputs(dtype, prefix_batch: int, seed: int, S: int = 5, B: int = 3, P: int = 6) -> list:
    """q [S, B, 4, 8], k/v [S, B, 2, 8] (GQA), prefix k/v [P, prefix_batch, 2, 8]."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(S, B, 4, 8), (S, B, 2, 8), (S, B, 2, 8), (P, prefix_batch, 2, 8),
              (P, prefix_batch, 2, 8)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
            for s in shapes]


def _value_and_grads(fn, inputs, cotangent) -> list:
    out = fn(*inputs, 1 / math.sqrt(inputs[0].shape[-1]))
    return [out, *torch.autograd.grad(out, inputs, cotangent)]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("prefix_batch", [1, 3])
@pytest.mark.parametrize("kernel", list(SUBSTITUTED))
def test_fused_cascade_equals_explicit_attention(kernel, prefix_batch, dtype, tol):
    """Values and gradients w.r.t. q, k, v and the prefix K/V. With one shared prompt the
    prefix product has M = 3 * 2 * 5 = 30 query rows (padded to 32 by the efficient op)."""
    inputs = _inputs(dtype, prefix_batch, seed=prefix_batch)
    cot = torch.randn(3, 4, 5, 8, generator=torch.Generator().manual_seed(9),
                      dtype=torch.float64).to(dtype)  # [B, heads, S, d]

    def fused(*args):
        return kernels.cascade_prefix_attention(*args, kernel=SUBSTITUTED[kernel])

    got = _value_and_grads(fused, inputs, cot)
    want = _value_and_grads(explicit_prefix_attention, inputs, cot)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dpk", "dpv"], got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert (a - b).abs().max().item() <= tol * b.abs().max().item(), name


def _saved_shapes(kernel: str, inputs: list) -> list:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t,
                                                  lambda t: t):
        kernels.cascade_prefix_attention(*inputs, 0.3, kernel=kernel)
    return saved


def test_fused_cascade_saves_no_score_matrix():
    """The fused path saves q, k, v, the prefix K/V, the output and the log-sum-exp; the
    matmul reference saves [*, M, P] scores (which the probe must see)."""
    inputs = _inputs(torch.float32, 1, seed=0, S=5, P=7)
    shapes = {name: _saved_shapes(name, inputs) for name in ("cpu_flash", "matmul")}
    M, P = 3 * 2 * 5, 7
    assert any(s[-2:] == (M, P) for s in shapes["matmul"])
    assert not any(s[-2:] in ((M, P), (5, 5)) for s in shapes["cpu_flash"]), shapes["cpu_flash"]


# ---- choosing the kernel ---------------------------------------------------------------------


def _q(dtype, device="meta", head_dim=8):
    return torch.empty(5, 3, 4, head_dim, dtype=dtype, device=device)


@pytest.mark.parametrize("device, dtype, head_dim, expected", [
    ("cpu", torch.float64, 8, "cpu_flash"),
    ("cpu", torch.bfloat16, 8, "cpu_flash"),
    ("meta", torch.bfloat16, 8, "matmul"),  # no fused kernel is the default off CPU/CUDA
])
def test_auto_kernel_by_device_and_dtype(device, dtype, head_dim, expected):
    got = kernels.resolve_cascade_kernel("auto", _q(dtype, device, head_dim))
    assert getattr(got, "name", got) == expected


@pytest.mark.parametrize("dtype, head_dim, expected, reason", [
    (torch.bfloat16, 64, "flash", None),
    (torch.float16, 128, "flash", None),
    (torch.float32, 64, "efficient", "flash kernel skipped.*not torch.float32"),
    (torch.bfloat16, 12, "matmul", "head dim 12 is not a multiple of 8"),
    (torch.float64, 64, "matmul", "efficient kernel skipped.*not torch.float64"),
])
def test_auto_kernel_on_cuda_order_and_logged_fallback(monkeypatch, caplog, dtype, head_dim,
                                                        expected, reason):
    """On CUDA (meta tensors stand in; the device-type table points meta at CUDA's order):
    flash where it supports dtype and head dim, else efficient, else matmul, each skip
    logged with its reason."""
    monkeypatch.setitem(kernels.AUTO_ORDER, "meta", kernels.AUTO_ORDER["cuda"])
    monkeypatch.setattr(kernels, "_logged", set())
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        got = kernels.resolve_cascade_kernel("auto", _q(dtype, "meta", head_dim))
    assert getattr(got, "name", got) == expected
    if reason is None:
        assert not caplog.records
    else:
        messages = [r.getMessage() for r in caplog.records]
        assert any(re.search(reason, m) for m in messages), messages


@pytest.mark.parametrize("choice, q, match", [
    ("flash", _q(torch.float32), "'flash' cannot run this attention: it supports "
                                 "torch.float16, torch.bfloat16, not torch.float32"),
    ("flash", _q(torch.bfloat16, "cpu"), "'flash' cannot run .* runs on cuda/meta tensors, "
                                         "not cpu"),
    ("efficient", _q(torch.float64), "'efficient' cannot run .* not torch.float64"),
    ("cpu_flash", _q(torch.int64, "cpu"), "'cpu_flash' cannot run .* floating point"),
    ("fast", _q(torch.float32), "looped_cascade_kernel must be one of"),
])
def test_explicit_kernel_that_cannot_run_is_a_clear_error(choice, q, match):
    with pytest.raises(ValueError, match=match):
        kernels.resolve_cascade_kernel(choice, q)


def test_config_field_lists_every_kernel_and_rejects_others():
    assert set(CASCADE_KERNELS) == {"auto", "matmul", *kernels.LSE_KERNELS}
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2,
                use_cpu_initialization=True)
    assert LoopedTransformerConfig(**base).looped_cascade_kernel == "auto"
    with pytest.raises(ValueError, match="looped_cascade_kernel must be one of"):
        LoopedTransformerConfig(**base, looped_cascade_kernel="triton")
