"""An independent plain-PyTorch Huginn-0125 (``huginn_raven``), written from the public modeling
code (seal-rg/recurrent-pretraining ``recpre/raven_modeling_minimal.py``, config fields from
``raven_config_minimal.py``), reading its checkpoint names directly: it shares no code with the
importer.

Batch-first [B, S, H] as the public code; the initial recurrent state is an input
(``input_states``, as the public forward accepts it). Differences, rounding only: the public
RMSNorm and rotary embedding compute in fp32 whatever the input dtype; here they run in the
input's dtype (RoPE tables fp32 as in the public code, then cast), so that the reference is a
true fp64 function. The public forward builds no padding mask (causal attention only), so
right-padded batches are compared on their non-padding positions.

Also a tiny random checkpoint writer in Huginn's format.
"""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

HUGINN_CONFIG = dict(
    architectures=["RavenForCausalLM"], model_type="huginn_raven",
    auto_map={"AutoConfig": "raven_config_minimal.RavenConfig",
              "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
    n_embd=32, n_heads=4, n_layers=4, block_size=64, vocab_size=64, padding_multiple=64,
    tie_embeddings=True, intermediate_size=48, bias=False,
    architecture_class_name="RecurrentGPT", block_class_name="SandwichBlock",
    norm_class_name="RMSNorm_llama", norm_eps=1e-6, mlp_class_name="GatedMLP",
    nonlin_name="SiLU", init_strategy="takase", init_orthogonal=False, state_init="like-init",
    injection_type="linear", n_layers_in_recurrent_block=2, mean_recurrence=4,
    sampling_scheme="poisson-lognormal-filling", mean_backprop_depth=2, n_layers_in_prelude=1,
    n_layers_in_coda=1, qk_bias=True, activation_checkpoint_impl="per-iteration",
    rope_base=50000.0, torch_dtype="float32", transformers_version="4.47.1")
"""A tiny Huginn config.json (the fields of ``raven_config_minimal.RavenConfig``)."""


def _stacks(cfg):
    return {"prelude": cfg["n_layers_in_prelude"],
            "core_block": cfg["n_layers_in_recurrent_block"], "coda": cfg["n_layers_in_coda"]}


def freqs_cis(cfg) -> torch.Tensor:
    """``precompute_freqs_cis(n_embd // n_heads, block_size, rope_base)``: [1, T, 1, hd/2, 2]."""
    dim = cfg["n_embd"] // cfg["n_heads"]
    inv = 1.0 / (cfg["rope_base"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    t = torch.arange(cfg["block_size"], dtype=torch.float32)
    freqs = torch.outer(t, inv).float()
    return torch.stack([torch.cos(freqs)[None, :, None, :], torch.sin(freqs)[None, :, None, :]],
                       dim=4)


def huginn_weight_shapes(cfg: dict) -> dict:
    """Every weight of a ``RavenForCausalLM`` state dict and its shape (public names)."""
    h, f, v, n = cfg["n_embd"], cfg["intermediate_size"], cfg["vocab_size"], cfg["n_heads"]
    out = {"transformer.wte.weight": (v, h), "transformer.ln_f.weight": (h,),
           "transformer.adapter.weight": (h, 2 * h)}
    if not cfg["tie_embeddings"]:
        out["lm_head.weight"] = (v, h)
    for stack, count in _stacks(cfg).items():
        for i in range(count):
            p = f"transformer.{stack}.{i}."
            out.update({p + "attn.Wqkv.weight": (3 * h, h), p + "attn.qk_bias": (2, 1, n, h // n),
                        p + "attn.proj.weight": (h, h), p + "mlp.fc.weight": (2 * f, h),
                        p + "mlp.proj.weight": (h, f)})
            out.update({f"{p}norm_{j}.weight": (h,) for j in range(1, 5)})
    return out


def write_huginn_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """A tiny random Huginn checkpoint in ``path`` (tied embeddings saved once, as
    ``save_pretrained`` saves them; the persistent ``freqs_cis`` buffer included)."""
    cfg = {**HUGINN_CONFIG, **overrides}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in huginn_weight_shapes(cfg).items():
        noise = torch.randn(shape, generator=gen)
        tensors[name] = 1 + 0.1 * noise if "norm" in name else 0.15 * noise
    tensors["freqs_cis"] = freqs_cis(cfg)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_huginn(path, dtype=torch.float64) -> tuple:
    cfg = json.loads((Path(path) / "config.json").read_text())
    weights = load_file(str(Path(path) / "model.safetensors"))
    return cfg, {k: v if k == "freqs_cis" else v.to(dtype) for k, v in weights.items()}


# ---- the forward -------------------------------------------------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotary(q, k, fc):
    """``apply_rotary_emb_complex_like``: (even, odd) channel pairs rotated by fc [1, S, 1, hd/2, 2]
    (cos, sin)."""
    qk = torch.cat([q, k], dim=2).unflatten(-1, (-1, 2))  # [B, S, nq + nk, hd/2, 2]
    c, s = fc[..., 0].to(q.dtype), fc[..., 1].to(q.dtype)
    rot = torch.stack([qk[..., 0] * c - qk[..., 1] * s, qk[..., 1] * c + qk[..., 0] * s],
                      -1).flatten(3)
    return torch.split(rot, q.shape[2], dim=2)


def _attention(x, w, p, cfg, fc):
    B, S, E = x.shape
    n = cfg["n_heads"]
    hd = E // n
    q, k, v = (x @ w[p + "Wqkv.weight"].t()).split([E, E, E], dim=2)
    q, k, v = (t.view(B, S, n, hd) for t in (q, k, v))
    q_bias, k_bias = w[p + "qk_bias"].split(1, dim=0)
    q, k = q + q_bias, k + k_bias
    q, k = _rotary(q, k, fc)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, n, S, hd]
    scores = q @ k.transpose(2, 3) / math.sqrt(hd)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    y = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
    return y.transpose(1, 2).reshape(B, S, E) @ w[p + "proj.weight"].t()


def _block(x, w, p, cfg, fc):
    eps = cfg["norm_eps"]
    attn = _attention(_rms(x, w[p + "norm_1.weight"], eps), w, p + "attn.", cfg, fc)
    x = _rms(attn + x, w[p + "norm_2.weight"], eps)
    h = _rms(x, w[p + "norm_3.weight"], eps)
    gate, up = (h @ w[p + "mlp.fc.weight"].t()).chunk(2, dim=-1)
    return _rms((F.silu(gate) * up) @ w[p + "mlp.proj.weight"].t() + x,
                w[p + "norm_4.weight"], eps)


def huginn_forward(cfg: dict, w: dict, tokens, num_steps: int, input_states):
    """``RavenForCausalLM.forward(input_ids, input_states=..., num_steps=...)`` -> logits
    [B, S, V]: embedding * sqrt(n_embd), prelude, ``num_steps`` x (adapter(cat(x, e)), core),
    ln_f, coda, ln_f, lm_head."""
    S = tokens.shape[1]
    fc = freqs_cis(cfg)[:, :S]
    e = w["transformer.wte.weight"][tokens] * math.sqrt(cfg["n_embd"])  # emb_scale
    for i in range(cfg["n_layers_in_prelude"]):
        e = _block(e, w, f"transformer.prelude.{i}.", cfg, fc)
    x = input_states.clone()
    for _ in range(num_steps):  # core_block_forward
        x = torch.cat([x, e], dim=-1) @ w["transformer.adapter.weight"].t()
        for i in range(cfg["n_layers_in_recurrent_block"]):
            x = _block(x, w, f"transformer.core_block.{i}.", cfg, fc)
    x = _rms(x, w["transformer.ln_f.weight"], cfg["norm_eps"])  # iterate_forward's return
    for i in range(cfg["n_layers_in_coda"]):
        x = _block(x, w, f"transformer.coda.{i}.", cfg, fc)
    x = _rms(x, w["transformer.ln_f.weight"], cfg["norm_eps"])
    head = w.get("lm_head.weight", w["transformer.wte.weight"])
    return x @ head.t()


def documented_initial_state(seed: int, step: int, length: int, hidden: int, positions,
                             std=None, scale=None):
    """The importer's documented deterministic draw (``looped_initial_state`` random), written
    out here from its description: per absolute position, a normal of ``std`` (default
    sqrt(2 / (5 H))) truncated at 3 std, times ``scale`` (default sqrt(H)), from a CPU generator
    seeded with (seed * 1000003 + step * 10007 + 271828) mod (2^31 - 1).
    positions [B, S] -> [B, S, H]."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 10_007 + 271_828)
                                        % (2**31 - 1))
    std = math.sqrt(2 / (5 * hidden)) if std is None else std
    table = torch.empty(length, hidden, dtype=torch.float64)
    torch.nn.init.trunc_normal_(table, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
    return (table * (math.sqrt(hidden) if scale is None else scale))[positions]


# ---- Retrofitted Recurrence (raven_modeling_minimal_llama.py) ------------------------------

RETROFIT_CONFIG = {
    **{k: v for k, v in HUGINN_CONFIG.items() if k != "auto_map"},
    "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                 "AutoModelForCausalLM": "raven_modeling_minimal_llama.RavenForCausalLM"},
    "num_key_value_heads": 2, "head_dim": 8, "qk_bias": False, "tie_embeddings": False,
    "norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
    "max_position_embeddings": 64,
    "init_values": {"std": math.sqrt(2 / (5 * 5280)), "out_proj": 0.01, "embedding": 0.1,
                    "embed_scale": 1.0}}
"""A tiny Retrofitted Recurrence config.json, as ``convert_llama.get_llama_huginn_config``
writes it (Huginn's fields updated from a Llama: GQA, no qk bias, untied, embed_scale 1; the
state's std stays Huginn-0125's, sqrt(2 / (5 * 5280)))."""


def retrofit_weight_shapes(cfg: dict) -> dict:
    h, f, v = cfg["n_embd"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nkv = cfg["head_dim"], cfg["num_key_value_heads"]
    out = {"transformer.wte.weight": (v, h), "transformer.ln_f.weight": (h,),
           "transformer.adapter.weight": (h, 2 * h), "lm_head.weight": (v, h)}
    for stack, count in _stacks(cfg).items():
        for i in range(count):
            p = f"transformer.{stack}.{i}."
            out.update({p + "attn.Wqkv.weight": (h + 2 * nkv * hd, h),
                        p + "attn.proj.weight": (h, h), p + "mlp.fc.weight": (2 * f, h),
                        p + "mlp.proj.weight": (h, f), p + "norm_1.weight": (h,),
                        p + "norm_2.weight": (h,)})
    return out


def write_retrofit_checkpoint(path, seed: int = 0) -> Path:
    cfg = dict(RETROFIT_CONFIG)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: (1 + 0.1 * torch.randn(shape, generator=gen) if "norm" in name
                      else 0.15 * torch.randn(shape, generator=gen))
               for name, shape in retrofit_weight_shapes(cfg).items()}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _retro_attention(x, w, p, cfg, cos, sin):
    B, S, E = x.shape
    n, nkv, hd = cfg["n_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q, k, v = (x @ w[p + "Wqkv.weight"].t()).split([E, nkv * hd, nkv * hd], dim=2)
    q = q.view(B, S, n, hd).transpose(1, 2)
    k, v = (t.view(B, S, nkv, hd).transpose(1, 2) for t in (k, v))
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin  # Llama RoPE
    k, v = (t.repeat_interleave(n // nkv, dim=1) for t in (k, v))  # enable_gqa
    scores = q @ k.transpose(2, 3) / math.sqrt(hd)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    y = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
    return y.transpose(1, 2).reshape(B, S, E) @ w[p + "proj.weight"].t()


def _retro_block(x, w, p, cfg, cos, sin):
    eps = cfg["norm_eps"]
    x = _retro_attention(_rms(x, w[p + "norm_1.weight"], eps), w, p + "attn.", cfg, cos, sin) + x
    gate, up = (_rms(x, w[p + "norm_2.weight"], eps) @ w[p + "mlp.fc.weight"].t()).chunk(2, -1)
    return (F.silu(gate) * up) @ w[p + "mlp.proj.weight"].t() + x


def retrofit_forward(cfg: dict, w: dict, tokens, num_steps: int, input_states):
    """The Llama-style ``RavenForCausalLM.forward``: pre-norm blocks, LlamaRotaryEmbedding
    (default rope_type: inv_freq from rope_theta, fp32 tables), no embedding scale
    (init_values.embed_scale 1), iterate_forward without ln_f, coda, ln_f, lm_head."""
    S, hd = tokens.shape[1], cfg["head_dim"]
    dtype = w["transformer.wte.weight"].dtype
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    emb = torch.cat([torch.outer(torch.arange(S, dtype=torch.float32), inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]
    e = w["transformer.wte.weight"][tokens] * cfg["init_values"]["embed_scale"]
    for i in range(cfg["n_layers_in_prelude"]):
        e = _retro_block(e, w, f"transformer.prelude.{i}.", cfg, cos, sin)
    x = input_states.clone()
    for _ in range(num_steps):
        x = torch.cat([x, e], dim=-1) @ w["transformer.adapter.weight"].t()
        for i in range(cfg["n_layers_in_recurrent_block"]):
            x = _retro_block(x, w, f"transformer.core_block.{i}.", cfg, cos, sin)
    for i in range(cfg["n_layers_in_coda"]):
        x = _retro_block(x, w, f"transformer.coda.{i}.", cfg, cos, sin)
    return _rms(x, w["transformer.ln_f.weight"], cfg["norm_eps"]) @ w["lm_head.weight"].t()
