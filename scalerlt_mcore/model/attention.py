"""Attention for the looped GPT: MCore ``SelfAttention`` that routes K/V by virtual depth, and a
core attention that attends to a shared prefix either by concatenation or, I/O-aware, as a
cascade: one batched product of all queries against the single prefix K/V, merged with each
sequence's own causal attention through the log-sum-exp of the two parts.

Shapes follow MCore: q [sq, b, np, hn], k/v [sk, b, ng, hn], outputs [sq, b, np * hn].
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from .kv import LoopKV


def _bhsd(x: Tensor) -> Tensor:
    return x.permute(1, 2, 0, 3)  # [s, b, n, d] -> [b, n, s, d]


def attend_with_lse(q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor], scale: float):
    """Softmax attention that also returns the log-sum-exp of every query's scores.

    q [..., M, d], k/v [..., N, d], allowed broadcastable to [..., M, N] (True = attend).
    Returns out [..., M, d] and lse [..., M] (fp32 for half inputs, else the input dtype).
    """
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale  # [..., M, N]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [..., M]
    probs = torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)
    return torch.matmul(probs, v), lse


def merge_by_lse(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Exact softmax over the union of two key sets from the two partial results."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1).to(out_a.dtype)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1).to(out_b.dtype)
    return out_a * w_a + out_b * w_b


def cascade_prefix_attention(q, k, v, pk, pv, scale: float, flash: Optional[bool] = None
                             ) -> Tensor:
    """Suffix queries attend to a prefix (all visible) and causally to their own keys.

    q [S, B, np, hn]; k, v [S, B, ng, hn]; pk, pv [P, Bp, ng, hn] with Bp = 1 (one prompt
    shared by the batch) or Bp = B. Returns [B, np, S, hn]. The prefix is read once: its part
    is one product per query group of all rep * B * S queries against the P prefix keys.
    ``flash`` (default: on CPU): both parts on PyTorch's CPU flash kernel (no score matrix is
    materialised or saved); otherwise on matmuls that return the log-sum-exp.
    """
    S, B, heads, hn = q.shape
    groups, bp = k.shape[2], pk.shape[1]
    layout = _PrefixLayout(bp, B // bp, groups, heads // groups, S)
    qs = _bhsd(q)  # [B, np, S, hn]
    ks, vs = (_bhsd(t).repeat_interleave(layout.rep, dim=1) for t in (k, v))  # [B, np, S, hn]
    qp, pk, pv = layout.to_prefix(qs), _bhsd(pk), _bhsd(pv)  # [Bp, ng, M, hn], [Bp, ng, P, hn]
    if flash if flash is not None else q.device.type == "cpu":
        return _CpuCascade.apply(qp, pk, pv, qs, ks, vs, scale, layout)
    out_p, lse_p = attend_with_lse(qp, pk, pv, None, scale)
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


class _CpuCascade(torch.autograd.Function):
    """Cascade attention on PyTorch's CPU flash kernel, which returns the log-sum-exp.

    Backward runs each part's flash backward against the *merged* output and log-sum-exp:
    that is exactly the gradient of softmax attention over the union of the two key sets, so
    only q, k, v, the prefix K/V, the output and the log-sum-exp are saved.
    """

    @staticmethod
    def forward(ctx, qp, pk, pv, qs, ks, vs, scale, layout):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out_p, lse_p = flash(qp, pk, pv, 0.0, False, scale=scale)  # [Bp, ng, M(, hn)]
        out_s, lse_s = flash(qs, ks, vs, 0.0, True, scale=scale)  # [B, np, S(, hn)]
        lse_p = layout.from_prefix(lse_p)
        lse = torch.logaddexp(lse_p, lse_s)  # fp32 for half inputs
        out = merge_by_lse(layout.from_prefix(out_p), lse_p, out_s, lse_s)
        ctx.save_for_backward(qp, pk, pv, qs, ks, vs, out, lse)
        ctx.scale, ctx.layout = scale, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        qp, pk, pv, qs, ks, vs, out, lse = ctx.saved_tensors
        flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        to_p, dout = ctx.layout.to_prefix, dout.contiguous()
        dqs, dks, dvs = flash_bwd(dout, qs, ks, vs, out, lse, 0.0, True, scale=ctx.scale)
        dqp, dpk, dpv = flash_bwd(to_p(dout), qp, pk, pv, to_p(out), to_p(lse), 0.0, False,
                                  scale=ctx.scale)
        return dqp, dpk, dpv, dqs, dks, dvs, None, None


def concat_prefix_attention(q, k, v, pk, pv, scale: float) -> Tensor:
    """Same result as ``cascade_prefix_attention`` by expanding the prefix per sequence."""
    S, B = q.shape[:2]
    P = pk.shape[0]
    keys = torch.cat([pk.expand(P, B, *pk.shape[2:]), k], dim=0)  # [P+S, B, ng, hn]
    vals = torch.cat([pv.expand(P, B, *pv.shape[2:]), v], dim=0)
    allowed = torch.ones(S, P + S, dtype=torch.bool, device=q.device).tril(diagonal=P)
    return sdpa(q, keys, vals, allowed, scale)


def sdpa(q, k, v, allowed: Optional[Tensor], scale: float, causal: bool = False) -> Tensor:
    """PyTorch SDPA on MCore layouts; ``allowed`` True = attend. Returns [b, np, sq, hn]."""
    return F.scaled_dot_product_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), attn_mask=allowed, is_causal=causal, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )


class LoopedCoreAttention(MegatronModule):
    """Core attention with prefix, cache and plain-causal modes (PyTorch SDPA / matmul).

    Built by MCore's ``Attention`` with the same arguments as ``DotProductAttention``.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        self.layer_number = layer_number
        hn = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(hn)
        if (attention_dropout or config.attention_dropout) > 0:
            raise ValueError("looped core attention does not support attention_dropout > 0")

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, *, prefix_kv=None,
                prefix_attention="cascade"):
        """attention_mask: MCore convention (True = masked), broadcastable to [b, 1, sq, sk]."""
        sq, b = query.shape[:2]
        if prefix_kv is not None:
            fn = cascade_prefix_attention if prefix_attention == "cascade" else (
                concat_prefix_attention)
            out = fn(query, key, value, *prefix_kv, self.scale)
        elif attention_mask is not None:
            out = sdpa(query, key, value, ~attention_mask, self.scale)
        else:
            out = sdpa(query, key, value, None, self.scale, causal=True)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [b, np, sq, hn] -> [sq, b, np*hn]


class LoopedSelfAttention(SelfAttention):
    """MCore ``SelfAttention`` (same parameters) whose K/V is routed by virtual depth.

    ``inference_context`` is a ``LoopKV`` (or None for a plain causal forward);
    ``rotary_pos_emb`` is already gathered per position: [sq, b or 1, 1, rot_dim].
    """

    def forward(self, hidden_states, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, **unused):
        query, key, value = self.get_query_key_value_tensors(hidden_states)  # [s, b, n, hn]
        if rotary_pos_emb is not None:
            query = apply_rotary_pos_emb(query, rotary_pos_emb, config=self.config)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, config=self.config)
        ctx: Optional[LoopKV] = inference_context
        if ctx is None:
            out = self.core_attention(query, key, value, attention_mask)
        else:
            out = self._attend_routed(ctx, query, key, value, attention_mask)
        return self.linear_proj(out)

    def _attend_routed(self, ctx: LoopKV, query, key, value, attention_mask):
        d = ctx.depth
        if ctx.record:
            ctx.recorded[d] = (key, value)
        if ctx.cache is not None:
            return self._attend_cache(ctx, query, key, value)
        if ctx.prefix is not None:
            prefix_kv = (ctx.prefix.keys[d], ctx.prefix.values[d])
            return self.core_attention(query, key, value, None, prefix_kv=prefix_kv,
                                       prefix_attention=ctx.prefix_attention)
        return self.core_attention(query, key, value, attention_mask)

    def _attend_cache(self, ctx: LoopKV, query, key, value):
        if ctx.cache.prefix is not None:
            return self._attend_prompt_once(ctx, query, key, value)
        cache, pos = ctx.cache, ctx.positions  # pos [B, s]
        batch = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)
        cache.keys[ctx.depth][pos, batch] = key.transpose(0, 1).to(cache.keys.dtype)
        cache.values[ctx.depth][pos, batch] = value.transpose(0, 1).to(cache.values.dtype)
        span = int(pos.max()) + 1
        keys = cache.keys[ctx.depth][:span].to(query.dtype)  # [T, B, ng, hn]
        vals = cache.values[ctx.depth][:span].to(query.dtype)
        key_pos = torch.arange(span, device=pos.device)
        masked = key_pos[None, None, :] > pos[:, :, None]  # [B, s, T]
        return self.core_attention(query, keys, vals, masked[:, None])

    def _attend_prompt_once(self, ctx: LoopKV, query, key, value):
        """Prompt-once decoding: write the new K/V into the continuation cache, attend to it
        and, read once per prompt, to the prompt's K/V in ``cache.prefix``."""
        cache, d = ctx.cache, ctx.depth
        slots = ctx.positions - cache.offsets()[:, None]  # [B, s] positions after the prompt
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)
        cache.keys[d][slots, rows] = key.transpose(0, 1).to(cache.keys.dtype)
        cache.values[d][slots, rows] = value.transpose(0, 1).to(cache.values.dtype)
        span = int(slots.max()) + 1
        own = torch.arange(span, device=slots.device)[None, None, :] <= slots[:, :, None]
        prefix = cache.prefix
        P = int(prefix.lengths.max())
        prompt = torch.arange(P, device=slots.device)[None, :] < prefix.lengths[:, None]  # [N, P]
        out = prompt_once_attention(
            query, cache.keys[d][:span].to(query.dtype), cache.values[d][:span].to(query.dtype),
            own, prefix.keys[d][:P].to(query.dtype), prefix.values[d][:P].to(query.dtype),
            prompt, self.core_attention.scale)  # [B, np, s, hn]
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [b, np, sq, hn] -> [sq, b, np*hn]


def prompt_once_attention(q, k, v, allowed, pk, pv, prompt_allowed, scale: float) -> Tensor:
    """Decoding G samples per prompt (Hydragen): each query attends to its own cached keys and
    to its prompt's keys, stored once per prompt; the two softmax parts are merged through
    their log-sum-exps. The prompt part is one product per (prompt, query group) of all
    G * rep * s queries against the prompt's P keys.

    q [s, B, np, hn]; k, v [T, B, ng, hn] the rows' own K/V, ``allowed`` [B, s, T] (True =
    attend); pk, pv [P, N, ng, hn] the prompts' K/V with B = N * G (rows n*G ... n*G+G-1
    continue prompt n), ``prompt_allowed`` [N, P] (False on prompt padding). Every query must
    see at least one key of each part. Returns [B, np, s, hn].
    """
    s, B, heads, hn = q.shape
    prompts, groups = pk.shape[1], pk.shape[2]
    layout = _PrefixLayout(prompts, B // prompts, groups, heads // groups, s)
    qs = _bhsd(q)  # [B, np, s, hn]
    ks, vs = (_bhsd(t).repeat_interleave(layout.rep, dim=1) for t in (k, v))  # [B, np, T, hn]
    out_s, lse_s = attend_with_lse(qs, ks, vs, allowed[:, None], scale)
    seen = prompt_allowed[:, None, None, :]  # [N, 1, 1, P]
    out_p, lse_p = attend_with_lse(layout.to_prefix(qs), _bhsd(pk), _bhsd(pv), seen, scale)
    return merge_by_lse(layout.from_prefix(out_p), layout.from_prefix(lse_p), out_s, lse_s)
