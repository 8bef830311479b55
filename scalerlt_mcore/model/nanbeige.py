"""Nanbeige4.2 (``model_type`` "nanbeige", ``NanbeigeForCausalLM`` remote code) in its own format.

Native transformers support does not exist, so the format is what the public implementations
read (vllm-rlt ``vllm_rlt/models/nanbeige.py``, llama.cpp's converter ``NanbeigeModel`` and its
graph ``src/models/nanbeige.cpp``): Llama's tensor names and pre-norm decoder layer, the N
stored layers run ``num_loops`` times with shared weights, each loop with its own K/V (cache
slot layer + loop * N), ``model.norm`` closing every loop, the normed state feeding the next
loop and the readout. Here that is ``looped_family`` ``nanbeige``: MCore's own layer spec, the
loop layout of Ouro's normed state, no exit gate.

    config.json                      -> looped GPT
    num_loops                        -> looped_num_loops (R)
    num_hidden_layers                -> num_layers (core; no prelude, coda or injection)
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim
    (kv_channels), rms_norm_eps, rope_theta, rope_scaling, vocab_size, tie_word_embeddings
                                     -> as for Llama (``hf_import.llama_like_architecture``)
    max_position_embeddings          -> the model's maximum positions

    weights                          -> looped-GPT names as Llama's (``hf_import.llama_to_mcore``:
                                        q/k/v packed per query group, gate/up as [gate; up])

Refused, naming the key, when set: the switches of later Nanbeige variants that 4.2-3B leaves
off (``NANBEIGE_SWITCHES``: shared loop caches, hyper-connections, split loops, depth attention,
q/k norms, n-gram embeddings), ``loop_loss_weights`` (a training-time loss over loops that some
implementations read as a loop count), ``skip_loop_final_norm`` (the implementations disagree
on whether the last loop's norm stays), biases, other activations, sliding windows.
"""

from pathlib import Path

from .hf_import import (
    PretrainedArchitecture,
    llama_like_architecture,
    llama_shapes,
    llama_to_mcore,
    mcore_to_llama,
)

NANBEIGE_ARCHITECTURE = "NanbeigeForCausalLM"

NANBEIGE_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 70_000_000.0,
                     "max_position_embeddings": 262144}
"""Values of the public config class where a config.json leaves a key out (vllm-rlt's
``NanbeigeConfig``)."""

NANBEIGE_SWITCHES = ("loop_share_kv", "enable_hyper_connection", "enable_mhc",
                     "enable_double_loop_split", "enable_depth_attention", "qk_layernorm",
                     "mhc_diff_for_loop", "attention_bias", "mlp_bias")
"""Boolean keys that must be false or absent (each changes the function or adds tensors)."""

NANBEIGE_UNSET = ("loop_loss_weights", "emb_neighbor_num", "ngram_vocab_size_ratio",
                  "insert_ngram_layer_idx", "loop_middle_layers", "sliding_window")
"""Keys that must be absent, null or empty."""

# ---- config.json ----------------------------------------------------------------------------


def nanbeige_source_fields(cfg: dict, where: Path) -> dict:
    """The ``LoopedSource`` fields of a Nanbeige config.json; a key it cannot match raises,
    naming it."""
    _refuse(cfg, where)
    cfg = {**NANBEIGE_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    loops = cfg.get("num_loops")
    if not isinstance(loops, int) or isinstance(loops, bool) or loops < 1:
        raise ValueError(f"{where}: num_loops must be a positive integer, got {loops!r}")
    length = cfg["max_position_embeddings"]
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"{where}: max_position_embeddings must be a positive integer, got "
                         f"{length!r}")
    arch = llama_like_architecture(cfg, where, qkv_bias=False)
    kv = cfg.get("kv_channels")
    if kv is not None and kv != arch.kv_channels:
        raise ValueError(f"{where}: kv_channels={kv!r} != head_dim={arch.kv_channels}")
    return dict(model_type="nanbeige", arch=arch, num_loops=loops, max_sequence_length=length,
                looped={"looped_family": "nanbeige"})


def _refuse(cfg: dict, where: Path) -> None:
    for key in NANBEIGE_SWITCHES:
        if cfg.get(key):
            raise ValueError(f"{where}: {key}={cfg[key]!r}: Nanbeige's {key} is not supported "
                             f"(4.2-3B leaves it off)")
    for key in NANBEIGE_UNSET:
        if cfg.get(key) not in (None, [], {}):
            raise ValueError(f"{where}: {key}={cfg[key]!r}: not supported (4.2-3B leaves it "
                             f"unset)")
    checks = {
        "skip_loop_final_norm": (not cfg.get("skip_loop_final_norm", False),
                                 "only the norm closing every loop (false) is supported"),
        "hidden_act": (cfg.get("hidden_act", "silu") == "silu", "only 'silu' (SwiGLU)"),
        "pretraining_tp": (cfg.get("pretraining_tp", 1) == 1, "only 1 is supported"),
        "layer_types": (set(cfg.get("layer_types") or ["full_attention"]) == {"full_attention"},
                        "only full_attention layers are supported"),
        "architectures": (cfg.get("architectures", [NANBEIGE_ARCHITECTURE])
                          == [NANBEIGE_ARCHITECTURE], f"only [{NANBEIGE_ARCHITECTURE!r}]"),
    }
    for key, (ok, why) in checks.items():
        if not ok:
            raise ValueError(f"{where}: {key}={cfg[key]!r}: {why}")


# ---- safetensors ----------------------------------------------------------------------------


def read_nanbeige_tensors(reader, arch: PretrainedArchitecture) -> dict:
    """Every tensor of the checkpoint behind ``reader`` (a ``SafetensorsReader``), each checked
    against ``llama_shapes``; a tensor the mapping does not read is refused, naming it."""
    shapes = llama_shapes(arch)
    extra = sorted(set(reader.where) - set(shapes))
    if extra:
        raise ValueError(f"tensor {extra[0]!r} in {reader.where[extra[0]]} is not part of the "
                         f"Nanbeige layout config.json describes ({len(extra)} such tensors)")
    return {name: reader.get(name, shape) for name, shape in shapes.items()}


def nanbeige_to_looped(hf: dict, arch: PretrainedArchitecture) -> dict:
    """Nanbeige-named tensors (Llama's names) -> looped-GPT-named tensors."""
    return llama_to_mcore(hf, arch)


def looped_to_nanbeige(sd: dict, arch: PretrainedArchitecture) -> dict:
    """The inverse of ``nanbeige_to_looped``: a looped-GPT state dict -> Nanbeige names."""
    return mcore_to_llama(sd, arch)


def nanbeige_config_fields(model) -> dict:
    """The Nanbeige keys of an export's config.json besides Llama's: R as ``num_loops``, the
    head size also as ``kv_channels``, and the off switches as the public config.json writes
    them."""
    return {"num_loops": model.config.looped_num_loops, "kv_channels": model.config.kv_channels,
            "loop_loss_weights": [], "skip_loop_final_norm": False, "attention_bias": False,
            "pretraining_tp": 1}
