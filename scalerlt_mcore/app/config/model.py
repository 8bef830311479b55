"""The model section: the looped GPT's keys (Megatron-LM's names where it has the flag; the
``looped_*`` fields of ``LoopedTransformerConfig``) and their checks."""

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

from ...model.config import (
    LoopedFields,
    Normalization,
    PositionEmbeddingType,
    parse_loop_sampling,
)
from .builders import model_config, tokenizer_from
from .library import library_errors, positive

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass
class ModelArgs(LoopedFields):
    """The looped GPT (Megatron names where Megatron has them; ``looped_*``: the fields of
    ``LoopedTransformerConfig``, inherited from ``LoopedFields``, and the app's own loop
    options)."""

    num_layers: int = 2
    """Core layers (L_core): the block applied ``looped_num_loops`` times with shared weights."""
    hidden_size: int = 64
    """Transformer hidden size."""
    num_attention_heads: int = 2
    """Attention heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention; None: one per attention head."""
    ffn_hidden_size: Optional[int] = None
    """MLP hidden size; None: 4 * hidden_size."""
    max_position_embeddings: int = 32
    """Longest sequence (bos + prompt + response)."""
    position_embedding_type: PositionEmbeddingType = "learned_absolute"
    """Position embeddings: learned (``learned_absolute``) or rotary (``rope``)."""
    normalization: Normalization = "LayerNorm"
    """Norm layers: ``LayerNorm`` or ``RMSNorm``."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weights instead of the embedding's."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Layer backend: ``local`` (PyTorch, runs on CPU) or ``transformer_engine`` (GPU); also
    MCore's ``TransformerConfig.transformer_impl``."""
    bf16: bool = False
    """Train in bfloat16 mixed precision."""
    fp16: bool = False
    """Train in float16 mixed precision."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size: each layer's heads and MLP, and the vocabulary, split over this
    many ranks (the data-parallel size is the world size divided by it)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the tokenizer's vocabulary to a multiple of this times tensor_model_parallel_size (as
    Megatron) when vocab_size is unset; padding ids are never sampled and never labels."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (the looped GPT rejects any other than 1)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (the looped GPT rejects it: not supported)."""
    context_parallel_size: int = 1
    """Megatron's context-parallel size (the looped GPT rejects any other than 1: not
    supported)."""
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """Activation recompute (MCore's): ``full`` recomputes layer applications in the backward
    (prelude, every loop's core and coda), ``selective`` the core attention; None: off."""
    recompute_method: Optional[Literal["uniform", "block"]] = None
    """With ``full``: ``uniform`` (chunks of recompute_num_layers layers) or ``block`` (the
    first recompute_num_layers layers of each layer list's application)."""
    recompute_num_layers: Optional[int] = None
    """Layers per chunk (``uniform``) or layers recomputed (``block``); ``full`` only."""
    vocab_size: Optional[int] = None
    """Rows of the embedding table (as set: not padded; divisible by
    tensor_model_parallel_size); None: the tokenizer's, padded by make_vocab_size_divisible_by.
    A pretrained model's may be larger: ids past the tokenizer's are never sampled."""
    kv_channels: Optional[int] = None
    """Attention head dimension; None: hidden_size / num_attention_heads."""
    swiglu: bool = False
    """SwiGLU MLP (gated linear unit, silu), as in Llama / Qwen2."""
    disable_bias_linear: bool = False
    """No biases on the linear layers (Llama / Qwen2)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection even with ``disable_bias_linear`` (Qwen2)."""
    norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm."""
    rotary_base: float = 10000.0
    """RoPE base (Hugging Face ``rope_theta``)."""
    use_rope_scaling: bool = False
    """Llama 3.x RoPE frequency scaling (MCore's: frequency factors 1 and 4, context 8192)."""
    rope_scaling_factor: float = 8.0
    """Factor of ``use_rope_scaling``."""
    looped_retrofit: Optional[str] = None
    """Retrofitted recurrence from a pretrained plain stack of N layers: ``prelude,core,coda``
    (e.g. ``2,4,2``): the first ``prelude`` layers run once, the next ``core`` layers are
    looped, the last ``coda`` layers run after every loop; the layers between core and coda
    are dropped (logged). Sets looped_num_prelude_layers, num_layers and
    looped_num_coda_layers, and looped_injection ``linear_concat`` (initialised to [I | 0]).
    Needs ``pretrained_checkpoint``."""
    looped_loops_warmup_iters: int = 0
    """Loop-count curriculum: over this many steps the loop count rises linearly from 1 to
    looped_num_loops (step t: 1 + floor((looped_num_loops - 1) * t / this)); 0: off."""
    looped_num_loops_sampling: str = "fixed"
    """Loop count per training step (Huginn): ``fixed`` (looped_num_loops), ``uniform:a,b``
    (uniform in [a, b]) or ``poisson_lognormal[:max]`` (1 + Poisson(e^tau), tau lognormal,
    mean looped_num_loops, clamped to max, default 2x). One draw per step from (seed, step):
    the same on every rank and again on resume; rollouts, scoring and training of the step use
    it. Evaluation runs the largest count it can draw and reports every loop's accuracy."""


def check_model(cfg: "RunConfig", world_size: int) -> list[str]:
    """The model section's checks: sizes, then ``model_config``'s own (MCore's and the looped
    GPT's), then the architecture extras and the loop options."""
    return _check_sizes(cfg, world_size) + _check_architecture(cfg) + _check_loops(cfg)


def _unsupported_parallelism(m: ModelArgs) -> list[str]:
    """Megatron's sequence and context parallelism, refused with the reason (before MCore's
    own checks, whose messages suggest other settings)."""
    errors = []
    if m.sequence_parallel:
        errors.append("sequence_parallel (--sequence-parallel) must be false: the looped GPT "
                      "does not support sequence parallelism")
    if m.context_parallel_size != 1:
        errors.append(f"context_parallel_size (--context-parallel-size) must be 1, got "
                      f"{m.context_parallel_size}: the looped GPT does not support context "
                      f"parallelism")
    return errors


def _check_sizes(cfg: "RunConfig", world_size: int) -> list[str]:
    """The sizes, then ``model_config``'s own checks (MCore's and the looped GPT's): the sizes
    it divides by must be >= 1 first."""
    m = cfg.model
    errors = positive(m, "num_layers", "hidden_size", "num_attention_heads",
                      "max_position_embeddings", "tensor_model_parallel_size",
                      "make_vocab_size_divisible_by", "pipeline_model_parallel_size")
    if errors:
        return errors
    unsupported = _unsupported_parallelism(m)
    if unsupported:
        return unsupported
    if m.hidden_size % m.num_attention_heads:
        errors.append(f"hidden_size ({m.hidden_size}) must be divisible by "
                      f"num_attention_heads ({m.num_attention_heads})")
    groups = m.num_query_groups or m.num_attention_heads
    if groups < 1 or m.num_attention_heads % groups:
        errors.append(f"num_attention_heads ({m.num_attention_heads}) must be divisible by "
                      f"num_query_groups ({groups})")
    if world_size % m.tensor_model_parallel_size:
        errors.append(f"world size ({world_size}) must be divisible by "
                      f"tensor_model_parallel_size ({m.tensor_model_parallel_size})")
    if m.vocab_size is not None and m.vocab_size % m.tensor_model_parallel_size:
        errors.append(f"vocab_size ({m.vocab_size}) must be divisible by "
                      f"tensor_model_parallel_size ({m.tensor_model_parallel_size}): the "
                      f"output layer splits the vocabulary (leave vocab_size unset to pad the "
                      f"tokenizer's by make_vocab_size_divisible_by)")
    # the model's own fields are the keys' names: no map
    return errors + library_errors(lambda c: model_config(c, "cpu"), cfg, {})


def _check_architecture(cfg: "RunConfig") -> list[str]:
    """Norms, RoPE, head dimension and the vocabulary against the tokenizer's."""
    m = cfg.model
    errors = [f"{k} must be > 0, got {getattr(m, k)}"
              for k in ("norm_epsilon", "rotary_base", "rope_scaling_factor")
              if getattr(m, k) <= 0]
    if m.kv_channels is not None and m.kv_channels < 1:
        errors.append(f"kv_channels must be >= 1 or null, got {m.kv_channels}")
    tokens = _tokenizer_size(cfg)
    if m.vocab_size is not None and tokens is not None and m.vocab_size < tokens:
        errors.append(f"vocab_size ({m.vocab_size}) must be >= the tokenizer's ({tokens})")
    return errors


def _tokenizer_size(cfg: "RunConfig") -> Optional[int]:
    """The tokenizer's vocabulary size; None when it does not build (the tokenizer section's
    check says why)."""
    try:
        return tokenizer_from(cfg).vocab_size
    except (ValueError, OSError):
        return None


def _check_loops(cfg: "RunConfig") -> list[str]:
    """The loop curriculum, loop-count sampling, retrofitted recurrence and truncated
    backprop's need of injection."""
    m = cfg.model
    errors = positive(m, "looped_loops_warmup_iters", minimum=0)
    try:
        parse_loop_sampling(m.looped_num_loops_sampling, m.looped_num_loops)
    except ValueError as e:
        errors.append(str(e))
    if m.looped_retrofit is not None and not re.fullmatch(r"\d+,\d+,\d+", m.looped_retrofit):
        errors.append(f"looped_retrofit must be 'prelude,core,coda' (e.g. '2,4,2'), got "
                      f"{m.looped_retrofit!r}")
    if m.looped_retrofit and not cfg.logging.pretrained_checkpoint:
        errors.append("looped_retrofit needs pretrained_checkpoint")
    # MCore DDP with overlapped reduction needs a gradient for every parameter every step
    if m.looped_backprop_loops > 0 and m.looped_injection == "none":
        errors.append("looped_backprop_loops > 0 needs looped_injection linear_concat (as "
                      "Huginn: without injection the truncated loops cut the embedding and "
                      "prelude off from every gradient)")
    if m.looped_exit_gate and m.looped_backprop_loops == 1:
        errors.append("looped_exit_gate needs looped_backprop_loops 0 or >= 2: with 1 the gate "
                      "gets no gradient (the gates of the loops run without a graph are "
                      "detached, and the last loop's gate is unused: it takes the remaining "
                      "exit mass)")
    return errors
