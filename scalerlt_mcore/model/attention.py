"""Attention for the looped GPT: MCore ``SelfAttention`` that routes K/V by virtual depth (and
writes the decoding caches), and a core attention with MCore's call that attends to a shared
prefix set for the call. The kernels and their saved-bytes models are in ``kernels.py``.

Shapes follow MCore: q [sq, b, np, hn], k/v [sk, b, ng, hn], outputs [sq, b, np * hn].
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from .kernels import (
    cascade_prefix_attention,
    cascade_saved_bytes,
    causal_saved_bytes,
    chain_prefix_attention,
    concat_prefix_attention,
    concat_saved_bytes,
    resolve_cascade_kernel,  # noqa: F401  (the kernel choice, re-exported for benchmarks/gpu.py)
    sdpa,
)
from .kv import LoopKV, own
from .recompute import checkpointed, recompute_active


@dataclass(frozen=True)
class RotaryAngles:
    """RoPE of one forward's positions with its cos and sin computed once for all the layer
    applications of the forward (MCore's ``apply_rotary_pos_emb`` computes them on every
    call, 2 x L x R times per forward): what a forward that records no graph (decoding,
    scoring) passes as ``rotary_pos_emb``. freqs, cos, sin [s, b or 1, 1, rot_dim]."""

    freqs: Tensor
    cos: Tensor
    sin: Tensor

    @classmethod
    def of(cls, freqs: Tensor) -> "RotaryAngles":
        return cls(freqs, torch.cos(freqs), torch.sin(freqs))

    def rotate(self, t: Tensor) -> Tensor:
        """MCore's unfused RoPE (non-interleaved) of t [s, b, n, hn]: the same operations on
        the same values (its cos/sin scale of 1.0 is exact), so the same tensor."""
        dim = self.freqs.shape[-1]
        x = t if dim == t.shape[-1] else t[..., :dim]
        x1, x2 = torch.chunk(x, 2, dim=-1)
        out = x * self.cos.to(t.dtype) + torch.cat((-x2, x1), dim=-1) * self.sin.to(t.dtype)
        return out if dim == t.shape[-1] else torch.cat((out, t[..., dim:]), dim=-1)


@dataclass
class PrefixKV:
    """The prefix a core attention's next call attends to (all visible) before its own keys:
    keys/values [P, Bp, ng, hn] (one virtual depth's), and how: ``attention`` is the config's
    ``looped_prefix_attention`` (``cascade`` or ``concat``)."""

    keys: Tensor
    values: Tensor
    attention: str = "cascade"


class LoopedCoreAttention(MegatronModule):
    """Core attention with prefix, cache and plain-causal modes (PyTorch SDPA; the cascade
    prefix attention on the kernel ``config.looped_cascade_kernel`` selects).

    Built by MCore's ``Attention`` with the same arguments as ``DotProductAttention`` and
    called as MCore calls a core attention. The prefix reaches it as state set by
    ``LoopedSelfAttention`` for one call (``attending_to``), so another core attention (e.g.
    Transformer Engine's) can be swapped in by spec for the plain causal and masked modes; one
    that attends to a prefix declares ``supports_prefix`` (docs/architecture.md). Its saved
    bytes per mode: ``saved_bytes`` (the planner's memory model).
    """

    supports_prefix = True
    """It attends to a ``PrefixKV`` set by ``attending_to`` (and serves prompt-once decoding,
    which reads ``scale``)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        self.layer_number = layer_number
        hn = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(hn)
        if (attention_dropout or config.attention_dropout) > 0:
            raise ValueError("looped core attention does not support attention_dropout > 0")
        self.prefix: Optional[PrefixKV] = None

    @contextlib.contextmanager
    def attending_to(self, prefix: PrefixKV):
        """Within the block, calls attend to ``prefix`` before their own keys."""
        self.prefix = prefix
        try:
            yield
        finally:
            self.prefix = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """MCore's core-attention call. attention_mask: MCore convention (True = masked),
        broadcastable to [b, 1, sq, sk]; None: causal (or, with a prefix, causal over the own
        keys after the whole prefix)."""
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("looped core attention takes no attention_bias or "
                                      "packed_seq_params")
        sq, b = query.shape[:2]
        prefix = self.prefix
        if prefix is not None and prefix.attention == "cascade":
            out = cascade_prefix_attention(query, key, value, prefix.keys, prefix.values,
                                           self.scale, self.config.looped_cascade_kernel)
        elif prefix is not None:
            out = concat_prefix_attention(query, key, value, prefix.keys, prefix.values,
                                          self.scale)
        elif attention_mask is not None:
            out = sdpa(query, key, value, ~attention_mask, self.scale)
        else:
            out = sdpa(query, key, value, None, self.scale, causal=True)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [b, np, sq, hn] -> [sq, b, np*hn]

    @staticmethod
    def saved_bytes(shape, rows: int, s: int, mode: str, prefix: int = 0) -> int:
        """Bytes autograd saves for one call on ``rows`` x ``s`` queries in ``mode``:
        ``causal``, or a prefix attention (``cascade``, ``concat``) against ``prefix`` keys;
        ``shape``: the planner's ``ModelShape``."""
        if mode == "causal":
            return causal_saved_bytes(shape, rows, s)
        if mode == "cascade":
            return cascade_saved_bytes(shape, rows, s, prefix)
        if mode == "concat":
            return concat_saved_bytes(shape, rows, s, prefix)
        raise ValueError(f"no saved-bytes model for attention mode {mode!r}")


class LoopedSelfAttention(SelfAttention):
    """MCore ``SelfAttention`` (same parameters) whose K/V is routed by virtual depth.

    ``inference_context`` is a ``LoopKV`` (or None for a plain causal forward);
    ``rotary_pos_emb`` is already gathered per position: [sq, b or 1, 1, rot_dim] (MCore's
    frequencies), or a ``RotaryAngles`` of them.
    The core attention is called as MCore calls it; the prefix modes need one that
    ``supports_prefix``.
    """

    def forward(self, hidden_states, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, **unused):
        query, key, value = self.get_query_key_value_tensors(hidden_states)  # [s, b, n, hn]
        if rotary_pos_emb is not None:
            query, key = self._rotate(query, rotary_pos_emb), self._rotate(key, rotary_pos_emb)
        ctx: Optional[LoopKV] = inference_context
        if ctx is None:
            out = self._core(query, key, value, attention_mask)
        else:
            out = self._attend_routed(ctx, hidden_states, query, key, value, attention_mask)
        return self.linear_proj(out)

    def prefix_kv(self, ctx: LoopKV, dtype: torch.dtype) -> tuple:
        """The K/V [P, Bp, ng, hn] of ``ctx.prefix`` at ``ctx.depth``: stored, or derived from
        the stored attention input (a state of kind ``inputs``) as the prompt derived them:
        this layer's projection (in ``dtype``, the forward's), its RoPE at the prefix's
        positions."""
        prefix, d = ctx.prefix, ctx.depth
        if prefix.inputs is None:
            return prefix.keys[d], prefix.values[d]
        _, key, value = self.get_query_key_value_tensors(prefix.inputs[d].to(dtype))
        if ctx.prefix_rope is not None:
            key = self._rotate(key, ctx.prefix_rope)
        return key, value

    def _rotate(self, t: Tensor, rope) -> Tensor:
        """RoPE of t [s, b, n, hn]: ``rope`` a ``RotaryAngles`` (its cos/sin, where the config
        asks for MCore's unfused non-interleaved RoPE) or MCore's frequencies."""
        c = self.config
        if not isinstance(rope, RotaryAngles):
            return apply_rotary_pos_emb(t, rope, config=c)
        if c.apply_rope_fusion or c.rotary_interleaved or c.multi_latent_attention:
            return apply_rotary_pos_emb(t, rope.freqs, config=c)
        return rope.rotate(t)

    def _core(self, query, key, value, attention_mask):
        """The core attention, as MCore calls it: causal without a mask, else arbitrary."""
        mask_type = AttnMaskType.causal if attention_mask is None else AttnMaskType.arbitrary

        def attend(query, key, value, attention_mask):
            return self.core_attention(query, key, value, attention_mask,
                                       attn_mask_type=mask_type)

        return self._maybe_checkpointed(attend, query, key, value, attention_mask)

    def _maybe_checkpointed(self, attend, *tensors):
        """``attend(*tensors)``, checkpointed under MCore's selective recompute of the core
        attention (``recompute_modules`` ``core_attn``) when training with a graph."""
        if self.checkpoint_core_attention and recompute_active(self):
            return checkpointed(attend, *tensors)
        return attend(*tensors)

    def _prefix_core(self, mode: str):
        """The core attention, checked to attend to a prefix (``mode`` names the caller)."""
        core = self.core_attention
        if not getattr(core, "supports_prefix", False):
            raise NotImplementedError(
                f"{mode} needs a core attention that attends to a prefix (supports_prefix, as "
                f"LoopedCoreAttention); this layer's is {type(core).__name__}")
        return core

    def _attend_routed(self, ctx: LoopKV, hidden_states, query, key, value, attention_mask):
        if ctx.record_inputs:  # a state of inputs keeps them as the K/V
            key, value, hidden_states = ctx.exit_kv(self.config, key, value, hidden_states)
        else:
            key, value = ctx.exit_kv(self.config, key, value)
        d = ctx.depth
        if ctx.record:
            kept = (hidden_states,) if ctx.record_inputs else (key, value)
            ctx.recorded[d] = kept if torch.is_grad_enabled() else tuple(map(own, kept))
        if ctx.cache is not None:
            return self._attend_cache(ctx, query, key, value)
        if ctx.prefix is not None:
            core = self._prefix_core("attention to a prefix state")
            kind = ctx.prefix_attention  # not ``ctx`` in the closure (recompute.py, the cycle)

            def attend(query, key, value, prefix_keys, prefix_values):
                with core.attending_to(PrefixKV(prefix_keys, prefix_values, kind)):
                    return core(query, key, value, None, attn_mask_type=AttnMaskType.no_mask)

            return self._maybe_checkpointed(attend, query, key, value,
                                            *self.prefix_kv(ctx, hidden_states.dtype))
        return self._core(query, key, value, attention_mask)

    def _attend_cache(self, ctx: LoopKV, query, key, value):
        """Write the new K/V into the cache at the step's slots, then attend to the cache up to
        ``step.span`` under the step's mask (``CacheStep``: no host sync, and with a static
        cache the same shapes every step)."""
        if ctx.cache.prefix is not None:
            return self._attend_prompt_once(ctx, query, key, value)
        cache, step, d = ctx.cache, ctx.step, ctx.depth
        cache.write(d, step, key, value)
        if cache.fresh:  # a prefill from an empty cache: plain causal over its own K/V
            return self._core(query, key, value, None)
        keys, vals = cache.read(d, step.span, query.dtype)  # [T, B, ng, hn]
        return self._core(query, keys, vals, step.masked)

    def _attend_prompt_once(self, ctx: LoopKV, query, key, value):
        """Prompt-once (and tree) decoding: write the new K/V into the continuation cache,
        attend to it and, read once per row of each prefix cache of its chain (the prompt,
        then each tree level above the cache), to the K/V of the row's path."""
        cache, step, d = ctx.cache, ctx.step, ctx.depth
        cache.write(d, step, key, value)
        prefixes = [(*c.read(d, P, query.dtype), seen)
                    for c, P, seen in zip(cache.chain(), step.prefix_spans, step.prefix_allowed)]
        out = chain_prefix_attention(
            query, *cache.read(d, step.span, query.dtype), step.allowed, prefixes,
            self._prefix_core("prompt-once decoding").scale, memo=step.memo)
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [b, np, sq, hn] -> [sq, b, np*hn]
