"""The CUDA-facing attention paths: precision, copies and kernel routes, checked on CPU and
``meta`` (no GPU runs here; ``tools/gpu_kernel_cases.py`` checks the values on one).

- Prompt-once / tree attention off CPU (``chain_prefix_attention``) keeps its scores in fp32:
  bf16 within the GPU kernel cases' bound of an fp64 reference at logits of std 10 (4e-3;
  scores rounded to bf16: 2e-2 to 3e-2, past it); on CUDA each part is PyTorch's
  memory-efficient op, run here on ``meta``: no score matrix, aligned masks.
- No K/V is copied per layer application of a decode step: a masked grouped-query decode
  ``sdpa`` folds the query heads (its values checked on CPU), the chain attention keeps the
  queries grouped by KV head, and the training cascade repeats no heads at rep = 1.
- A fresh prefill builds no [B, s, T] mask; a decode step still does.
- The prefix backward probes the wide dtype without copying the queries to it.
- fp32 grouped-query SDPA off CPU never asks for ``enable_gqa`` (no fused CUDA kernel takes
  it in fp32: the math kernel would materialise [B, np, S, S] scores).
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from helpers.decode import build
from torch.utils._python_dispatch import TorchDispatchMode

from scalerlt_mcore.model import kernels

META = torch.device("meta")
_spec = importlib.util.spec_from_file_location(
    "gpu_kernel_cases", Path(__file__).resolve().parents[2] / "tools" / "gpu_kernel_cases.py")
gpu_kernel_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_kernel_cases)


class Allocations(TorchDispatchMode):
    """Every aten op run inside, with the tensors it allocates (outputs that are not views of
    an input): ``ops`` names, ``new`` (shape, dtype, nbytes) of each allocation."""

    def __init__(self):
        super().__init__()
        self.ops, self.new, self.calls = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func)
        self.calls.append((func, args))
        if not func._schema.is_mutable and not any(r.alias_info for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.new.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return out

    def bytes(self) -> int:
        return sum(n for _, _, n in self.new)


def _rnd(gen, *shape, std=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * std


def _chain_inputs(gen, s, B, heads, groups, hn, T, segments, std=1.0):
    """q [s, B, np, hn], own k/v [T, B, ng, hn], allowed [B, s, T] and one (pk, pv, seen) per
    segment ((P_j, N_j) in ``segments``), fp64; queries scaled by ``std`` (the logits' std
    at scale hn^-0.5)."""
    q = _rnd(gen, s, B, heads, hn, std=std)
    k, v = _rnd(gen, T, B, groups, hn), _rnd(gen, T, B, groups, hn)
    own = torch.randint(1, T - s + 2, (B,), generator=gen)  # each row's last slot + 1
    allowed = torch.arange(T)[None, None] < (own[:, None] + torch.arange(s)[None])[..., None]
    prefixes = []
    for P, n in segments:
        lengths = torch.randint(1, P + 1, (n,), generator=gen)
        seen = torch.arange(P)[None] < lengths[:, None]  # [N_j, P_j]
        prefixes.append((_rnd(gen, P, n, groups, hn), _rnd(gen, P, n, groups, hn), seen))
    return q, k, v, allowed, prefixes


def _dense_reference(q, k, v, allowed, prefixes, scale):
    """Softmax over each row's [segment keys of its path; own keys] as one dense product."""
    s, B, heads, hn = q.shape
    rep = heads // k.shape[2]
    keys, vals, seen = [], [], []
    for pk, pv, mask in prefixes:
        per = B // pk.shape[1]
        keys.append(pk.repeat_interleave(per, dim=1))  # [P_j, B, ng, hn]
        vals.append(pv.repeat_interleave(per, dim=1))
        seen.append(mask.repeat_interleave(per, dim=0)[:, None].expand(B, s, -1))
    keys = torch.cat([*keys, k]).repeat_interleave(rep, dim=2)  # [K, B, np, hn]
    vals = torch.cat([*vals, v]).repeat_interleave(rep, dim=2)
    seen = torch.cat([*seen, allowed], dim=2)  # [B, s, K]
    scores = torch.einsum("sbhd,kbhd->bhsk", q, keys) * scale
    probs = scores.masked_fill(~seen[:, None], -math.inf).softmax(-1)
    return torch.einsum("bhsk,kbhd->bhsd", probs, vals)  # [B, np, s, hn]


# ---- 1. fp32 scores off CPU --------------------------------------------------------------------

@pytest.mark.parametrize("groups", [8, 2])
def test_chain_attention_off_cpu_holds_bf16_at_the_kernel_bound(groups):
    """The branch CUDA takes (here with a graph recorded, so off the CPU decode path: the
    parts on ``attend_with_lse``), bf16 against fp64 from the same rounded inputs, within
    ``gpu_kernel_cases.BOUNDS`` relative to the reference's max, as the GPU check holds the
    fused kernels; logits of std 10 make rounded scores show (their error grows with the
    scores' size)."""
    gen = torch.Generator().manual_seed(groups)
    hn = 128
    inputs = _chain_inputs(gen, 1, 8, 8, groups, hn, 40, [(300, 2), (20, 4)], std=10.0)
    q, k, v, allowed, prefixes = inputs
    low = [t.bfloat16() for t in (q, k, v)]
    low_prefixes = [(pk.bfloat16(), pv.bfloat16(), seen) for pk, pv, seen in prefixes]
    want = _dense_reference(*(t.double() for t in low), allowed,
                            [(pk.double(), pv.double(), seen) for pk, pv, seen in low_prefixes],
                            hn ** -0.5)
    with torch.enable_grad():
        got = kernels.chain_prefix_attention(*low, allowed, low_prefixes, hn ** -0.5)
    assert got.dtype == torch.bfloat16
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= gpu_kernel_cases.BOUNDS[torch.bfloat16], err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("s", [1, 3])
def test_chain_attention_on_meta_runs_the_efficient_op(dtype, s):
    """Decoding off CPU (no gradient recorded): every part is one memory-efficient op call
    with the queries grouped by KV head, an additive mask in the queries' dtype whose rows
    are aligned for the CUDA kernel; no matmul, no score matrix, no K/V copy."""
    B, heads, groups, hn, T, segments = 4, 8, 2, 64, 40, [(24, 2), (10, 4)]
    q = torch.empty(s, B, heads, hn, device=META, dtype=dtype)
    k, v = (torch.empty(T, B, groups, hn, device=META, dtype=dtype) for _ in range(2))
    allowed = torch.empty(B, s, T, device=META, dtype=torch.bool)
    prefixes = [(torch.empty(P, n, groups, hn, device=META, dtype=dtype),
                 torch.empty(P, n, groups, hn, device=META, dtype=dtype),
                 torch.empty(n, P, device=META, dtype=torch.bool)) for P, n in segments]
    with torch.no_grad(), Allocations() as seen:
        out = kernels.chain_prefix_attention(q, k, v, allowed, prefixes, 0.125)
    assert out.shape == (B, heads, s, hn) and out.dtype == dtype
    calls = [a for f, a in seen.calls
             if f == kernels.aten._scaled_dot_product_efficient_attention.default]
    assert [(tuple(a[0].shape), tuple(a[1].shape)) for a in calls] == [
        ((B, groups, 4 * s, hn), (B, groups, T, hn)),
        ((4, groups, 4 * s, hn), (4, groups, 10, hn)),
        ((2, groups, 2 * 4 * s, hn), (2, groups, 24, hn))]
    for query, key, _, bias, *_ in calls:  # what the CUDA op checks of its bias
        assert bias.shape == (*query.shape[:-1], key.shape[-2]) and bias.dtype == dtype
        assert bias.stride(-1) == 1
        assert all(st % kernels.BIAS_ALIGN == 0 for st in bias.stride()[:-1]), bias.stride()
    assert not {torch.ops.aten.bmm.default, torch.ops.aten.mm.default} & set(seen.ops)
    assert not [n for n in seen.new if n[0][-1:] == (T,) and n[1] != torch.bool], seen.new


# ---- 3. no K/V copied per decode step ----------------------------------------------------------

class _SdpaShapes:
    """Stands in for ``F.scaled_dot_product_attention``: records each call's shapes and flags
    and allocates only its output (so that what the caller allocates can be counted)."""

    def __init__(self, monkeypatch):
        self.calls = []

        def record(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
            self.calls.append((q.dtype, q.shape[1], k.shape[1], attn_mask is not None,
                               is_causal, enable_gqa))
            return q.new_empty(*q.shape[:-1], v.shape[-1])

        monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", record)


def _decode_sdpa_inputs(dtype, B=16, heads=8, groups=2, T=1024, hn=64, device=META):
    q = torch.empty(1, B, heads, hn, dtype=dtype, device=device)
    k, v = (torch.empty(T, B, groups, hn, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, torch.empty(B, 1, 1, T, dtype=torch.bool, device=device)


def test_masked_gqa_decode_sdpa_copies_no_kv_on_meta(monkeypatch):
    """A decode step's masked grouped-query SDPA off CPU (16 rows, 1024 cached keys, 4 query
    heads per K/V head): the query heads are folded into the query length, so all it
    allocates besides the kernel's output is nothing (a K/V repeat: 32 MiB)."""
    q, k, v, allowed = _decode_sdpa_inputs(torch.bfloat16)
    sdpa = _SdpaShapes(monkeypatch)
    with Allocations() as seen:
        out = kernels.sdpa(q, k, v, allowed, 0.125)
    assert out.shape == (16, 8, 1, 64)
    assert sdpa.calls == [(torch.bfloat16, 2, 2, True, False, False)]
    assert seen.bytes() <= out.numel() * out.element_size(), seen.new


def test_folded_decode_sdpa_gives_the_repeated_heads_values():
    """The folded decode path on CPU (a graph recorded: off the CPU decode path), fp64,
    against masked softmax over the repeated K/V heads written here."""
    gen = torch.Generator().manual_seed(0)
    q = _rnd(gen, 1, 3, 6, 8)  # [1, b, np, hn]
    k, v = _rnd(gen, 9, 3, 2, 8), _rnd(gen, 9, 3, 2, 8)
    allowed = torch.rand(3, 1, 1, 9, generator=gen) > 0.4
    allowed[..., 0] = True
    with torch.enable_grad():
        got = kernels.sdpa(q, k, v, allowed, 0.3)
    keys, vals = (t.repeat_interleave(3, dim=2) for t in (k, v))  # [9, b, np, hn]
    scores = torch.einsum("sbhd,tbhd->bhst", q, keys) * 0.3
    probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    assert (got - torch.einsum("bhst,tbhd->bhsd", probs, vals)).abs().max() <= 1e-13


@pytest.mark.parametrize("groups", [8, 2], ids=["mha", "gqa"])
def test_chain_attention_copies_no_kv_per_layer_application_on_meta(groups):
    """Prompt-once decoding off CPU, one layer application after the forward's masks are made
    (``memo``): the bytes it allocates are a few query-sized outputs and accumulators (at
    most 16x its output), never a tensor of the cache's length (a K/V copy: 8 MiB)."""
    B, heads, hn, T, P = 16, 8, 64, 1024, 256
    q = torch.empty(1, B, heads, hn, device=META, dtype=torch.bfloat16)
    k, v = (torch.empty(T, B, groups, hn, device=META, dtype=torch.bfloat16) for _ in range(2))
    allowed = torch.empty(B, 1, T, device=META, dtype=torch.bool)
    prefixes = [(torch.empty(P, 4, groups, hn, device=META, dtype=torch.bfloat16),
                 torch.empty(P, 4, groups, hn, device=META, dtype=torch.bfloat16),
                 torch.empty(4, P, device=META, dtype=torch.bool))]
    memo = {}
    with torch.no_grad():
        kernels.chain_prefix_attention(q, k, v, allowed, prefixes, 0.125, memo)
        with Allocations() as seen:
            out = kernels.chain_prefix_attention(q, k, v, allowed, prefixes, 0.125, memo)
    assert not [n for n in seen.new if T in n[0] or P in n[0]], seen.new
    assert seen.bytes() <= 16 * out.numel() * out.element_size(), seen.new


def test_cascade_repeats_no_heads_at_rep_1_on_meta():
    """The training cascade with one K/V head per query head hands the fused kernel views of
    its own K/V, not copies."""
    S, B, heads, hn, P = 5, 3, 4, 64, 6
    q, k, v = (torch.empty(S, B, heads, hn, device=META, requires_grad=True) for _ in range(3))
    pk, pv = (torch.empty(P, 1, heads, hn, device=META, requires_grad=True) for _ in range(2))
    own = []

    class Recording(kernels.CudaEfficientKernel):
        def forward(self, q_, k_, v_, causal, scale):
            if causal:
                own.extend([k_, v_])
            return super().forward(q_, k_, v_, causal, scale)

    out = kernels.cascade_prefix_attention(q, k, v, pk, pv, 0.125, kernel=Recording())
    out.sum().backward()
    assert [t._base is leaf for t, leaf in zip(own, (k, v))] == [True, True]


# ---- 5. no masks for a fresh prefill -----------------------------------------------------------

def _meta_model():
    model, _, _ = build("rope", torch.float32)
    model = model.to(META).eval()
    model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.to(META)
    return model


def test_fresh_prefill_builds_no_masks_on_meta(mcore_single):
    """A prefill of 3 prompts (7 tokens) into an empty static cache of 64 slots builds no
    [B, s, 64] mask (it attends causally over its own K/V); the decode step after it does."""
    model = _meta_model()
    cache = model.new_kv_cache(3, 64, static=True)
    tokens = torch.zeros(3, 7, dtype=torch.long, device=META)
    with Allocations() as seen:
        model.prefill(cache, tokens, torch.tensor([3, 7, 5]))
    masks = [n for n in seen.new if n[1] == torch.bool and n[0][-1:] == (64,)]
    assert masks == [], masks
    with Allocations() as seen:
        model.decode_step(cache, torch.zeros(3, dtype=torch.long, device=META))
    assert (3, 1, 1, 64) in [n[0] for n in seen.new if n[1] == torch.bool]


# ---- 6. the wide-dtype probe copies nothing ----------------------------------------------------

def test_prefix_backward_copies_no_queries_to_the_wide_dtype_on_meta():
    """bf16 queries with fp32 prefix leaves on the CUDA flash kernel (no fp32): the backward
    asks whether the kernel takes fp32 without an fp32 copy of the prefix-layout queries."""
    S, B, heads, hn, P = 5, 3, 4, 64, 7
    q, k, v = (torch.empty(S, B, heads, hn, device=META, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    pk, pv = (torch.empty(P, 1, 2 * 2, hn, device=META, requires_grad=True) for _ in range(2))
    out = kernels.cascade_prefix_attention(q, k, v, pk, pv, 0.125, kernel="flash")
    M = B * S  # the prefix-layout queries per K/V group: [1, heads, M, hn]
    with Allocations() as seen:
        out.backward(torch.empty_like(out))
    assert pk.grad.dtype == torch.float32
    assert ((1, heads, M, hn), torch.float32) not in [n[:2] for n in seen.new], seen.new


# ---- 7. fp32 grouped-query attention off CPU ---------------------------------------------------

@pytest.mark.parametrize("dtype, gqa", [(torch.float32, False), (torch.bfloat16, True),
                                        (torch.float16, True)])
def test_causal_gqa_sdpa_route_off_cpu(monkeypatch, dtype, gqa):
    """Unmasked causal grouped-query SDPA on ``meta`` (as on CUDA): fp16/bf16 keep
    ``enable_gqa`` (flash takes it, K/V unrepeated); fp32 repeats the K/V heads so that the
    memory-efficient kernel can run it instead of the math kernel."""
    sdpa = _SdpaShapes(monkeypatch)
    q = torch.empty(6, 2, 8, 64, dtype=dtype, device=META)
    k, v = (torch.empty(6, 2, 2, 64, dtype=dtype, device=META) for _ in range(2))
    kernels.sdpa(q, k, v, None, 0.125, causal=True)
    assert sdpa.calls == [(dtype, 8, 2 if gqa else 8, False, True, gqa)]


def test_causal_gqa_sdpa_on_cpu_keeps_enable_gqa(monkeypatch):
    """On CPU (with a graph recorded too) PyTorch's kernel takes ``enable_gqa`` in fp32."""
    sdpa = _SdpaShapes(monkeypatch)
    q = torch.empty(6, 2, 8, 64)
    k, v = (torch.empty(6, 2, 2, 64) for _ in range(2))
    with torch.enable_grad():
        kernels.sdpa(q, k, v, None, 0.125, causal=True)
    assert sdpa.calls == [(torch.float32, 8, 2, False, True, True)]
