"""Import a Hugging Face Llama / Qwen2 directory (``config.json`` + ``*.safetensors``).

``read_hf_architecture(dir)`` reads the architecture (in Megatron-LM's argument names) and
``load_hf_state_dict(dir, arch)`` the weights under MCore ``GPTModel`` names (local spec), for
``retrofit_state_dict`` and ``load_converted_state_dict``. Only ``safetensors`` is needed
(``transformers`` is not). Conversions:

- ``q_proj`` / ``k_proj`` / ``v_proj`` (+ Qwen2's biases) -> ``linear_qkv``, packed per query
  group as MCore splits it: [the group's query heads, its key head, its value head];
- ``gate_proj`` / ``up_proj`` -> ``linear_fc1`` = [gate; up] (SwiGLU: silu(gate) * up);
- RMSNorm weights, ``embed_tokens``, ``lm_head`` (absent when tied), ``norm``;
- RoPE: ``rope_theta`` -> ``rotary_base``; HF's rotate-half layout is MCore's non-interleaved
  one; ``llama3`` scaling with MCore's fixed frequency factors (1, 4, context 8192).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from .config import LoopedTransformerConfig
from .looped_gpt import LoopedGPTModel
from .retrofit import LayerMapping, load_converted_state_dict, retrofit_state_dict
from .specs import get_looped_gpt_block_spec

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
"""HF ``architectures`` names this importer converts."""

MCORE_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
"""The llama3 RoPE-scaling parameters MCore's ``RotaryEmbedding`` implements (fixed)."""


@dataclass(frozen=True)
class PretrainedArchitecture:
    """A pretrained model's architecture, in Megatron-LM's argument names."""

    num_layers: int
    """N: transformer layers of the source model."""
    hidden_size: int
    """Hidden size."""
    ffn_hidden_size: int
    """MLP hidden size (``intermediate_size``)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (``num_key_value_heads``)."""
    kv_channels: int
    """Head dimension."""
    vocab_size: int
    """Rows of the embedding table."""
    norm_epsilon: float
    """RMSNorm epsilon (``rms_norm_eps``)."""
    rotary_base: float
    """RoPE base (``rope_theta``)."""
    use_rope_scaling: bool
    """Llama 3.x RoPE frequency scaling."""
    rope_scaling_factor: float
    """Its factor (8 when unused, MCore's default)."""
    add_qkv_bias: bool
    """Biases on the query/key/value projections (Qwen2)."""
    untie_embeddings_and_output_weights: bool
    """The output layer has its own weights (``tie_word_embeddings`` false)."""
    normalization: str = "RMSNorm"
    """Norm type."""
    swiglu: bool = True
    """SwiGLU MLP (gated, silu)."""
    disable_bias_linear: bool = True
    """No biases on the other linear layers."""
    position_embedding_type: str = "rope"
    """Rotary position embeddings."""

    def config_kwargs(self) -> dict:
        """``LoopedTransformerConfig`` keyword arguments of the layer shapes (the loop
        structure -- ``num_layers`` = core layers, prelude, coda, loops -- is the caller's)."""
        return dict(
            hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads, num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels, normalization=self.normalization,
            layernorm_epsilon=self.norm_epsilon, gated_linear_unit=self.swiglu,
            activation_func=F.silu if self.swiglu else F.gelu,
            add_bias_linear=not self.disable_bias_linear, add_qkv_bias=self.add_qkv_bias,
        )

    def model_kwargs(self) -> dict:
        """``LoopedGPTModel`` keyword arguments (besides config, spec and sequence length)."""
        return dict(
            vocab_size=self.vocab_size, position_embedding_type=self.position_embedding_type,
            rotary_base=self.rotary_base, rope_scaling=self.use_rope_scaling,
            rope_scaling_factor=self.rope_scaling_factor,
            share_embeddings_and_output_weights=not self.untie_embeddings_and_output_weights,
        )


# ---- config.json ---------------------------------------------------------------------------


def read_hf_config(path) -> dict:
    """The parsed ``config.json`` of HF directory ``path``."""
    file = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise FileNotFoundError(f"pretrained checkpoint {path} is not a directory")
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face model directory")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config


def read_hf_architecture(path) -> PretrainedArchitecture:
    """The architecture of HF directory ``path``; unsupported features raise, naming them."""
    cfg = read_hf_config(path)
    where = Path(path) / "config.json"
    arch = _architecture_name(cfg, where)
    _reject_unsupported(cfg, arch, where)
    return llama_like_architecture(
        cfg, where, qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)))


def llama_like_architecture(cfg: dict, where: Path, qkv_bias: bool) -> PretrainedArchitecture:
    """The architecture of a Llama-style HF ``config.json`` (``num_hidden_layers``,
    ``num_key_value_heads``, ``rope_theta``, ...; Llama, Qwen2, Ouro), with or without a qkv
    bias."""
    heads = required_int(cfg, "num_attention_heads", where)
    hidden = required_int(cfg, "hidden_size", where)
    scaling, factor = rope_scaling(cfg, where)
    return PretrainedArchitecture(
        num_layers=required_int(cfg, "num_hidden_layers", where), hidden_size=hidden,
        ffn_hidden_size=required_int(cfg, "intermediate_size", where),
        num_attention_heads=heads, num_query_groups=query_groups(cfg, heads, where),
        kv_channels=cfg.get("head_dim") or hidden // heads,
        vocab_size=required_int(cfg, "vocab_size", where),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        rotary_base=float(rope_parameters(cfg).get("rope_theta", 10000.0)),
        use_rope_scaling=scaling, rope_scaling_factor=factor, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False))


def query_groups(cfg: dict, heads: int, where: Path, heads_key="num_attention_heads") -> int:
    """``num_key_value_heads`` (absent or null: ``heads``), which must divide the query heads
    (each K/V head serves a group of them)."""
    groups = heads if cfg.get("num_key_value_heads") is None else required_int(
        cfg, "num_key_value_heads", where)
    if heads % groups:
        raise ValueError(f"{where}: {heads_key}={heads} is not a multiple of "
                         f"num_key_value_heads={groups}")
    return groups


def _architecture_name(cfg: dict, where: Path) -> str:
    names = cfg.get("architectures") or []
    if len(names) != 1 or names[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{where}: unsupported architecture {names!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return names[0]


def required_int(cfg: dict, key: str, where: Path, default: Optional[int] = None) -> int:
    """``cfg[key]`` (or ``default`` where absent), which must be a positive integer."""
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _reject_unsupported(cfg: dict, arch: str, where: Path) -> None:
    """Features with no MCore equivalent here, each named."""
    checks = {
        "hidden_act": (cfg.get("hidden_act", "silu") == "silu", "only 'silu' (SwiGLU)"),
        "mlp_bias": (not cfg.get("mlp_bias", False), "MLP biases are not supported"),
        "attention_bias": (arch != "LlamaForCausalLM" or not cfg.get("attention_bias", False),
                           "Llama attention biases (o_proj included) are not supported"),
        "use_sliding_window": (not cfg.get("use_sliding_window", False),
                               "sliding-window attention is not supported"),
        "partial_rotary_factor": (rope_parameters(cfg).get("partial_rotary_factor", 1.0) == 1.0,
                                  "partial rotary embeddings are not supported"),
    }
    for key, (ok, why) in checks.items():
        if not ok:
            value = cfg.get(key, rope_parameters(cfg).get(key))
            raise ValueError(f"{where}: {key}={value!r}: {why}")


def rope_parameters(cfg: dict) -> dict:
    """RoPE settings in either layout: ``rope_parameters`` (transformers >= 5) or
    ``rope_theta`` + ``rope_scaling`` (earlier)."""
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    if "rope_theta" in cfg:
        params.setdefault("rope_theta", cfg["rope_theta"])
    return params


def rope_scaling(cfg: dict, where: Path) -> tuple:
    """(use_rope_scaling, rope_scaling_factor) -- default RoPE or MCore's llama3 scaling."""
    params = rope_parameters(cfg)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return False, 8.0
    if kind != "llama3":
        raise ValueError(f"{where}: RoPE scaling type {kind!r} is not supported (supported: "
                         f"default, llama3)")
    for key, value in MCORE_LLAMA3_SCALING.items():
        if float(params.get(key, value)) != value:
            raise ValueError(f"{where}: llama3 RoPE scaling with {key}={params[key]!r} is not "
                             f"supported (MCore's RotaryEmbedding fixes it to {value})")
    return True, float(params["factor"])


# ---- safetensors ---------------------------------------------------------------------------


def load_hf_state_dict(path, arch: PretrainedArchitecture) -> dict:
    """Every weight of HF directory ``path`` under MCore ``GPTModel`` names (N layers)."""
    reader = SafetensorsReader(Path(path))
    out = llama_to_mcore(reader, arch)
    reader.refuse_unread("the Llama / Qwen2 importer", buffers=ROPE_BUFFERS)
    return out


ROPE_BUFFERS = ("rotary_emb.inv_freq",)
"""Name endings of RoPE tables that older HF checkpoints save beside the weights (recomputed
from config.json, so not read)."""

LLAMA_TOP = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
             "model.norm.weight": "decoder.final_layernorm.weight"}
"""HF tensor -> MCore tensor, outside the layers (``lm_head`` when untied)."""

LLAMA_LAYER = {"input_layernorm.weight": "input_layernorm.weight",
               "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
               "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
               "mlp.down_proj.weight": "mlp.linear_fc2.weight"}
"""Per layer, the one-to-one tensors (``model.layers.{i}.`` -> ``decoder.layers.{i}.``)."""


def llama_shapes(arch: PretrainedArchitecture, layer_norms: tuple = ()) -> dict:
    """Tensor name -> shape of a checkpoint in Llama's layout under ``arch`` (no biases);
    ``layer_norms``: more [H] norms per layer (their names in the layer)."""
    h, f, v, hn = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size, arch.kv_channels
    q, kv = arch.num_attention_heads * hn, arch.num_query_groups * hn
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if arch.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = (v, h)
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
             "mlp.down_proj.weight": (h, f), **{n: (h,) for n in layer_norms}}
    for i in range(arch.num_layers):
        out.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    return out


def llama_to_mcore(hf, arch: PretrainedArchitecture, top: dict = LLAMA_TOP,
                   layer: dict = LLAMA_LAYER) -> dict:
    """Tensors of Llama's layout (``hf[name]``) -> MCore names: ``top`` and ``layer`` (HF name
    -> ours) one to one, q/k/v (and with ``add_qkv_bias`` their biases) packed per query group,
    gate/up as [gate; up]."""
    out = {ours: hf[theirs] for theirs, ours in top.items()}
    if arch.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(arch.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update({dst + ours: hf[src + theirs] for theirs, ours in layer.items()})
        for kind in ("weight", "bias") if arch.add_qkv_bias else ("weight",):
            qkv = [hf[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[f"{dst}self_attention.linear_qkv.{kind}"] = pack_qkv(*qkv, arch)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"],
                                                        hf[src + "mlp.up_proj.weight"]])
    return out


def mcore_to_llama(sd, arch: PretrainedArchitecture, top: dict = LLAMA_TOP,
                   layer: dict = LLAMA_LAYER) -> dict:
    """The inverse of ``llama_to_mcore``: MCore-named tensors -> Llama's layout."""
    out = {theirs: sd[ours] for theirs, ours in top.items()}
    if arch.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for i in range(arch.num_layers):
        dst, src = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update({dst + theirs: sd[src + ours] for theirs, ours in layer.items()})
        for kind in ("weight", "bias") if arch.add_qkv_bias else ("weight",):
            q, k, v = unpack_qkv(sd[f"{src}self_attention.linear_qkv.{kind}"], arch)
            out.update({f"{dst}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v))})
        gate, up = sd[src + "mlp.linear_fc1.weight"].chunk(2)
        out.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up})
    return out


def pack_qkv(q, k, v, arch: PretrainedArchitecture):
    """HF's separate projections (weights [n*hn, H] or biases [n*hn]) -> MCore's linear_qkv:
    per query group, the group's query heads, then its key head, then its value head."""
    groups, hn = arch.num_query_groups, arch.kv_channels
    rep = arch.num_attention_heads // groups
    tail = q.shape[1:]
    q = q.reshape(groups, rep * hn, *tail)  # [ng, rep*hn, (H)]: query head h in group h // rep
    k = k.reshape(groups, hn, *tail)  # [ng, hn, (H)]
    v = v.reshape(groups, hn, *tail)
    return torch.cat([q, k, v], dim=1).reshape(groups * (rep + 2) * hn, *tail)


def unpack_qkv(qkv, arch: PretrainedArchitecture) -> tuple:
    """The inverse of ``pack_qkv``: MCore's linear_qkv (weight or bias) -> (q, k, v)."""
    groups, hn = arch.num_query_groups, arch.kv_channels
    rep = arch.num_attention_heads // groups
    tail = qkv.shape[1:]
    per_group = qkv.reshape(groups, (rep + 2) * hn, *tail)  # [ng, (rep + 2) * hn, (H)]
    q, k, v = per_group.split([rep * hn, hn, hn], dim=1)
    return tuple(t.reshape(-1, *tail).contiguous() for t in (q, k, v))


class SafetensorsReader:
    """Tensors by name from a directory's ``*.safetensors`` files (sharded or single)."""

    def __init__(self, root: Path):
        from safetensors import safe_open

        self._open = safe_open
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {root} (only safetensors weights "
                                    f"are read; re-save with save_pretrained)")
        self.files, self.where, self.read = files, {}, set()
        for file in files:
            try:
                with safe_open(str(file), "pt") as f:
                    self.where.update({name: file for name in f.keys()})
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(f"cannot read {file}: {e}") from e

    def get(self, name: str, shape: Optional[tuple] = None) -> torch.Tensor:
        """Tensor ``name``; with ``shape``, one of another shape is refused, naming both."""
        if name not in self.where:
            files = ", ".join(f.name for f in self.files)
            raise ValueError(f"tensor {name!r} is missing from {files} in {self.files[0].parent}")
        with self._open(str(self.where[name]), "pt") as f:
            tensor = f.get_tensor(name)
        self.read.add(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} in {self.where[name]} has shape "
                             f"{tuple(tensor.shape)}, config.json implies {tuple(shape)}")
        return tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        """``get(name)``: the reader as the mapping ``llama_to_mcore`` reads."""
        return self.get(name)

    def refuse_unread(self, importer: str, buffers: tuple = ()) -> None:
        """Refuse a tensor no ``get`` has read (a weight the mapping would drop), naming it;
        ``buffers``: name endings of non-weight buffers that may be present unread."""
        unread = sorted(n for n in self.where if n not in self.read and not n.endswith(buffers))
        if unread:
            more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
            raise ValueError(f"tensor {unread[0]!r} in {self.where[unread[0]]}{more} is not read "
                             f"by {importer}: a checkpoint of another layout (its weights "
                             f"would be dropped)")


# ---- one call ------------------------------------------------------------------------------


def looped_gpt_from_hf(path, mapping: Optional[str] = None, num_loops: int = 1,
                       max_sequence_length: int = 4096, **config) -> LoopedGPTModel:
    """A ``LoopedGPTModel`` (local spec) holding HF directory ``path``'s weights.

    ``mapping``: ``"prelude,core,coda"`` (see ``LayerMapping``; its injection defaults to
    ``linear_concat`` = [I | 0]); None keeps every layer in the core. ``config``: further
    ``LoopedTransformerConfig`` fields (e.g. ``use_cpu_initialization=True``)."""
    arch = read_hf_architecture(path)
    n = arch.num_layers
    layers = LayerMapping.parse(mapping, n) if mapping else LayerMapping(0, n, 0, n)
    config.setdefault("looped_injection", "linear_concat" if mapping else "none")
    cfg = LoopedTransformerConfig(
        num_layers=layers.core, looped_num_prelude_layers=layers.prelude,
        looped_num_coda_layers=layers.coda, looped_num_loops=num_loops,
        **arch.config_kwargs(), **config)
    model = LoopedGPTModel(cfg, get_looped_gpt_block_spec(cfg),
                           max_sequence_length=max_sequence_length, **arch.model_kwargs())
    model.to(dtype=cfg.params_dtype)  # every tensor, norms too (as app.runtime.build_model)
    weights = retrofit_state_dict(load_hf_state_dict(path, arch), layers)
    load_converted_state_dict(model, weights)
    return model
