"""An independent plain-PyTorch looped transformer: the reference for loop semantics and K/V.

Written from the maths, not from the code under test (no Megatron-Core or scalerlt_mcore
imports): token + learned position embedding (or RoPE), pre-LN layers (LayerNorm, softmax
attention with grouped K/V, GELU MLP), prelude once, core R times, coda after every loop,
``linear_concat`` injection x = W [s; e], final LayerNorm and output layer after every loop.

Weights come from a Megatron state dict through `weights_from_state_dict`. The only
Megatron convention it encodes is the parameter layout:
- ``linear_qkv.weight`` rows are grouped per query group: for group g,
  [q heads g*rep .. g*rep+rep-1, k_g, v_g], each ``head_dim`` rows;
- RoPE angles are computed in fp32 (inverse frequencies base^(-2i/d), the two halves of the
  head dimension rotated together), then cos/sin are cast to the activation dtype.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class RefConfig:
    """Shape and structure of the reference model."""

    hidden: int
    heads: int
    groups: int
    n_core: int
    n_prelude: int = 0
    n_coda: int = 0
    loops: int = 1
    injection: str = "none"  # none | linear_concat
    initial_state: str = "embed"  # embed | zeros
    position: str = "learned_absolute"  # learned_absolute | rope
    rotary_base: float = 10000.0
    eps: float = 1e-5
    backprop_loops: int = 0  # k > 0: loops 1..R-k (and their readouts) build no graph

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# ---- weights ---------------------------------------------------------------------------------


def _split_qkv(weight: Tensor, cfg: RefConfig) -> tuple:
    """Fused qkv rows [ng * (rep + 2) * hd, ...] -> q [nh * hd, ...], k [ng * hd, ...], v."""
    rep, hd = cfg.heads // cfg.groups, cfg.head_dim
    w = weight.reshape(cfg.groups, rep + 2, hd, *weight.shape[1:])  # [ng, rep+2, hd, ...]
    q = w[:, :rep].reshape(cfg.heads * hd, *weight.shape[1:])  # head h = g * rep + j
    k = w[:, rep].reshape(cfg.groups * hd, *weight.shape[1:])
    v = w[:, rep + 1].reshape(cfg.groups * hd, *weight.shape[1:])
    return q, k, v


def _layer_weights(sd: dict, prefix: str, cfg: RefConfig) -> dict:
    wq, wk, wv = _split_qkv(sd[f"{prefix}.self_attention.linear_qkv.weight"], cfg)
    bq, bk, bv = _split_qkv(sd[f"{prefix}.self_attention.linear_qkv.bias"], cfg)
    return {
        "ln1_w": sd[f"{prefix}.input_layernorm.weight"],
        "ln1_b": sd[f"{prefix}.input_layernorm.bias"],
        "wq": wq, "bq": bq, "wk": wk, "bk": bk, "wv": wv, "bv": bv,
        "wo": sd[f"{prefix}.self_attention.linear_proj.weight"],
        "bo": sd[f"{prefix}.self_attention.linear_proj.bias"],
        "ln2_w": sd[f"{prefix}.pre_mlp_layernorm.weight"],
        "ln2_b": sd[f"{prefix}.pre_mlp_layernorm.bias"],
        "w1": sd[f"{prefix}.mlp.linear_fc1.weight"],
        "b1": sd[f"{prefix}.mlp.linear_fc1.bias"],
        "w2": sd[f"{prefix}.mlp.linear_fc2.weight"],
        "b2": sd[f"{prefix}.mlp.linear_fc2.bias"],
    }


def weights_from_state_dict(sd: dict, cfg: RefConfig) -> dict:
    """Map a looped-GPT state dict (Megatron names) to the reference's weights (cloned)."""
    sd = {k: v.detach().clone() for k, v in sd.items() if isinstance(v, Tensor)}
    tok = sd["embedding.word_embeddings.weight"]
    return {
        "tok": tok,
        "pos": sd.get("embedding.position_embeddings.weight"),
        "prelude": [_layer_weights(sd, f"decoder.prelude.{i}", cfg) for i in range(cfg.n_prelude)],
        "core": [_layer_weights(sd, f"decoder.layers.{i}", cfg) for i in range(cfg.n_core)],
        "coda": [_layer_weights(sd, f"decoder.coda.{i}", cfg) for i in range(cfg.n_coda)],
        "inject": sd.get("decoder.injection.weight"),
        "norm_w": sd["decoder.final_layernorm.weight"],
        "norm_b": sd["decoder.final_layernorm.bias"],
        "out": sd.get("output_layer.weight", tok),  # tied: the word embedding
    }


# ---- model -----------------------------------------------------------------------------------


def _rope(x: Tensor, positions: Tensor, cfg: RefConfig) -> Tensor:
    """x [B, S, n, hd] rotated by absolute positions [B, S] (halves rotated together)."""
    hd = cfg.head_dim
    inv_freq = 1.0 / cfg.rotary_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, S, hd/2]
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # [B, S, 1, hd]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _attention(x: Tensor, w: dict, positions: Tensor, cfg: RefConfig, kv_out: list) -> Tensor:
    """Causal self-attention with grouped K/V. x [B, S, H]; appends (k, v) [B, S, ng, hd]."""
    B, S, _ = x.shape
    hd, rep = cfg.head_dim, cfg.heads // cfg.groups
    q = (x @ w["wq"].T + w["bq"]).view(B, S, cfg.heads, hd)
    k = (x @ w["wk"].T + w["bk"]).view(B, S, cfg.groups, hd)
    v = (x @ w["wv"].T + w["bv"]).view(B, S, cfg.groups, hd)
    if cfg.position == "rope":
        q, k = _rope(q, positions, cfg), _rope(k, positions, cfg)
    kv_out.append((k, v))
    k = k.repeat_interleave(rep, dim=2)  # head h reads group h // rep
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)  # [B, nh, S, S]
    future = torch.ones(S, S, dtype=torch.bool).triu(diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, cfg.heads * hd)
    return out @ w["wo"].T + w["bo"]


def _layer(x: Tensor, w: dict, positions: Tensor, cfg: RefConfig, kv_out: list) -> Tensor:
    """Pre-LN transformer layer: x + attn(LN(x)), then + MLP(LN(.))."""
    h = F.layer_norm(x, x.shape[-1:], w["ln1_w"], w["ln1_b"], cfg.eps)
    x = x + _attention(h, w, positions, cfg, kv_out)
    h = F.layer_norm(x, x.shape[-1:], w["ln2_w"], w["ln2_b"], cfg.eps)
    return x + F.gelu(h @ w["w1"].T + w["b1"]) @ w["w2"].T + w["b2"]


def reference_forward(weights: dict, cfg: RefConfig, tokens: Tensor,
                      positions: Tensor | None = None) -> tuple:
    """tokens [B, S] -> (per-loop logits: R tensors [B, S, V], per-depth K/V).

    The K/V list is in application order: prelude layers, then for every loop its core
    layers followed by its coda layers; each entry (k, v) is [B, S, ng, hd] (post-RoPE k).
    """
    if positions is None:
        positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    kv: list = []

    def run(layers, x):
        for w in layers:
            x = _layer(x, w, positions, cfg, kv)
        return x

    x = weights["tok"][tokens]  # [B, S, H]
    if cfg.position == "learned_absolute":
        x = x + weights["pos"][positions]
    embed = run(weights["prelude"], x)
    state = embed if cfg.initial_state == "embed" else torch.zeros_like(embed)
    logits = []
    frozen = cfg.loops - cfg.backprop_loops if 0 < cfg.backprop_loops < cfg.loops else 0
    for r in range(cfg.loops):
        with torch.no_grad() if r < frozen else contextlib.nullcontext():
            if cfg.injection == "linear_concat":
                x = torch.cat([state, embed], dim=-1) @ weights["inject"].T  # W [s; e]
            else:
                x = state
            state = run(weights["core"], x)
            y = run(weights["coda"], state)
            y = F.layer_norm(y, y.shape[-1:], weights["norm_w"], weights["norm_b"], cfg.eps)
            logits.append(y @ weights["out"].T)  # [B, S, V]
    return logits, kv
