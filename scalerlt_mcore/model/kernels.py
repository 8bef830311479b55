"""Attention kernels of the looped GPT and their autograd, each path with its saved-bytes model.

A suffix batch attends to a shared prefix either by concatenation (``concat_prefix_attention``)
or, I/O-aware, as a cascade (``cascade_prefix_attention``): one batched product of all queries
against the single prefix K/V, merged with each sequence's own causal attention through the
log-sum-exp of the two parts; prompt-once decoding (``prompt_once_attention``) merges the same
way. The cascade runs on a fused kernel that returns the log-sum-exp (``LseKernel``: PyTorch's
CPU flash op, or its CUDA flash / memory-efficient ops), chosen by the config field
``looped_cascade_kernel``; the matmul path materialises the scores and is the reference.

What each path saves for backward (``causal_saved_bytes``, ``cascade_saved_bytes``,
``concat_saved_bytes``) is the planner's memory model of attention, kept here beside the code
it describes. The MCore modules that call these are in ``attention.py``.

Shapes follow MCore: q [sq, b, np, hn], k/v [sk, b, ng, hn].
"""

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)


def _bhsd(x: Tensor) -> Tensor:
    return x.permute(1, 2, 0, 3)  # [s, b, n, d] -> [b, n, s, d]


def batch_major(x: Tensor) -> Tensor:
    """``x`` [b, h, M, d] stored as [b, M, h, d] (the layout the CUDA ops write their outputs
    in); a copy only where it is stored otherwise."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def attend_with_lse(q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor], scale: float):
    """Softmax attention that also returns the log-sum-exp of every query's scores.

    q [..., M, d], k/v [..., N, d], allowed broadcastable to [..., M, N]: True = attend, or an
    additive mask (``additive_mask``). The scores are computed in fp32 or wider (half inputs
    widened for the product: scores rounded to bf16 would put ~1e-2 into the output).
    Returns out [..., M, d] and lse [..., M] (fp32 for half inputs, else the input dtype).
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # [..., M, N]
    if allowed is not None and allowed.dtype == torch.bool:
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif allowed is not None:
        scores = scores + allowed
    lse = torch.logsumexp(scores, dim=-1)  # [..., M]
    probs = torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)
    return torch.matmul(probs, v), lse


def merge_with_lse(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple:
    """Exact softmax over the union of two key sets from the two partial results: (out, lse).
    The weighted sum is accumulated in fp32 or wider and rounded to the output dtype once."""
    lse = torch.logaddexp(lse_a, lse_b)
    acc = torch.promote_types(out_a.dtype, torch.float32)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1).to(acc)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1).to(acc)
    return (out_a.to(acc) * w_a + out_b.to(acc) * w_b).to(out_a.dtype), lse


def merge_by_lse(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """The merged output of ``merge_with_lse``."""
    return merge_with_lse(out_a, lse_a, out_b, lse_b)[0]


# ---- fused kernels that return the log-sum-exp ---------------------------------------------

aten = torch.ops.aten

OP_SIGNATURES = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        "query key value dropout_p is_causal", "attn_mask scale", 2),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "grad_out query key value out logsumexp dropout_p is_causal", "attn_mask scale", 3),
    "_scaled_dot_product_flash_attention": (
        "query key value dropout_p is_causal return_debug_mask", "scale", 9),
    "_scaled_dot_product_flash_attention_backward": (
        "grad_out query key value out logsumexp cum_seq_q cum_seq_k max_q max_k dropout_p "
        "is_causal philox_seed philox_offset", "scale", 3),
    "_scaled_dot_product_efficient_attention": (
        "query key value attn_bias compute_log_sumexp dropout_p is_causal", "scale", 4),
    "_scaled_dot_product_efficient_attention_backward": (
        "grad_out_ query key value attn_bias out logsumexp philox_seed philox_offset dropout_p "
        "grad_input_mask is_causal", "scale", 4),
}
"""The ``.default`` overload of each fused attention op the kernels call positionally:
(positional argument names, keyword-only names, number of outputs), the same in torch 2.11
(the GPU check machine) through 2.14 (2.13 here); checked once at import."""


def check_op_schemas(signatures: dict = OP_SIGNATURES) -> None:
    """Raise naming the op whose ``.default`` schema differs from ``signatures``."""
    for name, (positional, keywords, n_out) in signatures.items():
        schema = getattr(aten, name).default._schema
        found = (" ".join(a.name for a in schema.arguments if not a.kwarg_only),
                 " ".join(a.name for a in schema.arguments if a.kwarg_only), len(schema.returns))
        if found != (positional, keywords, n_out):
            raise RuntimeError(
                f"aten.{name}.default has an unsupported schema in torch {torch.__version__} "
                f"(expected arguments ({positional}; *, {keywords}) -> {n_out} outputs): {schema}")


check_op_schemas()


class LseKernel:
    """A fused attention op that returns every query's log-sum-exp, and its backward op.

    ``forward(q, k, v, causal, scale)`` with q [b, h, M, d], k/v [b, h, N, d] returns
    (out [b, h, M, d], lse [b, h, M] (fp32 for half inputs), state for the backward);
    ``backward(dout, q, k, v, out, lse, causal, scale, state)`` returns (dq, dk, dv), the
    gradient of softmax attention whose output and log-sum-exp are ``out`` and ``lse``. The
    ops are constructor arguments (defaults: PyTorch's), so a test can substitute others with
    the same calling convention.
    """

    name = ""
    device_types: tuple = ()

    def __init__(self, forward_op, backward_op):
        self.forward_op, self.backward_op = forward_op, backward_op

    def unsupported(self, q: Tensor) -> Optional[str]:
        """Why this kernel cannot take query ``q`` (None: it can)."""
        if q.device.type not in self.device_types:
            return f"it runs on {'/'.join(self.device_types)} tensors, not {q.device.type}"
        return self._unsupported_dtype(q)

    def _unsupported_dtype(self, q: Tensor) -> Optional[str]:
        return None if q.dtype.is_floating_point else f"it needs floating point, not {q.dtype}"


class CpuFlashKernel(LseKernel):
    """PyTorch's CPU flash attention (every float dtype)."""

    name, device_types = "cpu_flash", ("cpu", "meta")

    def __init__(self, forward_op=aten._scaled_dot_product_flash_attention_for_cpu.default,
                 backward_op=aten._scaled_dot_product_flash_attention_for_cpu_backward.default):
        super().__init__(forward_op, backward_op)

    def forward(self, q, k, v, causal: bool, scale: float):
        out, lse = self.forward_op(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, state):
        return self.backward_op(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _cuda_limits(q: Tensor, dtypes: tuple, min_capability: tuple) -> Optional[str]:
    """Why PyTorch's CUDA SDPA ops cannot take ``q`` (dtype, head dim, GPU generation)."""
    if q.dtype not in dtypes:
        return f"it supports {', '.join(str(d) for d in dtypes)}, not {q.dtype}"
    hn = q.shape[-1]
    if hn % 8 or hn > 256:
        return f"head dim {hn} is not a multiple of 8 up to 256"
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < min_capability:
        return f"it needs compute capability >= {min_capability}"
    return None


class CudaFlashKernel(LseKernel):
    """PyTorch's CUDA flash attention (fp16/bf16, head dim <= 256, Ampere or newer)."""

    name, device_types = "flash", ("cuda", "meta")

    def __init__(self, forward_op=aten._scaled_dot_product_flash_attention.default,
                 backward_op=aten._scaled_dot_product_flash_attention_backward.default):
        super().__init__(forward_op, backward_op)

    def _unsupported_dtype(self, q):
        return _cuda_limits(q, (torch.float16, torch.bfloat16), (8, 0))

    def forward(self, q, k, v, causal: bool, scale: float):
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = self.forward_op(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, state):
        cum_q, cum_k, seed, offset = state
        lse = lse.contiguous()  # flash-attn 2 reads it at (b*H + h)*M + row, ignoring strides
        return self.backward_op(dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2],
                                0.0, causal, seed, offset, scale=scale)


class CudaEfficientKernel(LseKernel):
    """PyTorch's CUDA memory-efficient attention (fp32/fp16/bf16). Its log-sum-exp comes
    padded to a multiple of ``LSE_ALIGN`` queries; the backward takes it in that layout."""

    name, device_types = "efficient", ("cuda", "meta")
    LSE_ALIGN = 32

    def __init__(self, forward_op=aten._scaled_dot_product_efficient_attention.default,
                 backward_op=aten._scaled_dot_product_efficient_attention_backward.default):
        super().__init__(forward_op, backward_op)

    def _unsupported_dtype(self, q):
        return _cuda_limits(q, (torch.float32, torch.float16, torch.bfloat16), (5, 0))

    def forward(self, q, k, v, causal: bool, scale: float):
        out, lse, seed, offset = self.forward_op(q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[2]], (seed, offset)  # lse [b, h, M] of [b, h, M_pad]

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float, state):
        seed, offset = state
        M = q.shape[2]
        padded = -(-M // self.LSE_ALIGN) * self.LSE_ALIGN
        lse_pad = lse.new_full((*lse.shape[:-1], padded), float("inf"))  # [b, h, M_pad]
        lse_pad[..., :M] = lse
        out = batch_major(out)  # the kernel reads out's rows with stride H*D
        dq, dk, dv, _ = self.backward_op(dout, q, k, v, None, out, lse_pad, seed, offset, 0.0,
                                         [True, True, True, False], causal, scale=scale)
        return dq, dk, dv


LSE_KERNELS = {k.name: k for k in (CpuFlashKernel(), CudaFlashKernel(), CudaEfficientKernel())}
AUTO_ORDER = {"cpu": ("cpu_flash",), "cuda": ("flash", "efficient")}
_logged: set = set()


def resolve_cascade_kernel(choice, q: Tensor):
    """The kernel of ``looped_cascade_kernel`` = ``choice`` for query ``q``: an ``LseKernel``,
    or ``"matmul"``. ``auto`` takes the first fused kernel of q's device type that supports
    q's dtype and head dim (``AUTO_ORDER``; a skipped one is logged once with the reason),
    else ``matmul`` (e.g. fp64 on CUDA). An explicit kernel that cannot take q is an error."""
    if choice == "matmul":
        return choice
    if choice == "auto":
        return _auto_kernel(q)
    kernel = LSE_KERNELS.get(choice, choice)
    if not isinstance(kernel, LseKernel):
        raise ValueError(f"looped_cascade_kernel must be one of auto, matmul, "
                         f"{', '.join(LSE_KERNELS)}; got {choice!r}")
    why = kernel.unsupported(q)
    if why is not None:
        raise ValueError(f"looped_cascade_kernel={kernel.name!r} cannot run this attention: "
                         f"{why} (q {tuple(q.shape)} {q.dtype} on {q.device})")
    return kernel


def _auto_kernel(q: Tensor):
    for name in AUTO_ORDER.get(q.device.type, ()):
        why = LSE_KERNELS[name].unsupported(q)
        if why is None:
            return LSE_KERNELS[name]
        _log_once(f"cascade prefix attention: {name} kernel skipped for {q.dtype}, head dim "
                  f"{q.shape[-1]} on {q.device.type}: {why}")
    return "matmul"


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning(message)


def cascade_prefix_attention(q, k, v, pk, pv, scale: float, kernel="auto") -> Tensor:
    """Suffix queries attend to a prefix (all visible) and causally to their own keys.

    q [S, B, np, hn]; k, v [S, B, ng, hn]; pk, pv [P, Bp, ng, hn] with Bp = 1 (one prompt
    shared by the batch) or Bp = B. Returns [B, np, S, hn]. The prefix is read once: its part
    is one product per query group of all rep * B * S queries against the P prefix keys.
    ``kernel`` (``looped_cascade_kernel``, or an ``LseKernel``): both parts on a fused kernel
    that returns the log-sum-exp (no score matrix is materialised or saved), or ``matmul``,
    the reference, which materialises the scores (see ``resolve_cascade_kernel``).
    ``pk``/``pv`` may be wider than ``q`` (the fp32 adjoint leaves of a bf16 model): a fused
    kernel that supports their dtype runs the prefix part's backward in it, so their grads
    arrive unrounded; otherwise (and on the matmul path) they are computed in ``q``'s dtype.
    """
    S, B, heads, hn = q.shape
    groups, bp = k.shape[2], pk.shape[1]
    layout = _PrefixLayout(bp, B // bp, groups, heads // groups, S)
    qs = _bhsd(q)  # [B, np, S, hn]
    ks, vs = (_repeat_heads(_bhsd(t), layout.rep) for t in (k, v))  # [B, np, S, hn]
    qp, pk, pv = layout.to_prefix(qs), _bhsd(pk), _bhsd(pv)  # [Bp, ng, M, hn], [Bp, ng, P, hn]
    fused = resolve_cascade_kernel(kernel, q)
    if fused != "matmul":
        return _FusedCascade.apply(qp, pk, pv, qs, ks, vs, scale, layout, fused)
    out_p, lse_p = attend_with_lse(qp, pk.to(q.dtype), pv.to(q.dtype), None, scale)
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    out_s, lse_s = attend_with_lse(qs, ks, vs, causal, scale)
    return merge_by_lse(layout.from_prefix(out_p), layout.from_prefix(lse_p), out_s, lse_s)


class _PrefixLayout:
    """Between the per-sequence layout [B, np, S(, hn)] and the prefix-product layout
    [Bp, ng, M(, hn)] with M = (B / Bp) * rep * S: every query of a KV group in one row block."""

    def __init__(self, bp, per, groups, rep, S):
        self.bp, self.per, self.groups, self.rep, self.S = bp, per, groups, rep, S

    def to_prefix(self, x: Tensor) -> Tensor:
        tail = x.shape[3:]
        x = x.reshape(self.bp, self.per, self.groups, self.rep, self.S, *tail)
        return x.transpose(1, 2).reshape(self.bp, self.groups, -1, *tail)  # [Bp, ng, M(, hn)]

    def from_prefix(self, x: Tensor) -> Tensor:
        tail = x.shape[3:]
        x = x.reshape(self.bp, self.groups, self.per, self.rep, self.S, *tail).transpose(1, 2)
        return x.reshape(self.bp * self.per, self.groups * self.rep, self.S, *tail)


class _FusedCascade(torch.autograd.Function):
    """Cascade attention on a fused ``LseKernel`` (CPU flash, CUDA flash or CUDA efficient).

    Backward runs each part's kernel backward against the *merged* output and log-sum-exp:
    that is exactly the gradient of softmax attention over the union of the two key sets, so
    only q, k, v, the prefix K/V, the output and the log-sum-exp are saved (no score matrix).
    """

    @staticmethod
    def forward(ctx, qp, pk, pv, qs, ks, vs, scale, layout, kernel):
        out_p, lse_p, state_p = kernel.forward(qp, pk.to(qp.dtype), pv.to(qp.dtype), False,
                                               scale)  # [Bp, ng, M(, hn)]
        out_s, lse_s, state_s = kernel.forward(qs, ks, vs, True, scale)  # [B, np, S(, hn)]
        out, lse = merge_with_lse(layout.from_prefix(out_p), layout.from_prefix(lse_p),
                                  out_s, lse_s)  # [B, np, S, hn], [B, np, S]
        ctx.save_for_backward(qp, pk, pv, qs, ks, vs, out, lse)
        ctx.scale, ctx.layout, ctx.kernel, ctx.states = scale, layout, kernel, (state_p, state_s)
        return out

    @staticmethod
    def backward(ctx, dout):
        qp, pk, pv, qs, ks, vs, out, lse = ctx.saved_tensors
        kernel, scale, to_p = ctx.kernel, ctx.scale, ctx.layout.to_prefix
        state_p, state_s = ctx.states
        dout = dout.contiguous()
        dqs, dks, dvs = kernel.backward(dout, qs, ks, vs, out, lse, True, scale, state_s)
        dqp, dpk, dpv = _prefix_backward(kernel, to_p(dout), qp, pk, pv, to_p(out), to_p(lse),
                                         scale, state_p)
        return dqp, dpk, dpv, dqs, dks, dvs, None, None, None


def _prefix_backward(kernel, dout, qp, pk, pv, out, lse, scale, state):
    """The prefix part's backward. With prefix K/V wider than the queries (fp32 leaves of a
    bf16 model) it runs in their dtype where the kernel supports it, so dK/dV are not rounded
    to the queries' dtype; the queries' grad comes back in their own dtype."""
    wide = pk.dtype
    probe = qp.new_empty((0, qp.shape[-1]), dtype=wide)  # qp's device and head dim, no copy
    if wide != qp.dtype and kernel.unsupported(probe) is None:
        dqp, dpk, dpv = kernel.backward(dout.to(wide), qp.to(wide), pk, pv, out.to(wide), lse,
                                        False, scale, state)
        return dqp.to(qp.dtype), dpk, dpv
    dqp, dpk, dpv = kernel.backward(dout, qp, pk.to(qp.dtype), pv.to(qp.dtype), out, lse,
                                    False, scale, state)
    return dqp, dpk.to(wide), dpv.to(wide)


def _repeat_heads(x: Tensor, rep: int) -> Tensor:
    """[B, ng, L, hn] -> [B, ng * rep, L, hn], each K/V head repeated for its rep query heads
    (a copy; ``x`` itself at rep = 1)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def concat_prefix_attention(q, k, v, pk, pv, scale: float) -> Tensor:
    """Same result as ``cascade_prefix_attention`` by expanding the prefix per sequence. A
    prefix wider than ``k`` is cast after the expand: the per-sequence grads sum in its dtype."""
    S, B = q.shape[:2]
    P = pk.shape[0]
    keys = torch.cat([pk.expand(P, B, *pk.shape[2:]).to(k.dtype), k], dim=0)  # [P+S, B, ng, hn]
    vals = torch.cat([pv.expand(P, B, *pv.shape[2:]).to(v.dtype), v], dim=0)
    allowed = torch.ones(S, P + S, dtype=torch.bool, device=q.device).tril(diagonal=P)
    return sdpa(q, keys, vals, allowed, scale)


def _cpu_without_graph(q: Tensor) -> bool:
    """Decoding on CPU: ``q`` is a CPU tensor and no graph is recorded. There a masked
    grouped-query SDPA keeps the K/V heads unrepeated (PyTorch's CPU kernel takes a mask with
    ``enable_gqa``, the same output, no copy of the cache per step), and the prompt-once parts
    run on the CPU flash op (``_cpu_flash_lse``). Not with a graph: the pair's backward sums
    the heads' K/V gradients in another order than the repeat's; elsewhere (CUDA, meta) the
    parts run on the memory-efficient op (``_chain_part``)."""
    return q.device.type == "cpu" and not torch.is_grad_enabled()


def sdpa(q, k, v, allowed: Optional[Tensor], scale: float, causal: bool = False) -> Tensor:
    """PyTorch SDPA on MCore layouts; ``allowed`` True = attend, broadcastable to
    [b, 1, sq, sk] (one mask for every head). Returns [b, np, sq, hn].

    Grouped-query attention goes through ``enable_gqa`` where a fused kernel takes it (CUDA:
    flash, fp16/bf16 without a mask; CPU); elsewhere (``_gqa_pair_unfused``) the pair would
    run the math kernel and materialise the scores, so a masked call with one query per row
    (a decode step) folds each group's rep query heads into its query length (no copy: the
    mask is the same for all heads), and any other call repeats the K/V heads."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1 and _gqa_pair_unfused(q, allowed):
        if allowed is not None and q.shape[0] == 1 and not causal:
            b, heads, hn = q.shape[1:]
            qg = _bhsd(q).reshape(b, k.shape[2], rep, hn)  # [b, ng, rep, hn], a view
            out = F.scaled_dot_product_attention(qg, _bhsd(k), _bhsd(v), attn_mask=allowed,
                                                 scale=scale)
            return out.reshape(b, heads, 1, hn)  # [b, ng, rep, hn] -> [b, np, 1, hn]
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))  # [sk, b, np, hn]
    return F.scaled_dot_product_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), attn_mask=allowed, is_causal=causal, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )


HALF = (torch.float16, torch.bfloat16)


def _gqa_pair_unfused(q: Tensor, allowed: Optional[Tensor]) -> bool:
    """Whether SDPA with ``enable_gqa`` would run the math kernel: with a mask (CUDA's
    memory-efficient kernel takes one but not ``enable_gqa``), or off CPU in a dtype flash,
    the one fused CUDA kernel with ``enable_gqa``, has not (fp32). Never on CPU without a
    recorded graph (``_cpu_without_graph``): PyTorch's CPU kernel takes the masked pair."""
    if _cpu_without_graph(q):
        return False
    return allowed is not None or (q.device.type != "cpu" and q.dtype not in HALF)


def prompt_once_attention(q, k, v, allowed, pk, pv, prompt_allowed, scale: float) -> Tensor:
    """Decoding G samples per prompt (Hydragen): each query attends to its own cached keys and
    to its prompt's keys, stored once per prompt; the two softmax parts are merged through
    their log-sum-exps. The prompt part is one product per (prompt, query group) of all
    G * rep * s queries against the prompt's P keys.

    q [s, B, np, hn]; k, v [T, B, ng, hn] the rows' own K/V, ``allowed`` [B, s, T] (True =
    attend); pk, pv [P, N, ng, hn] the prompts' K/V with B = N * G (rows n*G ... n*G+G-1
    continue prompt n), ``prompt_allowed`` [N, P] (False on prompt padding). Every query must
    see at least one key of each part. Returns [B, np, s, hn]. The one-level case of
    ``chain_prefix_attention``.
    """
    return chain_prefix_attention(q, k, v, allowed, [(pk, pv, prompt_allowed)], scale)


def _cpu_flash_lse(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> tuple:
    """``attend_with_lse`` on PyTorch's CPU flash op: one fused call (the same softmax, other
    rounding); ``bias`` the additive mask (``additive_mask``). The lse is fp32 for half
    inputs."""
    return aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale)


def _efficient_lse(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> tuple:
    """``attend_with_lse`` on PyTorch's CUDA memory-efficient op (scores in fp32, none
    materialised); ``bias`` an additive mask with rows aligned to ``BIAS_ALIGN`` keys,
    broadcastable to [b, h, M, N] (the op takes that shape exactly: an expanded view). Its
    log-sum-exp has no gradient: for decoding only."""
    bias = bias.expand(*q.shape[:-1], k.shape[-2])  # [b, h, M, N]
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention.default(
        q, k, v, bias, True, 0.0, False, scale=scale)
    return out, lse[..., : q.shape[2]]  # lse [b, h, M] of [b, h, M_pad]


BIAS_ALIGN = 16
"""Keys per row of an additive mask's storage for the memory-efficient op (it reads the mask
in aligned rows; PyTorch's SDPA pads its masks the same way)."""


def additive_mask(allowed: Tensor, dtype: torch.dtype, align: int = 1) -> Tensor:
    """``allowed`` (True = attend) as an additive mask in ``dtype`` (0 / -inf), its rows
    stored padded to a multiple of ``align`` keys."""
    keys = allowed.shape[-1]
    padded = -(-keys // align) * align
    bias = torch.zeros((*allowed.shape[:-1], padded), dtype=dtype, device=allowed.device)
    bias = bias[..., :keys]
    return bias.masked_fill_(~allowed, float("-inf"))


def _chain_part(q: Tensor, k: Tensor) -> tuple:
    """The op computing each part of ``chain_prefix_attention`` and its masks' row alignment:
    PyTorch's CPU flash op on CPU without a recorded graph, its CUDA memory-efficient op where
    it takes the inputs and no gradient is recorded, else ``attend_with_lse``."""
    if _cpu_without_graph(q):
        return _cpu_flash_lse, 1
    efficient = LSE_KERNELS["efficient"].unsupported(q) is None
    if efficient and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        return _efficient_lse, BIAS_ALIGN
    return attend_with_lse, 1


def _own_bias(allowed: Tensor, rep: int, dtype: torch.dtype, align: int) -> Tensor:
    """The own part's additive mask for queries grouped by KV head, [B, 1, rep * s, T] of
    ``allowed`` [B, s, T]: one row per query and a view of a [B, 1, 1, 1, T] mask at s = 1."""
    B, s, T = allowed.shape
    grouped = allowed[:, None, None].expand(B, 1, rep if s > 1 else 1, s, T)
    bias = additive_mask(grouped, dtype, align)  # [B, 1, rep or 1, s, T]
    return bias.expand(B, 1, rep, s, T).reshape(B, 1, rep * s, T)  # a view


def chain_prefix_attention(q, k, v, allowed, prefixes: list, scale: float,
                           memo: Optional[dict] = None) -> Tensor:
    """Decoding against a path of prefix segments (a prefix tree's root-to-node path), each
    stored once: every query attends to its own cached keys and to each segment's keys; the
    softmax parts are merged through their log-sum-exps (a cascade: one product per (segment
    row, query group) of all the queries that continue that row).

    q [s, B, np, hn]; k, v [T, B, ng, hn] the rows' own K/V, ``allowed`` [B, s, T] (True =
    attend). ``prefixes``: one (pk, pv, seen) per segment level, pk/pv [P_j, N_j, ng, hn] with
    B a multiple of N_j (rows b continue segment row b // (B / N_j)), ``seen`` [N_j, P_j]
    (False on padding). Every query must see at least one key of each part. Returns
    [B, np, s, hn].

    The queries stay grouped by KV head, [B, ng, rep * s, hn] (a row's mask is the same for
    all its heads, so one call per part needs no repeated K/V); each part runs on a fused op
    where one takes it (``_chain_part``); each part's additive mask is made once per ``memo``
    (one per forward: ``CacheStep.memo``); the parts are merged in fp32 or wider as
    out <- lerp(out, out_j, sigmoid(lse_j - lse)), the softmax weight of part j, and rounded
    once.
    """
    memo = {} if memo is None else memo
    part, align = _chain_part(q, k)
    s, B, heads, hn = q.shape
    groups = k.shape[2]
    rep = heads // groups
    qg = _bhsd(q).reshape(B, groups, rep * s, hn)  # [B, ng, rep * s, hn]
    if ("own", q.dtype, align) not in memo:
        memo["own", q.dtype, align] = _own_bias(allowed, rep, q.dtype, align)
    out, lse = part(qg, _bhsd(k), _bhsd(v), memo["own", q.dtype, align], scale)
    acc = torch.promote_types(out.dtype, torch.float32)
    out = out.to(acc)
    for j in range(len(prefixes) - 1, -1, -1):  # the nearest segment first
        pk, pv, seen = prefixes[j]
        n = pk.shape[1]
        qp = qg.reshape(n, B // n, groups, rep * s, hn).transpose(1, 2).reshape(
            n, groups, -1, hn)  # [N_j, ng, (B / N_j) * rep * s, hn]
        if (j, q.dtype, align) not in memo:
            memo[j, q.dtype, align] = additive_mask(seen[:, None, None, :], q.dtype, align)
        out_p, lse_p = part(qp, _bhsd(pk), _bhsd(pv), memo[j, q.dtype, align], scale)
        lse_p = _grouped_per_row(lse_p, B)
        out = torch.lerp(out, _grouped_per_row(out_p, B).to(acc),
                         torch.sigmoid(lse_p - lse)[..., None])
        if j:
            lse = torch.logaddexp(lse, lse_p)
    return out.to(q.dtype).reshape(B, heads, s, hn)


def _grouped_per_row(x: Tensor, B: int) -> Tensor:
    """[N, ng, (B / N) * L(, hn)] (a segment row's queries of one KV group) -> [B, ng, L(, hn)]
    (each row's own)."""
    n, groups = x.shape[:2]
    x = x.reshape(n, groups, B // n, -1, *x.shape[3:]).transpose(1, 2)
    return x.reshape(B, groups, *x.shape[3:])


# ---- saved bytes: what each attention path keeps for backward (the planner's memory model) ----
#
# ``shape`` is the planner's description of the model (``shared_prefix.planner.ModelShape``):
# heads, kv_groups, kv_channels, qkv_width, rope_dim, dtype_bytes (activations), acc_bytes
# (fp32-or-wider accumulators). Each function counts what autograd saves for one attention of
# ``rows`` x ``s`` queries, from the qkv projection's output to the output projection's input
# (RoPE included); prefix K/V storage is the planner's (``prefix_bytes``). A test holds the sum
# over the model to within 10% of the bytes autograd really saves
# (tests/shared_prefix/test_planner.py).


def _query_bytes(shape, n: int) -> tuple:
    """(bytes of n tokens' queries, whether q is a view of the qkv output: not rotated and not
    regrouped by grouped-query attention)."""
    q = n * shape.heads * shape.kv_channels * shape.dtype_bytes
    return q, not shape.rope_dim and shape.kv_groups in (1, shape.heads)


def _rope_and_output_bytes(shape, n: int, q: int) -> int:
    """RoPE's cos and sin of both applications; the output and its log-sum-exp."""
    return 4 * n * shape.rope_dim * shape.dtype_bytes + q + n * shape.heads * shape.acc_bytes


def causal_saved_bytes(shape, rows: int, s: int) -> int:
    """Plain causal attention (``sdpa``, a fused kernel): q, k, v, v (and k without RoPE)
    views of the qkv output, the output and the log-sum-exp."""
    n, b = rows * s, shape.dtype_bytes
    q, q_view = _query_bytes(shape, n)
    own = (n * shape.qkv_width * b + q * (not q_view)
           + n * shape.kv_groups * shape.kv_channels * b * bool(shape.rope_dim))
    return own + _rope_and_output_bytes(shape, n, q)


def _prefix_kernel_inputs(shape, n: int, q: int, q_view: bool) -> int:
    """The prefix paths copy k and v; q is saved (a view of the qkv output where it is one)."""
    return n * shape.qkv_width * shape.dtype_bytes if q_view else q


def cascade_saved_bytes(shape, rows: int, s: int, prefix: int) -> int:
    """``cascade_prefix_attention`` on a fused kernel (``_FusedCascade``): q, k and v repeated
    per head, the prefix-layout queries, the merged output and log-sum-exp, and the output
    projection's input (a copy of the merged output when rows > 1). No score matrix."""
    n = rows * s
    q, q_view = _query_bytes(shape, n)
    view = rows == 1 and shape.heads == shape.kv_groups
    repeated = 2 * q + q * (not view) + q * (rows > 1)
    return (_prefix_kernel_inputs(shape, n, q, q_view) + _rope_and_output_bytes(shape, n, q)
            + repeated)


def concat_saved_bytes(shape, rows: int, s: int, prefix: int) -> int:
    """``concat_prefix_attention``: the concatenated K and V (heads repeated under GQA: masked
    SDPA) and the additive mask, besides q, the output and the log-sum-exp."""
    n, b = rows * s, shape.dtype_bytes
    q, q_view = _query_bytes(shape, n)
    keys = rows * (prefix + s) * shape.heads
    concat = 2 * keys * shape.kv_channels * b + s * (prefix + s) * b
    return (_prefix_kernel_inputs(shape, n, q, q_view) + _rope_and_output_bytes(shape, n, q)
            + concat)
