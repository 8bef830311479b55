"""Write a looped GPT back in a public format: ``config.json`` + ``model.safetensors`` (+ the
tokenizer and remote-code files of the source directory, when given).

Formats (``export_format`` picks one, or refuses saying why):

- ``ouro`` (``OuroForCausalLM``): a ``looped_family`` ``ouro`` model, R written as
  ``total_ut_steps``; names from ``looped_import`` (its tables read backwards);
- ``huginn_raven`` (``RavenForCausalLM``): a ``looped_family`` ``huginn`` model, R written as
  ``mean_recurrence``, with the public model's ``freqs_cis`` buffer;
- ``nanbeige`` (``NanbeigeForCausalLM``): a ``looped_family`` ``nanbeige`` model, R written as
  ``num_loops``; names from ``nanbeige`` (its tables read backwards);
- ``llama`` / ``qwen2``: a plain model -- R = 1, no prelude, coda, injection or exit gate --
  is the same function as the Llama / Qwen2 it would be imported from (``hf_import``), Qwen2
  when it has QKV biases (or its source says so).

A retrofitted model (prelude / core / coda, injection, R > 1) is refused: it is not the
function of any plain Llama / Qwen2, and the Retrofitted Recurrence ``huginn_raven`` layout
is not written. Every tensor is written in one dtype, the model's weights' (config.json's
``torch_dtype``), so import -> export -> import is bitwise.
"""

import json
import shutil
from pathlib import Path
from typing import Optional

import torch

from .hf_import import (
    MCORE_LLAMA3_SCALING,
    PretrainedArchitecture,
    mcore_to_llama,
    read_hf_config,
)
from .looped_import import (
    HUGINN_ARCHITECTURE,
    OURO_ARCHITECTURE,
    LoopedSource,
    looped_to_huginn,
    looped_to_ouro,
    looped_to_retrofitted,
)
from .nanbeige import NANBEIGE_ARCHITECTURE, looped_to_nanbeige, nanbeige_config_fields
from .shards import whole_state_dict

ARCHITECTURES = {"ouro": OURO_ARCHITECTURE, "huginn_raven": HUGINN_ARCHITECTURE,
                 "retrofitted": HUGINN_ARCHITECTURE, "llama": "LlamaForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "nanbeige": NANBEIGE_ARCHITECTURE}
"""Export format -> the ``architectures`` name written."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")
"""Files copied from the source directory when present."""


class ExportError(ValueError):
    """A model that cannot be written in the asked format; the message says why."""


def architecture_of(model) -> PretrainedArchitecture:
    """The layer shapes, RoPE and tying of a built ``LoopedGPTModel`` (HF terms)."""
    c, rope = model.config, model.rope_settings
    return PretrainedArchitecture(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_query_groups or c.num_attention_heads,
        kv_channels=c.kv_channels, vocab_size=model.vocab_size,
        norm_epsilon=c.layernorm_epsilon, rotary_base=float(rope["rotary_base"]),
        use_rope_scaling=bool(rope["rope_scaling"]),
        rope_scaling_factor=float(rope["rope_scaling_factor"]), add_qkv_bias=c.add_qkv_bias,
        untie_embeddings_and_output_weights=not model.share_embeddings_and_output_weights)


# ---- which format ---------------------------------------------------------------------------


def export_format(model, source_config: Optional[dict] = None) -> str:
    """``ouro``, ``huginn_raven``, ``nanbeige``, ``llama`` or ``qwen2`` for ``model``
    (``source_config``: the config.json it was imported from, which decides between Llama and
    Qwen2); otherwise ``ExportError``."""
    c = model.config
    _check_layers(model)
    if c.looped_family != "gpt":
        return {"ouro": "ouro", "huginn": "huginn_raven",
                "nanbeige": "nanbeige"}[c.looped_family]
    if c.looped_injection == "linear_concat" and not c.looped_exit_gate:
        return _retrofitted_format(c)
    looped = [f"{name}={value!r}" for name, value, plain in (
        ("looped_num_loops", c.looped_num_loops, 1),
        ("looped_num_prelude_layers", c.looped_num_prelude_layers, 0),
        ("looped_num_coda_layers", c.looped_num_coda_layers, 0),
        ("looped_injection", c.looped_injection, "none"),
        ("looped_exit_gate", c.looped_exit_gate, False)) if value != plain]
    if looped:
        raise ExportError(
            f"cannot export as plain Llama / Qwen2: {', '.join(looped)} is not the function of "
            f"any plain transformer (export needs looped_num_loops 1 without prelude, coda, "
            f"injection or exit gate; looped_injection linear_concat for the Retrofitted "
            f"Recurrence layout; or looped_family ouro / huginn)")
    named = (source_config or {}).get("architectures") or []
    kind = "qwen2" if named == ["Qwen2ForCausalLM"] or (not named and c.add_qkv_bias) else "llama"
    if (kind == "qwen2") != bool(c.add_qkv_bias):
        raise ExportError(f"cannot export as {ARCHITECTURES[kind]}: add_qkv_bias={c.add_qkv_bias}"
                          f" (Qwen2 has QKV biases, Llama none)")
    return kind


def _retrofitted_format(c) -> str:
    """The Retrofitted Recurrence ``huginn_raven`` layout (pre-norm blocks, adapter on
    [state; prelude output]), whose state starts random (or at zero: ``init_values.std`` 0)."""
    if c.looped_initial_state == "embed":
        raise ExportError("cannot export looped_initial_state 'embed' in the Retrofitted "
                          "Recurrence huginn_raven layout: its recurrent state starts random "
                          "(or zero), never at the prelude output (retrofit with "
                          "--looped-initial-state random or zeros to export)")
    if c.add_qkv_bias:
        raise ExportError("cannot export add_qkv_bias=True in the Retrofitted Recurrence layout "
                          "(its attention has no QKV biases)")
    return "retrofitted"


def _check_layers(model) -> None:
    c = model.config
    checks = {"normalization": (c.normalization == "RMSNorm", "RMSNorm"),
              "gated_linear_unit": (bool(c.gated_linear_unit), "SwiGLU"),
              "activation_func": (c.activation_func is torch.nn.functional.silu, "silu"),
              "add_bias_linear": (not c.add_bias_linear, "no linear biases"),
              "position_embedding_type": (model.position_embedding_type == "rope", "rope"),
              "rotary_percent": (model.rope_settings["rotary_percent"] == 1.0, "1.0"),
              "looped_learned_loop_weights": (not c.looped_learned_loop_weights,
                                              "none: learned loop credit has no place in the "
                                              "format")}
    for key, (ok, need) in checks.items():
        if not ok:
            raise ExportError(f"cannot export {key}={getattr(c, key, None)!r}: the format "
                              f"needs {need}")


# ---- tensors --------------------------------------------------------------------------------


def hf_state_dict(model, kind: str) -> dict:
    """The model's tensors, whole at any tensor-parallel size (``whole_state_dict``: every rank
    calls it), under the names of format ``kind``; every tensor of the model is used (one left
    over is refused, naming it)."""
    sd = _ReadTracker(whole_state_dict(model))
    arch = architecture_of(model)
    if kind == "ouro":
        out = looped_to_ouro(sd, arch)
    elif kind == "nanbeige":
        out = looped_to_nanbeige(sd, arch)
    elif kind == "huginn_raven":
        out = looped_to_huginn(sd, huginn_source(model))
    elif kind == "retrofitted":
        out = looped_to_retrofitted(sd, huginn_source(model))
    else:
        out = mcore_to_llama(sd, arch)
    left = sorted(set(sd) - sd.read)
    if left:
        raise ExportError(f"cannot export as {ARCHITECTURES[kind]}: tensors with no place in "
                          f"the format: {', '.join(left[:4])}")
    dtype = export_dtype(model)
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in out.items()}


def export_dtype(model) -> torch.dtype:
    """The one dtype of every exported tensor and of config.json's ``torch_dtype``: the
    model's weights' (its first parameter's; a norm kept in fp32 beside bf16 weights is
    written in bf16, as the config says)."""
    return next(model.parameters()).dtype


def _dtype_name(model) -> str:
    return str(export_dtype(model)).removeprefix("torch.")


class _ReadTracker(dict):
    """A state dict that records which tensors the format's mapping read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def huginn_source(model) -> LoopedSource:
    """The Huginn structure of a ``looped_family`` huginn model (for ``looped_to_huginn``)."""
    c = model.config
    arch = architecture_of(model)
    total = c.looped_num_prelude_layers + c.num_layers + c.looped_num_coda_layers
    return LoopedSource(
        model_type="huginn_raven", arch=PretrainedArchitecture(**{**vars(arch),
                                                                  "num_layers": total}),
        num_loops=c.looped_num_loops, core_layers=c.num_layers,
        max_sequence_length=model.max_sequence_length, backprop_loops=c.looped_backprop_loops,
        looped={"looped_num_prelude_layers": c.looped_num_prelude_layers,
                "looped_num_coda_layers": c.looped_num_coda_layers})


# ---- config.json ----------------------------------------------------------------------------


def hf_config(model, kind: str, base: Optional[dict] = None,
              exit_threshold: Optional[float] = None) -> dict:
    """config.json of the export: ``base`` (the source's, unknown fields kept) with every field
    the model fixes written over it."""
    if kind in ("huginn_raven", "retrofitted"):
        return _huginn_config(model, base, kind)
    arch, c = architecture_of(model), model.config
    out = dict(base or {})
    out.update(architectures=[ARCHITECTURES[kind]], model_type=kind,
               vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
               intermediate_size=arch.ffn_hidden_size, num_hidden_layers=arch.num_layers,
               num_attention_heads=arch.num_attention_heads,
               num_key_value_heads=arch.num_query_groups, head_dim=arch.kv_channels,
               hidden_act="silu", max_position_embeddings=model.max_sequence_length,
               rms_norm_eps=arch.norm_epsilon,
               tie_word_embeddings=not arch.untie_embeddings_and_output_weights)
    out.update(_rope_fields(arch, out))
    out["torch_dtype" if "dtype" not in out else "dtype"] = _dtype_name(model)
    if kind == "ouro":
        out.update(total_ut_steps=c.looped_num_loops, use_sliding_window=False)
        if "layer_types" in out:
            out["layer_types"] = ["full_attention"] * arch.num_layers
        if exit_threshold is not None:
            out["early_exit_threshold"] = exit_threshold
    if kind == "nanbeige":
        out.update(nanbeige_config_fields(model))
    if kind == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    return out


def _huginn_config(model, base: Optional[dict], kind: str) -> dict:
    src, c = huginn_source(model), model.config
    a = src.arch
    out = dict(base or {})
    if kind == "retrofitted":
        out.update(_retrofitted_fields(model, a, out.get("init_values") or {}))
    out.update(architectures=[HUGINN_ARCHITECTURE], model_type="huginn_raven",
               n_embd=a.hidden_size, n_heads=a.num_attention_heads, n_layers=a.num_layers,
               block_size=_block_size(model, out, kind), vocab_size=a.vocab_size,
               tie_embeddings=not a.untie_embeddings_and_output_weights,
               intermediate_size=a.ffn_hidden_size, bias=False, norm_eps=a.norm_epsilon,
               n_layers_in_prelude=c.looped_num_prelude_layers,
               n_layers_in_recurrent_block=c.num_layers,
               n_layers_in_coda=c.looped_num_coda_layers, mean_recurrence=c.looped_num_loops,
               qk_bias=kind == "huginn_raven", injection_type="linear")
    if kind == "huginn_raven":
        out["rope_base"] = a.rotary_base
        if "init_values" in out or c.looped_initial_state != "random" \
                or c.looped_initial_state_std:
            std = c.looped_drawn_state_std if c.looped_initial_state == "random" else 0.0
            out["init_values"] = {**(out.get("init_values") or {}), "std": std,
                                  "embed_scale": c.looped_embedding_scale}
    if c.looped_backprop_loops or "mean_backprop_depth" not in out:
        out["mean_backprop_depth"] = c.looped_backprop_loops or c.looped_num_loops
    out["torch_dtype"] = _dtype_name(model)
    return out


def _block_size(model, base: dict, kind: str) -> int:
    """Huginn's ``block_size`` is its RoPE table's length (the model's positions); Retrofitted
    Recurrence reads ``max_position_embeddings`` instead and keeps the source's block_size."""
    if kind == "retrofitted" and "block_size" in base:
        return base["block_size"]
    return model.max_sequence_length


def _retrofitted_fields(model, a: PretrainedArchitecture, init: dict) -> dict:
    """The fields ``convert_llama.get_llama_huginn_config`` sets over Huginn's config; the
    state's std is the drawn state's (0: the zero state)."""
    random = model.config.looped_initial_state == "random"
    init = {**init, "std": model.config.looped_drawn_state_std if random else 0.0,
            "embed_scale": 1.0}
    return {"num_key_value_heads": a.num_query_groups, "head_dim": a.kv_channels,
            "max_position_embeddings": model.max_sequence_length, "init_values": init,
            **_rope_fields(a, {})}


def _rope_fields(arch: PretrainedArchitecture, cfg: dict) -> dict:
    scaling = None
    if arch.use_rope_scaling:
        scaling = {"rope_type": "llama3", "factor": arch.rope_scaling_factor,
                   **MCORE_LLAMA3_SCALING}
    if "rope_parameters" in cfg:  # transformers >= 5 layout
        return {"rope_parameters": {"rope_type": "default", **(scaling or {}),
                                    "rope_theta": arch.rotary_base}}
    return {"rope_theta": arch.rotary_base, "rope_scaling": scaling}


# ---- one call -------------------------------------------------------------------------------


def save_hf(model, out_dir, source=None, exit_threshold: Optional[float] = None,
            kind: Optional[str] = None) -> Path:
    """Write ``model`` to ``out_dir`` in its public format (``export_format``; ``kind`` forces
    one): config.json (over ``source``'s config.json when given), model.safetensors, and the
    tokenizer / remote-code files of directory ``source``. Returns ``out_dir``."""
    from safetensors.torch import save_file

    base = read_hf_config(source) if source is not None else None
    chosen = export_format(model, base)
    if kind is not None and kind != chosen:
        raise ExportError(f"cannot export as {kind!r}: this model is written as {chosen!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model, chosen)
    config = hf_config(model, chosen, base, exit_threshold)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if source is not None:
        _copy_side_files(Path(source), out, config)
    return out


def _copy_side_files(source: Path, out: Path, config: dict) -> None:
    code = {f"{ref.split('.')[0]}.py" for ref in (config.get("auto_map") or {}).values()
            if isinstance(ref, str)}
    for name in (*TOKENIZER_FILES, *sorted(code)):
        if (source / name).is_file() and source.resolve() != out.resolve():
            shutil.copyfile(source / name, out / name)
