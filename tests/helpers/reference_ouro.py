"""An independent plain-PyTorch Ouro (LoopLM), written from the public modeling code
(``modeling_ouro.py`` of the ``OuroForCausalLM`` remote code; copy read in LoopedLMs/ouro_rl)
and reading its checkpoint names directly: it shares no code with the importer.

Batch-first [B, S, H] as the public code. Differences, both rounding only: the public RMSNorm
and eager softmax compute in fp32 whatever the input dtype (a half-precision guard that rounds
an fp64 reference to fp32); here they run in the input's dtype, so that the reference is a true
fp64 function. RoPE tables are fp32 as in the public code, then cast.

Also a tiny random checkpoint writer in Ouro's own format (config.json with the real fields,
safetensors with the real weight names).
"""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

OURO_CONFIG = dict(
    architectures=["OuroForCausalLM"], model_type="ouro",
    auto_map={"AutoConfig": "configuration_ouro.OuroConfig",
              "AutoModel": "modeling_ouro.OuroModel",
              "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_act="silu",
    max_position_embeddings=64, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
    tie_word_embeddings=False, rope_theta=1000000.0, rope_scaling=None,
    use_sliding_window=False, sliding_window=None, max_window_layers=2,
    layer_types=["full_attention", "full_attention"], attention_dropout=0.0,
    total_ut_steps=4, early_exit_threshold=1.0, bos_token_id=1, eos_token_id=2,
    torch_dtype="float32", transformers_version="4.55.0")
"""A tiny Ouro config.json (the fields of ``configuration_ouro.OuroConfig``)."""


def ouro_weight_shapes(cfg: dict) -> dict:
    """Every tensor of an ``OuroForCausalLM`` state dict and its shape (public names)."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
           "model.early_exit_gate.weight": (1, h), "model.early_exit_gate.bias": (1,)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)})
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                     "post_attention_layernorm_2"):
            out[f"{p}{norm}.weight"] = (h,)
    return out


def write_ouro_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """A tiny random Ouro checkpoint in ``path``: norms near 1, the gate with unit-size logits."""
    cfg = {**OURO_CONFIG, **overrides}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in ouro_weight_shapes(cfg).items():
        noise = torch.randn(shape, generator=gen)
        tensors[name] = (1 + 0.1 * noise if "norm" in name
                         else (0.5 if "gate" in name else 0.15) * noise)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_ouro(path, dtype=torch.float64) -> tuple:
    """(config.json dict, its tensors in ``dtype``) of an Ouro checkpoint directory."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return cfg, {k: v.to(dtype) for k, v in weights.items()}


# ---- the forward -------------------------------------------------------------------------


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(cfg, positions, dtype):
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = positions.float()[..., None] * inv_freq  # [B, S, hd/2] (fp32, as the public code)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, S, hd]


def _attention(x, w, p, cfg, cos, sin, mask):
    B, S, _ = x.shape
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    q = (x @ w[p + "q_proj.weight"].t()).view(B, S, nh, hd).transpose(1, 2)  # [B, nh, S, hd]
    k = (x @ w[p + "k_proj.weight"].t()).view(B, S, nkv, hd).transpose(1, 2)
    v = (x @ w[p + "v_proj.weight"].t()).view(B, S, nkv, hd).transpose(1, 2)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))  # repeat_kv
    scores = (q @ k.transpose(2, 3)) / math.sqrt(hd) + mask  # [B, nh, S, S]
    out = torch.softmax(scores, dim=-1) @ v  # [B, nh, S, hd]
    return out.transpose(1, 2).reshape(B, S, nh * hd) @ w[p + "o_proj.weight"].t()


def _decoder_layer(x, w, i, cfg, cos, sin, mask):
    p, eps = f"model.layers.{i}.", cfg["rms_norm_eps"]
    h = _rms(x, w[p + "input_layernorm.weight"], eps)
    h = _attention(h, w, p + "self_attn.", cfg, cos, sin, mask)
    x = x + _rms(h, w[p + "input_layernorm_2.weight"], eps)
    h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    m = p + "mlp."
    h = (F.silu(h @ w[m + "gate_proj.weight"].t()) * (h @ w[m + "up_proj.weight"].t())
         ) @ w[m + "down_proj.weight"].t()
    return x + _rms(h, w[p + "post_attention_layernorm_2.weight"], eps)


def ouro_forward(cfg: dict, w: dict, tokens, attention_mask=None, total_ut_steps=None) -> dict:
    """``OuroForCausalLM`` on tokens [B, S] (``attention_mask`` [B, S], 1 = token): per-UT-step
    logits [R, B, S, V], gate logits [R, B, S] and the exit pdf [R, B, S] of the public code."""
    steps = total_ut_steps or cfg["total_ut_steps"]
    B, S = tokens.shape
    dtype = w["model.embed_tokens.weight"].dtype
    keep = torch.ones(B, S) if attention_mask is None else attention_mask
    positions = torch.arange(S)[None].expand(B, S)
    causal = torch.ones(S, S).tril().bool()[None] & keep.bool()[:, None, :]  # [B, S, S]
    mask = torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~causal[:, None], float("-inf"))
    cos, sin = _cos_sin(cfg, positions, dtype)
    x = w["model.embed_tokens.weight"][tokens]
    lm_head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    hidden, gates = [], []
    for _ in range(steps):  # for current_ut in range(self.total_ut_steps)
        for i in range(cfg["num_hidden_layers"]):
            x = _decoder_layer(x, w, i, cfg, cos, sin, mask)
        x = _rms(x, w["model.norm.weight"], cfg["rms_norm_eps"])
        hidden.append(x)
        gates.append((x @ w["model.early_exit_gate.weight"].t()
                      + w["model.early_exit_gate.bias"]).squeeze(-1))
    pdf, remaining = [], torch.ones_like(gates[0])
    for idx, g in enumerate(gates):
        lam = torch.sigmoid(g)
        if idx < len(gates) - 1:
            pdf.append(lam * remaining)
            remaining = remaining * (1.0 - lam)
        else:
            pdf.append(remaining)
    return {"logits": torch.stack([h @ lm_head.t() for h in hidden]),
            "gate_logits": torch.stack(gates), "exit_pdf": torch.stack(pdf)}


def threshold_exit_step(exit_pdf, threshold: float):
    """The public code's threshold exit: per token the first step whose exit CDF reaches
    ``threshold`` (the last step when none does). exit_pdf [R, ...] -> step index [...]."""
    cdf = torch.cumsum(exit_pdf, dim=0)
    reached = cdf >= threshold
    steps = torch.argmax(reached.to(torch.float32), dim=0)
    steps[~reached.any(dim=0)] = exit_pdf.shape[0] - 1
    return steps
