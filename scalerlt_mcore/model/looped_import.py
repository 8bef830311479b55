"""Import public looped checkpoints in their own format (``config.json`` + ``*.safetensors``).

Supported ``model_type``: ``ouro`` (Ouro / LoopLM, ``OuroForCausalLM`` remote code),
``huginn_raven`` (Huginn-0125, ``RavenForCausalLM``) and ``nanbeige`` (Nanbeige4.2,
``NanbeigeForCausalLM``; its mapping in ``nanbeige.py``). The names below are those of the public
modeling code (``modeling_ouro.py`` / ``configuration_ouro.py``; ``raven_modeling_minimal.py``
/ ``raven_config_minimal.py``); the mapping is written once as tables and read in both
directions (import here, export in ``hf_export.py``), so import -> export -> import is the
identity. A ``huginn_raven`` checkpoint with a Llama-style modeling file (Retrofitted
Recurrence) is told apart (``is_retrofitted_recurrence``) and imported with its own mapping
(``RETROFIT_BLOCK``).

Ouro (``looped_family`` ``ouro``), the whole N-layer stack looped ``total_ut_steps`` times:

    config.json                      -> looped GPT
    total_ut_steps                   -> looped_num_loops (R)
    early_exit_threshold             -> the rollouts' threshold exit (``exit_threshold``)
    num_hidden_layers                -> num_layers (core; no prelude, coda or injection)
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
    rms_norm_eps, rope_theta, rope_scaling (default / llama3), vocab_size,
    tie_word_embeddings              -> as for Llama (``hf_import.PretrainedArchitecture``)

    weights (model.layers.{i}.)      -> decoder.layers.{i}.
    input_layernorm                  -> input_layernorm
    self_attn.{q,k,v}_proj           -> self_attention.linear_qkv (packed per query group)
    self_attn.o_proj                 -> self_attention.linear_proj
    input_layernorm_2                -> self_attention.post_layernorm (sandwich norm)
    post_attention_layernorm         -> pre_mlp_layernorm
    mlp.{gate,up}_proj               -> mlp.linear_fc1 ([gate; up])
    mlp.down_proj                    -> mlp.linear_fc2
    post_attention_layernorm_2       -> mlp.post_layernorm (sandwich norm)
    model.embed_tokens               -> embedding.word_embeddings
    model.norm                       -> decoder.final_layernorm (closes every loop)
    model.early_exit_gate (+ bias)   -> decoder.exit_gate.linear (looped_exit_gate)
    lm_head (untied only)            -> output_layer

Huginn (``looped_family`` ``huginn``): prelude / core / coda, the adapter on [state; prelude
output], the recurrent state starting from ``looped_initial_state`` ``random`` (the public code
draws it at random on every forward; here a documented deterministic draw of (seed, step),
``LoopedGPTModel.set_initial_state_draw``) or ``zeros``:

    config.json                      -> looped GPT
    mean_recurrence                  -> looped_num_loops (R)
    mean_backprop_depth              -> ``LoopedSource.backprop_loops`` (looped_backprop_loops)
    n_layers_in_prelude / _recurrent_block / _coda -> prelude / num_layers (core) / coda
    n_embd, n_heads (K/V heads = heads), intermediate_size, norm_eps, rope_base (interleaved
    RoPE), vocab_size, tie_embeddings, block_size -> the layer shapes, RoPE, max positions
    (embedding scale sqrt(n_embd): Huginn's ``init_values["embed_scale"]``)

    weights (transformer.)           -> decoder. / embedding. / output_layer
    wte, ln_f, adapter               -> embedding.word_embeddings, decoder.final_layernorm,
                                        decoder.injection ([H, 2H], state first)
    {prelude,core_block,coda}.{i}.   -> decoder.{prelude,layers,coda}.{i}.
      norm_1, attn.Wqkv ([q; k; v]), attn.qk_bias, attn.proj -> input_layernorm,
        self_attention.linear_qkv (packed per head), self_attention.qk_bias, .linear_proj
      norm_2 (after the attention's residual add) -> post_attn_residual_layernorm
      norm_3, mlp.fc ([gate; up]), mlp.proj -> pre_mlp_layernorm, mlp.linear_fc1, .linear_fc2
      norm_4 (after the MLP's residual add) -> post_mlp_residual_layernorm
    lm_head (untied only)            -> output_layer;  freqs_cis (a RoPE buffer): not read

Refused, naming the field: other activations, sliding-window layers, RoPE scaling other than
llama3 with MCore's fixed factors, a fixed ``early_exit_step``, a partial rotary factor; for
Huginn: an adapter bias, no qk bias, test-time noise, fewer K/V heads than query heads, a block,
MLP, norm or injection class other than the public one, inconsistent layer counts; a
Retrofitted Recurrence checkpoint of the OLMo-2 layout (``raven_modeling_minimal_olmo``). Every
importer refuses a checkpoint tensor it does not read, naming it (a weight it would drop).
"""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .config import LoopedTransformerConfig
from .hf_import import (
    PretrainedArchitecture,
    SafetensorsReader,
    llama_like_architecture,
    llama_shapes,
    llama_to_mcore,
    mcore_to_llama,
    pack_qkv,
    query_groups,
    read_hf_config,
    required_int,
    rope_parameters,
    rope_scaling,
    unpack_qkv,
)
from .looped_gpt import LoopedGPTModel
from .nanbeige import nanbeige_source_fields, nanbeige_to_looped, read_nanbeige_tensors
from .retrofit import load_converted_state_dict
from .specs import get_looped_gpt_block_spec

LOOPED_MODEL_TYPES = ("ouro", "huginn_raven", "nanbeige")
"""``model_type`` values this importer reads."""

OURO_ARCHITECTURE = "OuroForCausalLM"

OURO_TOP = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
            "model.norm.weight": "decoder.final_layernorm.weight",
            "model.early_exit_gate.weight": "decoder.exit_gate.linear.weight",
            "model.early_exit_gate.bias": "decoder.exit_gate.linear.bias"}
"""Ouro tensor -> looped-GPT tensor, outside the layers (``lm_head`` when untied)."""

OURO_LAYER = {"input_layernorm.weight": "input_layernorm.weight",
              "input_layernorm_2.weight": "self_attention.post_layernorm.weight",
              "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
              "post_attention_layernorm_2.weight": "mlp.post_layernorm.weight",
              "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
              "mlp.down_proj.weight": "mlp.linear_fc2.weight"}
"""Per layer, the one-to-one tensors (``model.layers.{i}.`` -> ``decoder.layers.{i}.``);
q/k/v and gate/up are packed (``pack_qkv``, ``[gate; up]``)."""


@dataclass(frozen=True)
class LoopedSource:
    """A public looped checkpoint's structure: the layer shapes and the loop layout."""

    model_type: str
    """``config.json``'s ``model_type``."""
    arch: PretrainedArchitecture
    """Layer shapes, RoPE, vocabulary, tying (Megatron-LM's names)."""
    num_loops: int
    """R (Ouro ``total_ut_steps``, Huginn ``mean_recurrence``)."""
    core_layers: int = 0
    """Layers of the recurrent core (Ouro: all; Huginn ``n_layers_in_recurrent_block``)."""
    max_sequence_length: Optional[int] = None
    """Positions the source was built for (Ouro ``max_position_embeddings``, Huginn
    ``block_size``)."""
    exit_threshold: Optional[float] = None
    """Exit CDF threshold of the threshold exit (Ouro ``early_exit_threshold``)."""
    backprop_loops: int = 0
    """Loops that build a graph in the source's training (Huginn ``mean_backprop_depth``)."""
    layout: str = ""
    """``retrofitted`` for a Retrofitted Recurrence ``huginn_raven`` checkpoint, else empty."""
    looped: dict = field(default_factory=dict)
    """The ``LoopedTransformerConfig`` ``looped_*`` fields the source fixes."""

    def config(self, num_loops: Optional[int] = None, **extra) -> LoopedTransformerConfig:
        """The looped GPT config of this source (``num_loops`` overrides R; ``extra``: further
        fields, e.g. ``looped_initial_state="zeros"`` over Huginn's drawn state)."""
        return LoopedTransformerConfig(**{
            "num_layers": self.core_layers or self.arch.num_layers,
            "looped_num_loops": num_loops or self.num_loops,
            **self.looped, **self.arch.config_kwargs(), **extra})


# ---- config.json ---------------------------------------------------------------------------


def is_looped_source(path) -> bool:
    """True when directory ``path`` holds a config.json of a supported looped ``model_type``."""
    file = Path(path) / "config.json"
    return file.is_file() and read_hf_config(path).get("model_type") in LOOPED_MODEL_TYPES


def read_looped_source(path) -> LoopedSource:
    """The structure of looped checkpoint ``path``; an unsupported option raises, naming it."""
    cfg = read_hf_config(path)
    where = Path(path) / "config.json"
    kind = cfg.get("model_type")
    if kind not in LOOPED_MODEL_TYPES:
        raise ValueError(f"{where}: unknown model_type {kind!r}; supported looped model types: "
                         f"{', '.join(LOOPED_MODEL_TYPES)}")
    if kind == "huginn_raven":
        return _read_huginn(cfg, where)
    if kind == "nanbeige":  # model/nanbeige.py
        return LoopedSource(**nanbeige_source_fields(cfg, where))
    return _read_ouro(cfg, where)


def _read_ouro(cfg: dict, where: Path) -> LoopedSource:
    _reject(cfg, where, {
        "hidden_act": (cfg.get("hidden_act", "silu") == "silu", "only 'silu' (SwiGLU)"),
        "use_sliding_window": (not cfg.get("use_sliding_window", False),
                               "sliding-window attention is not supported"),
        "layer_types": (set(cfg.get("layer_types") or ["full_attention"]) == {"full_attention"},
                        "only full_attention layers are supported"),
        "early_exit_step": (cfg.get("early_exit_step") is None,
                            "a fixed exit step is not mapped (pick the readout instead)"),
        "partial_rotary_factor": (rope_parameters(cfg).get("partial_rotary_factor", 1.0) == 1.0,
                                  "partial rotary embeddings are not supported"),
    })
    threshold = cfg.get("early_exit_threshold", 1.0)
    if threshold is not None and not (isinstance(threshold, (int, float))
                                      and 0 < threshold <= 1):
        raise ValueError(f"{where}: early_exit_threshold must be in (0, 1], got {threshold!r}")
    return LoopedSource(
        model_type="ouro", arch=llama_like_architecture(cfg, where, qkv_bias=False),
        num_loops=required_int(cfg, "total_ut_steps", where, default=4),
        max_sequence_length=required_int(cfg, "max_position_embeddings", where, default=32768),
        exit_threshold=None if threshold is None else float(threshold),
        looped={"looped_family": "ouro", "looped_exit_gate": True})


def _reject(cfg: dict, where: Path, checks: dict) -> None:
    for key, (ok, why) in checks.items():
        if not ok:
            value = cfg.get(key, rope_parameters(cfg).get(key))
            raise ValueError(f"{where}: {key}={value!r}: {why}")


# ---- safetensors ---------------------------------------------------------------------------


def ouro_shapes(arch: PretrainedArchitecture) -> dict:
    """Ouro tensor name -> its shape under ``arch`` (every tensor of the checkpoint): Llama's,
    the exit gate and the sandwich norms."""
    out = llama_shapes(arch, ("input_layernorm_2.weight", "post_attention_layernorm_2.weight"))
    out.update({"model.early_exit_gate.weight": (1, arch.hidden_size),
                "model.early_exit_gate.bias": (1,)})
    return out


def load_looped_state_dict(path, source: LoopedSource) -> dict:
    """Every weight of looped checkpoint ``path`` under looped-GPT names; a missing tensor or
    one whose shape config.json does not imply is refused, naming it."""
    reader = SafetensorsReader(Path(path))
    if source.layout == "retrofitted":
        hf = _read_all(reader, retrofitted_shapes(source), "the Retrofitted Recurrence importer "
                       "(Llama layout: pre-norm blocks, no q/k norms)")
        return retrofitted_to_looped(hf, source)
    if source.model_type == "huginn_raven":
        hf = _read_all(reader, huginn_shapes(source), "the Huginn importer", ("freqs_cis",))
        return huginn_to_looped(hf, source)
    if source.model_type == "nanbeige":
        return nanbeige_to_looped(read_nanbeige_tensors(reader, source.arch), source.arch)
    hf = _read_all(reader, ouro_shapes(source.arch), "the Ouro importer")
    return ouro_to_looped(hf, source.arch)


def _read_all(reader: SafetensorsReader, shapes: dict, importer: str, buffers=()) -> dict:
    """Every tensor of ``shapes`` (name -> shape); a tensor of the checkpoint outside it (but
    for the ``buffers`` name endings) is refused, naming it and ``importer``."""
    hf = {name: reader.get(name, shape) for name, shape in shapes.items()}
    reader.refuse_unread(importer, buffers)
    return hf


def ouro_to_looped(hf: dict, arch: PretrainedArchitecture) -> dict:
    """Ouro-named tensors -> looped-GPT-named tensors (the tables above)."""
    return llama_to_mcore(hf, arch, OURO_TOP, OURO_LAYER)


def looped_to_ouro(sd: dict, arch: PretrainedArchitecture) -> dict:
    """The inverse of ``ouro_to_looped``: a looped-GPT state dict -> Ouro-named tensors."""
    return mcore_to_llama(sd, arch, OURO_TOP, OURO_LAYER)


# ---- Huginn (huginn_raven, raven_modeling_minimal.py) ---------------------------------------

HUGINN_ARCHITECTURE = "RavenForCausalLM"

HUGINN_TOP = {"transformer.wte.weight": "embedding.word_embeddings.weight",
              "transformer.ln_f.weight": "decoder.final_layernorm.weight",
              "transformer.adapter.weight": "decoder.injection.weight"}
"""Huginn tensor -> looped-GPT tensor, outside the blocks (``lm_head`` when untied)."""

HUGINN_BLOCK = {"norm_1.weight": "input_layernorm.weight",
                "attn.qk_bias": "self_attention.qk_bias",
                "attn.proj.weight": "self_attention.linear_proj.weight",
                "norm_2.weight": "post_attn_residual_layernorm.weight",
                "norm_3.weight": "pre_mlp_layernorm.weight",
                "mlp.fc.weight": "mlp.linear_fc1.weight",
                "mlp.proj.weight": "mlp.linear_fc2.weight",
                "norm_4.weight": "post_mlp_residual_layernorm.weight"}
"""Per block, the one-to-one tensors; ``attn.Wqkv`` ([q; k; v]) is packed per head."""

HUGINN_STACKS = {"prelude": "prelude", "core_block": "layers", "coda": "coda"}
"""``transformer.<stack>.{i}`` -> ``decoder.<stack>.{i}``."""

HUGINN_FIXED = {"injection_type": "linear", "block_class_name": "SandwichBlock",
                "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "bias": False,
                "qk_bias": True, "test_time_noise": 0}
"""config.json fields the mapping needs at these values (absent: the public default)."""


def is_retrofitted_recurrence(cfg: dict) -> bool:
    """A ``huginn_raven`` config.json of Retrofitted Recurrence (a Llama-style modeling file:
    pre-norm blocks, GQA, Llama RoPE, no embedding scale): its ``auto_map`` names a Llama-style
    module, or its ``init_values`` set ``embed_scale`` 1 (Huginn's is sqrt(n_embd))."""
    auto = " ".join(str(v) for v in (cfg.get("auto_map") or {}).values())
    scale = (cfg.get("init_values") or {}).get("embed_scale")
    return "llama" in auto.lower() or scale == 1.0


def _read_huginn(cfg: dict, where: Path) -> LoopedSource:
    modeling = (cfg.get("auto_map") or {}).get("AutoModelForCausalLM", "")
    if "olmo" in str(modeling).lower():
        raise ValueError(f"{where}: auto_map.AutoModelForCausalLM={modeling!r}: the Retrofitted "
                         f"Recurrence OLMo-2 layout (post-norm blocks, attn.q_norm / "
                         f"attn.k_norm) is not supported; only its Llama layout is")
    if is_retrofitted_recurrence(cfg):
        return _read_retrofitted(cfg, where)
    scale = (cfg.get("init_values") or {}).get("embed_scale")
    if scale is not None and not math.isclose(scale, math.sqrt(cfg.get("n_embd", 0)),
                                              rel_tol=1e-12):
        raise ValueError(f"{where}: init_values.embed_scale={scale!r}: only sqrt(n_embd) (or 1, "
                         f"Retrofitted Recurrence) is supported")
    for key, value in HUGINN_FIXED.items():
        if cfg.get(key, value) != value:
            raise ValueError(f"{where}: {key}={cfg[key]!r}: only {value!r} is supported")
    if not str(cfg.get("norm_class_name", "RMSNorm")).startswith("RMSNorm"):
        raise ValueError(f"{where}: norm_class_name={cfg['norm_class_name']!r}: only RMSNorm")
    hidden, heads = (required_int(cfg, k, where) for k in ("n_embd", "n_heads"))
    if cfg.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"{where}: num_key_value_heads={cfg['num_key_value_heads']!r}: Huginn's "
                         f"qk bias needs one K/V head per query head ({heads})")
    prelude, core, coda = (required_int(cfg, f"n_layers_in_{k}", where, default=d) for k, d in
                           (("prelude", 2), ("recurrent_block", 4), ("coda", 2)))
    if cfg.get("n_layers", prelude + core + coda) != prelude + core + coda:
        raise ValueError(f"{where}: n_layers={cfg['n_layers']!r} != n_layers_in_prelude + "
                         f"n_layers_in_recurrent_block + n_layers_in_coda = "
                         f"{prelude + core + coda}")
    arch = PretrainedArchitecture(
        num_layers=prelude + core + coda, hidden_size=hidden,
        ffn_hidden_size=required_int(cfg, "intermediate_size", where), num_attention_heads=heads,
        num_query_groups=heads, kv_channels=hidden // heads,
        vocab_size=required_int(cfg, "vocab_size", where),
        norm_epsilon=float(cfg.get("norm_eps", 1e-6)),
        rotary_base=float(cfg.get("rope_base", 50000.0)), use_rope_scaling=False,
        rope_scaling_factor=8.0, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not cfg.get("tie_embeddings", True))
    return LoopedSource(
        model_type="huginn_raven", arch=arch,
        num_loops=required_int(cfg, "mean_recurrence", where, default=32), core_layers=core,
        max_sequence_length=required_int(cfg, "block_size", where, default=4096),
        looped={"looped_family": "huginn", "looped_num_prelude_layers": prelude,
                "looped_num_coda_layers": coda, "looped_injection": "linear_concat",
                **initial_state_fields(cfg, where)},
        backprop_loops=int(cfg.get("mean_backprop_depth", 0)))


def _huginn_stacks(source: LoopedSource) -> dict:
    """``transformer.<stack>`` -> (``decoder.<stack>``, its block count)."""
    counts = {"prelude": source.looped["looped_num_prelude_layers"],
              "core_block": source.core_layers,
              "coda": source.looped["looped_num_coda_layers"]}
    return {theirs: (HUGINN_STACKS[theirs], n) for theirs, n in counts.items()}


def huginn_freqs_cis(arch: PretrainedArchitecture, length: int) -> torch.Tensor:
    """The public model's persistent RoPE buffer ``freqs_cis`` [1, length, 1, hd / 2, 2] (cos,
    sin in fp32; ``precompute_freqs_cis``): not a weight, written back on export."""
    dim = arch.kv_channels
    even = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu")
    inv = 1.0 / (arch.rotary_base ** (even / dim))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32, device="cpu"), inv)
    return torch.stack([freqs.cos()[None, :, None], freqs.sin()[None, :, None]], dim=4)


def huginn_shapes(source: LoopedSource) -> dict:
    """Huginn tensor name -> its shape (every weight; ``freqs_cis`` is not read)."""
    a = source.arch
    h, f, v, hd, n = a.hidden_size, a.ffn_hidden_size, a.vocab_size, a.kv_channels, \
        a.num_attention_heads
    out = {"transformer.wte.weight": (v, h), "transformer.ln_f.weight": (h,),
           "transformer.adapter.weight": (h, 2 * h)}
    if a.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = (v, h)
    block = {"norm_1.weight": (h,), "attn.Wqkv.weight": (3 * h, h),
             "attn.qk_bias": (2, 1, n, hd), "attn.proj.weight": (h, h), "norm_2.weight": (h,),
             "norm_3.weight": (h,), "mlp.fc.weight": (2 * f, h), "mlp.proj.weight": (h, f),
             "norm_4.weight": (h,)}
    for stack, (_, count) in _huginn_stacks(source).items():
        for i in range(count):
            out.update({f"transformer.{stack}.{i}.{k}": s for k, s in block.items()})
    return out


def _stacks_to_looped(hf: dict, source: LoopedSource, block: dict) -> dict:
    """Tensors named as Huginn names them (``HUGINN_TOP``; per layer of each stack ``block``'s
    one-to-one tensors and ``attn.Wqkv``, split into q, k, v) -> looped-GPT-named tensors: the
    import of Huginn and of Retrofitted Recurrence, which differ in ``block``."""
    arch = source.arch
    q, kv = arch.num_attention_heads * arch.kv_channels, arch.num_query_groups * arch.kv_channels
    out = {ours: hf[theirs] for theirs, ours in HUGINN_TOP.items()}
    if arch.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for stack, (ours_stack, count) in _huginn_stacks(source).items():
        for i in range(count):
            src, dst = f"transformer.{stack}.{i}.", f"decoder.{ours_stack}.{i}."
            out.update({dst + o: hf[src + t] for t, o in block.items()})
            parts = hf[src + "attn.Wqkv.weight"].split([q, kv, kv])
            out[dst + "self_attention.linear_qkv.weight"] = pack_qkv(*parts, arch)
    return out


def _looped_to_stacks(sd: dict, source: LoopedSource, block: dict) -> dict:
    """The inverse of ``_stacks_to_looped``."""
    arch = source.arch
    out = {theirs: sd[ours] for theirs, ours in HUGINN_TOP.items()}
    if arch.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for stack, (ours_stack, count) in _huginn_stacks(source).items():
        for i in range(count):
            dst, src = f"transformer.{stack}.{i}.", f"decoder.{ours_stack}.{i}."
            out.update({dst + t: sd[src + o] for t, o in block.items()})
            out[dst + "attn.Wqkv.weight"] = torch.cat(
                unpack_qkv(sd[src + "self_attention.linear_qkv.weight"], arch))
    return out


def huginn_to_looped(hf: dict, source: LoopedSource) -> dict:
    """Huginn-named tensors -> looped-GPT-named tensors (the tables above)."""
    return _stacks_to_looped(hf, source, HUGINN_BLOCK)


def looped_to_huginn(sd: dict, source: LoopedSource) -> dict:
    """The inverse of ``huginn_to_looped`` (plus the ``freqs_cis`` buffer)."""
    out = _looped_to_stacks(sd, source, HUGINN_BLOCK)
    out["freqs_cis"] = huginn_freqs_cis(source.arch, source.max_sequence_length or 4096)
    return out


# ---- Retrofitted Recurrence (huginn_raven, raven_modeling_minimal_llama.py) ----------------

RETROFIT_BLOCK = {"norm_1.weight": "input_layernorm.weight",
                  "attn.proj.weight": "self_attention.linear_proj.weight",
                  "norm_2.weight": "pre_mlp_layernorm.weight",
                  "mlp.fc.weight": "mlp.linear_fc1.weight",
                  "mlp.proj.weight": "mlp.linear_fc2.weight"}
"""Per pre-norm block, the one-to-one tensors (MCore's own layer); ``attn.Wqkv`` is packed per
query group."""


def _read_retrofitted(cfg: dict, where: Path) -> LoopedSource:
    for key, value in {"bias": False, "qk_bias": False, "test_time_noise": 0,
                       "injection_type": "linear"}.items():
        if cfg.get(key, value) != value:
            raise ValueError(f"{where}: {key}={cfg[key]!r}: only {value!r} is supported for "
                             f"Retrofitted Recurrence")
    hidden, heads = (required_int(cfg, k, where) for k in ("n_embd", "n_heads"))
    prelude, core, coda = (required_int(cfg, f"n_layers_in_{k}", where) for k in
                           ("prelude", "recurrent_block", "coda"))
    scaling, factor = rope_scaling(cfg, where)
    arch = PretrainedArchitecture(
        num_layers=prelude + core + coda, hidden_size=hidden,
        ffn_hidden_size=required_int(cfg, "intermediate_size", where), num_attention_heads=heads,
        num_query_groups=query_groups(cfg, heads, where, "n_heads"),
        kv_channels=cfg.get("head_dim") or hidden // heads,
        vocab_size=required_int(cfg, "vocab_size", where),
        norm_epsilon=float(cfg.get("norm_eps", 1e-5)),
        rotary_base=float(rope_parameters(cfg).get("rope_theta", cfg.get("rope_base", 10000.0))),
        use_rope_scaling=scaling, rope_scaling_factor=factor, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not cfg.get("tie_embeddings", False))
    return LoopedSource(
        model_type="huginn_raven", arch=arch,
        num_loops=required_int(cfg, "mean_recurrence", where, default=32), core_layers=core,
        max_sequence_length=cfg.get("max_position_embeddings") or cfg.get("block_size"),
        looped={"looped_num_prelude_layers": prelude, "looped_num_coda_layers": coda,
                "looped_injection": "linear_concat", **initial_state_fields(cfg, where)},
        backprop_loops=int(cfg.get("mean_backprop_depth", 0)), layout="retrofitted")


def initial_state_fields(cfg: dict, where: Path) -> dict:
    """The ``looped_initial_state*`` fields of a ``huginn_raven`` config.json: its
    ``init_values.std`` (absent: Huginn's sqrt(2 / (5 n_embd))) as the drawn state's std, or the
    zero state for std 0 (the public ``initialize_state`` zeroes it then)."""
    std = (cfg.get("init_values") or {}).get("std")
    if std is None:
        return {"looped_initial_state": "random"}
    if not isinstance(std, (int, float)) or std < 0:
        raise ValueError(f"{where}: init_values.std must be a number >= 0, got {std!r}")
    if std == 0:
        return {"looped_initial_state": "zeros"}
    return {"looped_initial_state": "random", "looped_initial_state_std": float(std)}


def retrofitted_shapes(source: LoopedSource) -> dict:
    """Retrofitted Recurrence tensor name -> its shape (every weight)."""
    a = source.arch
    h, f, v = a.hidden_size, a.ffn_hidden_size, a.vocab_size
    q, kv = a.num_attention_heads * a.kv_channels, a.num_query_groups * a.kv_channels
    out = {"transformer.wte.weight": (v, h), "transformer.ln_f.weight": (h,),
           "transformer.adapter.weight": (h, 2 * h)}
    if a.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = (v, h)
    block = {"norm_1.weight": (h,), "attn.Wqkv.weight": (q + 2 * kv, h),
             "attn.proj.weight": (h, q), "norm_2.weight": (h,), "mlp.fc.weight": (2 * f, h),
             "mlp.proj.weight": (h, f)}
    for stack, (_, count) in _huginn_stacks(source).items():
        for i in range(count):
            out.update({f"transformer.{stack}.{i}.{k}": s for k, s in block.items()})
    return out


def retrofitted_to_looped(hf: dict, source: LoopedSource) -> dict:
    """Retrofitted-Recurrence-named tensors -> looped-GPT-named tensors."""
    return _stacks_to_looped(hf, source, RETROFIT_BLOCK)


def looped_to_retrofitted(sd: dict, source: LoopedSource) -> dict:
    """The inverse of ``retrofitted_to_looped``."""
    return _looped_to_stacks(sd, source, RETROFIT_BLOCK)


# ---- one call ------------------------------------------------------------------------------


def looped_gpt_from_pretrained(path, num_loops: Optional[int] = None,
                               max_sequence_length: Optional[int] = None,
                               **config) -> LoopedGPTModel:
    """A ``LoopedGPTModel`` (local spec) holding looped checkpoint ``path``'s weights.

    ``num_loops``: R (default: the checkpoint's own); ``max_sequence_length``: default the
    checkpoint's; ``config``: further ``LoopedTransformerConfig`` fields (e.g.
    ``use_cpu_initialization=True``, ``looped_initial_state="zeros"``)."""
    source = read_looped_source(path)
    cfg = source.config(num_loops, **config)
    length = max_sequence_length or source.max_sequence_length or 4096
    model = LoopedGPTModel(cfg, get_looped_gpt_block_spec(cfg), max_sequence_length=length,
                           **source.arch.model_kwargs())
    model.to(dtype=cfg.params_dtype)  # every tensor, norms too (as app.runtime.build_model)
    load_converted_state_dict(model, load_looped_state_dict(path, source))
    return model
