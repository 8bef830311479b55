"""An independent plain-PyTorch Nanbeige4.2 (``NanbeigeForCausalLM``), written from the public
implementations -- vllm-rlt's ``vllm_rlt/models/nanbeige.py`` (``NanbeigeDecoderLayer``,
``recurrent_prepared``: the stored layers, then ``model.norm`` unless
``skip_loop_final_norm``, ``num_loops`` times; ``lm_head`` on the last state) and llama.cpp's
graph ``src/models/nanbeige.cpp`` (the same loop; the norm at each loop boundary and once at
the end) -- reading the checkpoint's own tensor names: it shares no code with the importer.

Batch-first [B, S, H]. One difference, rounding only: vllm-rlt's RMSNorm computes in fp32
whatever the input dtype; here it runs in the input's dtype, so that the reference is a true
fp64 function. RoPE tables are fp32 as in the public code (``rope_theta`` 7e7), then cast.

Also a tiny random checkpoint writer in Nanbeige's format (a config.json with the keys of the
released 4.2-3B config.json, safetensors with its tensor names).
"""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

NANBEIGE_CONFIG = dict(
    architectures=["NanbeigeForCausalLM"], model_type="nanbeige",
    auto_map={"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
              "AutoModel": "modeling_nanbeige.NanbeigeModel",
              "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, kv_channels=8, hidden_act="silu",
    max_position_embeddings=64, rope_theta=70000000, rope_scaling=None, attention_bias=False,
    attention_dropout=0.0, rms_norm_eps=1e-05, num_loops=2, loop_loss_weights=[],
    skip_loop_final_norm=False, pretraining_tp=1, tie_word_embeddings=False, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, torch_dtype="float32")
"""A tiny Nanbeige config.json: the keys of the released Nanbeige4.2-3B config.json (22
layers, hidden 3072, 48 / 8 heads of 128, 166144 tokens there)."""

NANBEIGE_42_3B = {**NANBEIGE_CONFIG, "vocab_size": 166144, "hidden_size": 3072,
                  "intermediate_size": 10752, "num_hidden_layers": 22, "num_attention_heads": 48,
                  "num_key_value_heads": 8, "head_dim": 128, "kv_channels": 128,
                  "max_position_embeddings": 262144, "bos_token_id": 166100,
                  "eos_token_id": 166101, "torch_dtype": "bfloat16"}
"""The released Nanbeige4.2-3B config.json (its shape, for meta builds)."""


def nanbeige_weight_shapes(cfg: dict) -> dict:
    """Every tensor of a ``NanbeigeForCausalLM`` state dict and its shape (public names)."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)})
    return out


def write_nanbeige_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """A tiny random Nanbeige checkpoint in ``path``: norms near 1, small projections."""
    cfg = {**NANBEIGE_CONFIG, **overrides}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in nanbeige_weight_shapes(cfg).items():
        noise = torch.randn(shape, generator=gen)
        tensors[name] = 1 + 0.1 * noise if "norm" in name else 0.15 * noise
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_nanbeige(path, dtype=torch.float64) -> tuple:
    """(config.json dict, its tensors in ``dtype``) of a Nanbeige checkpoint directory."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return cfg, {k: v.to(dtype) for k, v in weights.items()}


# ---- the forward -------------------------------------------------------------------------


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _cos_sin(cfg, S, dtype):
    hd = cfg["head_dim"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.arange(S).float()[:, None] * inv_freq  # [S, hd/2] (fp32, as the public code)
    angles = torch.cat((angles, angles), dim=-1)  # [S, hd]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _attention(x, w, p, cfg, cos, sin, mask):
    B, S, _ = x.shape
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = (x @ w[p + "q_proj.weight"].t()).view(B, S, nh, hd).transpose(1, 2)  # [B, nh, S, hd]
    k = (x @ w[p + "k_proj.weight"].t()).view(B, S, nkv, hd).transpose(1, 2)
    v = (x @ w[p + "v_proj.weight"].t()).view(B, S, nkv, hd).transpose(1, 2)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))  # GQA
    scores = (q @ k.transpose(2, 3)) / math.sqrt(hd) + mask  # [B, nh, S, S]
    out = torch.softmax(scores, dim=-1) @ v  # [B, nh, S, hd]
    return out.transpose(1, 2).reshape(B, S, nh * hd) @ w[p + "o_proj.weight"].t()


def _decoder_layer(x, w, i, cfg, cos, sin, mask):
    """``NanbeigeDecoderLayer``: pre-norm attention and SwiGLU MLP, each with its residual."""
    p, eps = f"model.layers.{i}.", cfg["rms_norm_eps"]
    x = x + _attention(_rms(x, w[p + "input_layernorm.weight"], eps), w, p + "self_attn.", cfg,
                       cos, sin, mask)
    h, m = _rms(x, w[p + "post_attention_layernorm.weight"], eps), p + "mlp."
    return x + (F.silu(h @ w[m + "gate_proj.weight"].t()) * (h @ w[m + "up_proj.weight"].t())
                ) @ w[m + "down_proj.weight"].t()


def nanbeige_forward(cfg: dict, w: dict, tokens, attention_mask=None, num_loops=None):
    """``NanbeigeForCausalLM`` on tokens [B, S] (``attention_mask`` [B, S], 1 = token) with
    ``num_loops`` loops (default config.json's): logits [B, S, V]. Each loop runs every stored
    layer, attending to that loop's own keys (its own cache slot), then ``model.norm``."""
    B, S = tokens.shape
    dtype = w["model.embed_tokens.weight"].dtype
    keep = torch.ones(B, S) if attention_mask is None else attention_mask
    causal = torch.ones(S, S).tril().bool()[None] & keep.bool()[:, None, :]  # [B, S, S]
    mask = torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~causal[:, None], float("-inf"))
    cos, sin = _cos_sin(cfg, S, dtype)
    x = w["model.embed_tokens.weight"][tokens]
    for _ in range(num_loops or cfg["num_loops"]):
        for i in range(cfg["num_hidden_layers"]):
            x = _decoder_layer(x, w, i, cfg, cos, sin, mask)
        x = _rms(x, w["model.norm.weight"], cfg["rms_norm_eps"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).t()
