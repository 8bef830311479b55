"""Specs of the looped GPT, one function per backend (MCore style).

Layer specs: MCore's GPT layer spec for that backend with the self-attention swapped for
``LoopedSelfAttention`` (same parameters) and the core attention for ``LoopedCoreAttention``.
Block spec: ``get_looped_gpt_block_spec`` names every part of the recurrent block
(``LoopedBlockSubmodules``: prelude / core / coda layer specs, injection, final norm).
"""

import copy
import dataclasses
import functools
from typing import Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from .attention import LoopedCoreAttention, LoopedSelfAttention
from .block import (
    ExitGate,
    LearnedLoopWeights,
    LinearConcatInjection,
    LoopedBlockSubmodules,
    RecurrentTransformerBlock,
)
from .layer import LoopedMLP, LoopedTransformerLayer
from .linear import DIRECT
from .sandwich import (
    QKBiasSelfAttention,
    ResidualNormLayerSubmodules,
    ResidualNormTransformerLayer,
    SandwichMLP,
    SandwichMLPSubmodules,
    SandwichSelfAttention,
    SandwichSelfAttentionSubmodules,
)

try:
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:  # CPU hosts: Transformer Engine is a GPU-only extra
    HAVE_TE = False


def _looped(spec: ModuleSpec) -> ModuleSpec:
    spec = _direct_linears(copy.deepcopy(spec))
    if spec.module is TransformerLayer:
        spec.module = LoopedTransformerLayer
    spec.submodules.mlp = _mlp_entry(spec.submodules.mlp, MLP, LoopedMLP) or spec.submodules.mlp
    attention = spec.submodules.self_attention
    attention.module = LoopedSelfAttention
    attention.submodules.core_attention = LoopedCoreAttention
    return spec


def _direct_linears(spec):
    """``spec`` with MCore's ``ColumnParallelLinear`` / ``RowParallelLinear`` swapped for their
    subclasses in ``linear.py`` (a direct forward without a recorded graph), wherever they
    appear: in ``ModuleSpec`` submodules or in the keywords of a ``functools.partial`` (the
    MLP entry of MCore 0.19's layer specs). Other modules (Transformer Engine's) stay."""
    if isinstance(spec, type):
        return DIRECT.get(spec, spec)
    if isinstance(spec, functools.partial):
        keywords = {k: _direct_linears(v) for k, v in spec.keywords.items()}
        return functools.partial(spec.func, *spec.args, **keywords)
    if isinstance(spec, ModuleSpec):
        spec.module = _direct_linears(spec.module)
        spec.submodules = _direct_linears(spec.submodules)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, _direct_linears(getattr(spec, f.name)))
    return spec


def get_looped_gpt_layer_local_spec(qk_layernorm: bool = False,
                                    normalization: str = "LayerNorm") -> ModuleSpec:
    """Local (PyTorch / MCore) backend: runs on CPU and GPU."""
    return _looped(get_gpt_layer_local_spec(qk_layernorm=qk_layernorm,
                                            normalization=normalization))


def get_looped_sandwich_layer_local_spec(normalization: str = "RMSNorm") -> ModuleSpec:
    """Local backend, sandwich norms (``looped_family`` ``ouro``): the looped layer spec with
    a norm after the attention and after the MLP, each before its residual add."""
    spec = get_looped_gpt_layer_local_spec(normalization=normalization)
    norm = LocalSpecProvider().layer_norm(rms_norm=normalization == "RMSNorm", for_qk=False)
    attention = spec.submodules.self_attention
    attention.module = SandwichSelfAttention
    attention.submodules = SandwichSelfAttentionSubmodules(
        **vars(attention.submodules), post_layernorm=norm)
    spec.submodules.mlp = _sandwich_mlp(spec.submodules.mlp, norm)
    return spec


def _mlp_entry(mlp, old: type, new: type, submodules=None):
    """MCore's MLP entry of a layer spec, in the form the installed MCore holds, with ``new``
    for ``old`` and its submodules through ``submodules`` (a function; None: kept): a
    ``ModuleSpec(MLP)`` in MCore 0.16.1, a ``functools.partial(MLP.as_mlp_submodule,
    submodules=...)`` in 0.19.2 (patches/README.md, API differences). None for another entry
    (e.g. Transformer Engine's fused MLP)."""
    submodules = submodules or (lambda parts: parts)
    if isinstance(mlp, ModuleSpec) and mlp.module is old:
        return ModuleSpec(module=new, params=mlp.params, submodules=submodules(mlp.submodules))
    if (isinstance(mlp, functools.partial) and not mlp.args
            and mlp.func == getattr(old, "as_mlp_submodule", None)):
        keywords = dict(mlp.keywords)
        keywords["submodules"] = submodules(keywords["submodules"])
        return functools.partial(new.as_mlp_submodule, **keywords)
    return None


def _sandwich_mlp(mlp, norm):
    """The looped layer spec's MLP entry with ``SandwichMLP`` for ``LoopedMLP`` and ``norm``
    as its output norm (``_mlp_entry``)."""
    entry = _mlp_entry(mlp, LoopedMLP, SandwichMLP, lambda parts: SandwichMLPSubmodules(
        **vars(parts), post_layernorm=norm))
    if entry is None:
        raise TypeError(f"sandwich layer spec: the looped local layer spec has an MLP entry of "
                        f"unknown form {mlp!r} (expected ModuleSpec(LoopedMLP) or "
                        f"functools.partial(LoopedMLP.as_mlp_submodule, submodules=...))")
    return entry


def get_looped_residual_norm_layer_local_spec(normalization: str = "RMSNorm") -> ModuleSpec:
    """Local backend, Huginn's block (``looped_family`` ``huginn``): norms after both residual
    adds (``ResidualNormTransformerLayer``) and per-head query/key biases."""
    spec = get_looped_gpt_layer_local_spec(normalization=normalization)
    norm = LocalSpecProvider().layer_norm(rms_norm=normalization == "RMSNorm", for_qk=False)
    spec.module = ResidualNormTransformerLayer
    spec.submodules = ResidualNormLayerSubmodules(
        **vars(spec.submodules), post_attn_residual_layernorm=norm,
        post_mlp_residual_layernorm=norm)
    spec.submodules.self_attention.module = QKBiasSelfAttention
    return spec


FAMILY_LAYER_SPECS = {"ouro": get_looped_sandwich_layer_local_spec,
                      "huginn": get_looped_residual_norm_layer_local_spec}
"""``looped_family`` -> its local-backend layer spec (``gpt``: MCore's, by backend)."""


def get_looped_gpt_layer_te_spec(qk_layernorm: bool = False) -> ModuleSpec:
    """Transformer Engine backend (fused layernorm-linear, TE GEMMs): GPU hosts only."""
    if not HAVE_TE:
        raise ImportError(
            "Transformer Engine is not installed: install the `gpu` extra on a CUDA host, "
            "or use get_looped_gpt_layer_local_spec()"
        )
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return _looped(get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm))


def get_looped_final_norm_spec(config, use_transformer_engine: bool = False):
    """The final norm of the shared readout, for the chosen backend."""
    rms = config.normalization == "RMSNorm"
    if use_transformer_engine:
        if not HAVE_TE:
            raise ImportError("Transformer Engine is not installed: use the local spec")
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider().layer_norm(rms_norm=rms, for_qk=False)
    return LocalSpecProvider().layer_norm(rms_norm=rms, for_qk=False)


INJECTIONS = {"none": None, "linear_concat": LinearConcatInjection}
"""``looped_injection`` -> the injection module of the block spec."""


def get_looped_gpt_block_spec(config, use_transformer_engine: bool = False,
                              qk_layernorm: bool = False,
                              layer_spec: Optional[ModuleSpec] = None) -> ModuleSpec:
    """The recurrent block's spec: every layer from ``layer_spec`` (default: the backend's
    looped layer spec), the config's injection and the backend's final norm."""
    family = getattr(config, "looped_family", "gpt")
    if layer_spec is None and family in FAMILY_LAYER_SPECS:
        if use_transformer_engine or qk_layernorm:
            raise NotImplementedError(f"looped_family {family!r} has a local-backend layer spec "
                                      f"only (no Transformer Engine, no qk_layernorm)")
        layer_spec = FAMILY_LAYER_SPECS[family](config.normalization)
    if layer_spec is None:
        layer_spec = (get_looped_gpt_layer_te_spec(qk_layernorm) if use_transformer_engine
                      else get_looped_gpt_layer_local_spec(qk_layernorm, config.normalization))
    return ModuleSpec(module=RecurrentTransformerBlock, submodules=LoopedBlockSubmodules(
        prelude=layer_spec, core=layer_spec, coda=layer_spec,
        injection=INJECTIONS[config.looped_injection],
        final_layernorm=get_looped_final_norm_spec(config, use_transformer_engine),
        exit_gate=ExitGate, loop_weights=LearnedLoopWeights,
    ))


def is_block_spec(spec) -> bool:
    """True for a spec built like ``get_looped_gpt_block_spec``'s."""
    return isinstance(spec, ModuleSpec) and isinstance(spec.submodules, LoopedBlockSubmodules)
