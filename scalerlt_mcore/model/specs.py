"""Layer specs of the looped GPT, one function per backend (MCore style).

Each is MCore's GPT layer spec for that backend with the self-attention swapped for
``LoopedSelfAttention`` (same parameters) and the core attention for ``LoopedCoreAttention``.
"""

import copy

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import LoopedCoreAttention, LoopedSelfAttention

try:
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:  # CPU hosts: Transformer Engine is a GPU-only extra
    HAVE_TE = False


def _looped(spec: ModuleSpec) -> ModuleSpec:
    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention
    attention.module = LoopedSelfAttention
    attention.submodules.core_attention = LoopedCoreAttention
    return spec


def get_looped_gpt_layer_local_spec(qk_layernorm: bool = False,
                                    normalization: str = "LayerNorm") -> ModuleSpec:
    """Local (PyTorch / MCore) backend: runs on CPU and GPU."""
    return _looped(get_gpt_layer_local_spec(qk_layernorm=qk_layernorm,
                                            normalization=normalization))


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


def get_looped_final_norm_spec(config, backend: str = "local"):
    """The final norm of the shared readout, for the chosen backend."""
    rms = config.normalization == "RMSNorm"
    if backend == "te":
        if not HAVE_TE:
            raise ImportError("Transformer Engine is not installed: use backend='local'")
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider().layer_norm(rms_norm=rms, for_qk=False)
    return LocalSpecProvider().layer_norm(rms_norm=rms, for_qk=False)
