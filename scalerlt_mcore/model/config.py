"""Configuration of the looped GPT: an MCore ``TransformerConfig`` with ``looped_*`` fields."""

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Optional, get_args, get_origin

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

# The choices of the model's string options, listed once; the tuples are derived from them.
Injection = Literal["none", "linear_concat"]
InitialState = Literal["embed", "zeros", "random"]
PrefixAttention = Literal["concat", "cascade"]
CascadeKernel = Literal["auto", "flash", "efficient", "cpu_flash", "matmul"]
Family = Literal["gpt", "ouro", "huginn", "nanbeige"]
PositionEmbeddingType = Literal["learned_absolute", "rope"]
"""Position embeddings of ``LoopedGPTModel`` (its ``position_embedding_type`` argument)."""
Normalization = TransformerConfig.__annotations__["normalization"]
"""Norm layers: MCore's ``TransformerConfig.normalization`` choices."""

CASCADE_KERNELS = get_args(CascadeKernel)
POSITION_EMBEDDING_TYPES = get_args(PositionEmbeddingType)


class FieldError(ValueError):
    """A bad value of a library object's field: ``field`` names it and ``reason`` says what is
    wrong, so that a caller with its own name for the field (the app's flag) says it in that
    name, ``f"{name} {e.reason}"``; the message itself is ``f"{field} {reason}"``."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field} {reason}")
        self.field, self.reason = field, reason


@dataclass
class LoopedFields:
    """The ``looped_*`` fields of ``LoopedTransformerConfig``, declared once: a base of the
    config and of the app's model section (``app/config/model.py``)."""

    looped_num_loops: int = 1
    """R: how many times the core block is applied (weights shared across loops)."""

    looped_num_prelude_layers: int = 0
    """Layers run once on the embedded input before the first loop."""

    looped_num_coda_layers: int = 0
    """Head layers applied after every loop, before the final norm and the shared readout."""

    looped_injection: Injection = "none"
    """How the embedded input re-enters every loop: ``none`` (s_r = core(s_{r-1})) or
    ``linear_concat`` (s_r = core(W [s_{r-1}; e]), W initialised to [I | 0])."""

    looped_initial_state: InitialState = "embed"
    """Deterministic initial state s_0: ``embed`` (the prelude output e), ``zeros``, or
    ``random`` (Huginn's draw made deterministic: per absolute position, the same for every
    sequence, a truncated normal (std ``looped_initial_state_std``, cut at 3 std) times the
    embedding scale,
    from a generator seeded by (seed, step) of ``LoopedGPTModel.set_initial_state_draw``)."""

    looped_initial_state_std: float = 0.0
    """Std of the drawn initial state (``looped_initial_state`` random) before the embedding
    scale; 0: sqrt(2 / (5 H)), Huginn's (a checkpoint's ``init_values.std`` sets it)."""

    looped_prefix_attention: PrefixAttention = "cascade"
    """Attention of a suffix batch to a shared prefix K/V: ``concat`` (expand the prefix per
    sequence and attend once) or ``cascade`` (one batched product against the single prefix,
    merged with each sequence's causal part through the log-sum-exp; reads the prefix once)."""

    looped_cascade_kernel: CascadeKernel = "auto"
    """Kernel of the ``cascade`` prefix attention: ``auto`` (the fused log-sum-exp kernel of the
    tensors' device: ``cpu_flash`` on CPU; on CUDA ``flash`` where it supports the dtype and
    head dim (fp16/bf16), else ``efficient``, else ``matmul``, e.g. for fp64), ``flash`` /
    ``efficient`` (PyTorch's CUDA flash / memory-efficient SDPA ops), ``cpu_flash`` (PyTorch's
    CPU flash op), or ``matmul`` (materialises the [*, W*S, P] scores: the reference path)."""

    looped_backprop_loops: int = 0
    """Truncated backprop through loops (Huginn): k > 0 trains only the last k loops. The first
    R - k loops (their core and coda layers and their readouts) run under ``no_grad``: they
    build no graph, their readouts enter the loss value but no gradient, and under joint replay
    the prefix K/V of their depths needs no adjoint. 0 (or k >= R): every loop trains."""

    looped_exit_gate: bool = False
    """Exit gate (Ouro/LoopLM): a linear map of every loop's normed readout input to a scalar
    gate lambda_r = sigmoid(.), giving per token the exit distribution p(r) = lambda_r *
    prod_{j<r} (1 - lambda_j) over the R loops (the last loop takes the remaining mass). Off:
    no gate parameters (the model stays MCore's GPTModel function at R = 1)."""

    looped_family: Family = "gpt"
    """Layer and loop layout: ``gpt`` (MCore's pre-norm layers; each loop's readout applies the
    final norm to that loop's state, and the next loop continues from the unnormed state) or
    ``ouro`` (Ouro / LoopLM: every layer also normalises its attention and MLP outputs before
    the residual add, the sandwich norms; the final norm closes every loop and the *normed*
    state feeds the next loop, the readout and the exit gate; no prelude or coda) or
    ``huginn`` (Huginn-0125: every layer normalises after each residual add, per-head query and
    key biases, interleaved RoPE, the embedding scaled by sqrt(H); the final norm is applied to
    each loop's state before the coda and again before the readout; needs ``linear_concat``)
    or ``nanbeige`` (Nanbeige4.2: MCore's pre-norm layers with Ouro's loop layout, the final
    norm closing every loop and the normed state feeding the next; no prelude or coda)."""

    looped_learned_loop_weights: bool = False
    """Learned loop credit (RLTT ``learned``): trainable logits, one per loop (initialised
    equal), whose softmax weights the loops' readouts in the RL loss, trained with the policy."""

    looped_readout_tile: int = 0
    """Streamed readout: > 0 computes the log-probs of labels (training and scoring) over
    tiles of this many vocabulary rows (``model/streamed_readout.py``), keeping no logits or
    softmax [R, rows, T, V / tp] for the backward (which recomputes each tile); the same numbers
    to rounding. 0: the plain readout (logits, then the log-softmax). Decoding's logits are
    unaffected."""


@dataclass
class LoopedTransformerConfig(LoopedFields, TransformerConfig):
    """``TransformerConfig`` for a recurrent looped transformer (the ``LoopedFields``).

    ``num_layers`` counts the *core* layers (L_core): the block applied ``looped_num_loops``
    times with shared weights. Dropout defaults to 0 (RL recomputation must be deterministic).
    """

    hidden_dropout: float = 0.0
    """Residual dropout (0: recomputation in joint replay must reproduce the forward)."""

    attention_dropout: float = 0.0
    """Attention-probability dropout (0, as for ``hidden_dropout``)."""

    def __post_init__(self):
        if self.looped_family == "huginn":
            self.rotary_interleaved = True  # Huginn's complex-pair RoPE
        super().__post_init__()
        validate_looped_config(self)

    def with_loops(self, num_loops: Optional[int]) -> "LoopedTransformerConfig":
        """This config as a call running ``num_loops`` loops reads it (None: ``looped_num_loops``):
        a shallow copy with R replaced, or the config itself; the config is never changed (no
        parameter depends on R, so one model runs any loop count)."""
        if num_loops is None:
            return self
        if not isinstance(num_loops, int) or isinstance(num_loops, bool) or num_loops < 1:
            raise ValueError(f"num_loops must be an integer >= 1, got {num_loops!r}")
        if num_loops == self.looped_num_loops:
            return self
        view = copy.copy(self)
        view.looped_num_loops = num_loops
        return view

    @property
    def looped_num_depths(self) -> int:
        """Virtual depths with their own K/V: prelude + R * (core + coda)."""
        per_loop = self.num_layers + self.looped_num_coda_layers
        return self.looped_num_prelude_layers + self.looped_num_loops * per_loop

    @property
    def looped_normed_state(self) -> bool:
        """The final norm closes every loop (``looped_family`` ``ouro``, ``nanbeige``): the
        block returns normed states and the readout applies no norm of its own."""
        return self.looped_family in ("ouro", "nanbeige")

    @property
    def looped_norm_before_coda(self) -> bool:
        """The final norm also precedes the coda (``looped_family`` ``huginn``)."""
        return self.looped_family == "huginn"

    @property
    def looped_drawn_state_std(self) -> float:
        """Std of the drawn initial state: ``looped_initial_state_std``, or sqrt(2 / (5 H))."""
        return self.looped_initial_state_std or math.sqrt(2 / (5 * self.hidden_size))

    @property
    def looped_embedding_scale(self) -> float:
        """Factor of the token embeddings: sqrt(H) for ``huginn``, else 1."""
        return math.sqrt(self.hidden_size) if self.looped_family == "huginn" else 1.0

    @property
    def looped_num_graph_free_loops(self) -> int:
        """Loops run under ``no_grad`` by truncated backprop: R - k when 0 < k < R, else 0."""
        k, loops = self.looped_backprop_loops, self.looped_num_loops
        return loops - k if 0 < k < loops else 0


def validate_looped_config(cfg: LoopedTransformerConfig) -> None:
    """All cross-field checks of the ``looped_*`` fields: a ``FieldError`` names the field (a
    caller with its own name for it says that name), a ``NotImplementedError`` what the looped
    GPT does not support."""
    if not isinstance(cfg.looped_num_loops, int) or cfg.looped_num_loops < 1:
        raise FieldError("looped_num_loops",
                         f"must be an integer >= 1, got {cfg.looped_num_loops!r}")
    for name in ("looped_num_prelude_layers", "looped_num_coda_layers", "looped_backprop_loops",
                 "looped_readout_tile"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 0:
            raise FieldError(name, f"must be an integer >= 0, got {value!r}")
    for f in dataclasses.fields(cfg):
        if f.name.startswith("looped_") and get_origin(f.type) is Literal:
            allowed, value = get_args(f.type), getattr(cfg, f.name)
            if value not in allowed:
                raise FieldError(f.name, f"must be one of {allowed}, got {value!r}")
    if cfg.looped_normed_state and (cfg.looped_num_prelude_layers or cfg.looped_num_coda_layers):
        raise FieldError("looped_family", f"{cfg.looped_family!r} loops the whole stack: "
                         f"looped_num_prelude_layers and looped_num_coda_layers must be 0, got "
                         f"{cfg.looped_num_prelude_layers} and {cfg.looped_num_coda_layers}")
    if not cfg.looped_initial_state_std >= 0:
        raise FieldError("looped_initial_state_std",
                         f"must be >= 0, got {cfg.looped_initial_state_std!r}")
    if cfg.looped_family == "huginn" and cfg.looped_injection != "linear_concat":
        raise FieldError("looped_family", f"'huginn' needs looped_injection 'linear_concat' "
                         f"(its adapter), got {cfg.looped_injection!r}")
    if cfg.pipeline_model_parallel_size != 1:
        raise NotImplementedError(
            f"pipeline_model_parallel_size must be 1 (the looped GPT has no pipeline "
            f"parallelism), got {cfg.pipeline_model_parallel_size}")
    if cfg.sequence_parallel:
        raise NotImplementedError("sequence_parallel=True (--sequence-parallel): the looped GPT "
                                  "does not support sequence parallelism")
    if cfg.context_parallel_size > 1:
        raise NotImplementedError(f"context_parallel_size={cfg.context_parallel_size} "
                                  f"(--context-parallel-size): the looped GPT does not support "
                                  f"context parallelism")
    _check_recompute(cfg)


def _check_recompute(cfg: LoopedTransformerConfig) -> None:
    """Recompute settings MCore's own checks let through but the looped block cannot honour
    (``recompute.py``): a method or layer count without ``full`` granularity, a count < 1, a
    recomputed MLP with a bias."""
    granularity, n = cfg.recompute_granularity, cfg.recompute_num_layers
    if cfg.recompute_method is not None and granularity != "full":
        raise FieldError("recompute_method", f"{cfg.recompute_method!r} (--recompute-method) "
                         f"needs recompute_granularity 'full', got {granularity!r}")
    if n is not None and granularity != "full":
        raise FieldError("recompute_num_layers", "(--recompute-num-layers) needs "
                         f"recompute_granularity 'full', got {granularity!r}")
    if granularity == "full" and (not isinstance(n, int) or n < 1):
        raise FieldError("recompute_num_layers", "(--recompute-num-layers) must be an integer "
                         f">= 1 with recompute_granularity 'full', got {n!r}")
    if granularity == "selective" and "mlp" in (cfg.recompute_modules or ()) \
            and cfg.add_bias_linear:
        raise FieldError("recompute_modules", "'mlp' (--recompute-modules mlp) needs "
                         "add_bias_linear=False (--disable-bias-linear): MCore's MLP checkpoint "
                         "returns the fc2 bias parameter itself, whose backward never ends")


LOOP_SAMPLINGS = ("fixed", "uniform:a,b", "poisson_lognormal[:max]")
"""Forms of a loop-count sampling spec (``sample_num_loops``)."""

POISSON_LOGNORMAL_SIGMA = 0.5
"""sigma of the Poisson-lognormal loop count (Huginn's value)."""


def parse_loop_sampling(spec: str, mean: int) -> tuple:
    """A loop-count sampling spec -> (kind, low, high): ``fixed`` (always ``mean``),
    ``uniform:a,b`` (uniform in [a, b]) or ``poisson_lognormal[:max]`` (1 + Poisson(e^tau),
    tau ~ N(log(mean - 1) - sigma^2 / 2, sigma): mean ``mean`` before clamping to ``max``,
    default 2 * mean). ``high`` is the largest loop count the spec can draw."""
    kind, _, args = str(spec).partition(":")
    try:
        if kind == "fixed" and not args:
            return kind, mean, mean
        if kind == "uniform":
            low, high = (int(a) for a in args.split(","))
            if 1 <= low <= high:
                return kind, low, high
        if kind == "poisson_lognormal":
            high = int(args) if args else 2 * mean
            if high >= 1:
                return kind, 1, high
    except ValueError:
        pass
    raise ValueError(f"looped_num_loops_sampling must be one of {LOOP_SAMPLINGS} with "
                     f"1 <= a <= b and max >= 1, got {spec!r}")


def step_seed(seed: int, step: int, rank: int, salt: int = 0) -> int:
    """The seed of one draw of training step ``step`` on data-parallel rank ``rank`` (``salt``
    tells a step's draws apart): the one formula of every per-step draw (prompts, sampling, the
    warm-up pairs, the loop count), so a resumed run draws them again."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + salt) % (2**31 - 1)


LOOP_COUNT_SALT = 424_242
"""``step_seed``'s salt of the loop-count draw (rank 0's: the same draw on every rank)."""


def curriculum_loops(step: int, loops: int, warmup_iters: int) -> int:
    """Loop count of ``step``: rises linearly from 1 to ``loops`` over ``warmup_iters`` steps."""
    if warmup_iters <= 0 or step >= warmup_iters:
        return loops
    return 1 + (loops - 1) * step // warmup_iters


def step_num_loops(step: int, loops: int, warmup_iters: int, spec: str, seed: int,
                   evaluation: bool = False) -> int:
    """The loop count R of training step ``step``, owned here: the ``warmup_iters`` curriculum
    towards ``loops``, then ``spec``'s draw for the step (``sample_num_loops``), or with
    ``evaluation`` the largest count ``spec`` can draw (every loop count's accuracy measured)."""
    loops = curriculum_loops(step, loops, warmup_iters)
    if evaluation:
        return parse_loop_sampling(spec, loops)[2]
    return sample_num_loops(spec, loops, seed, step)


def sample_num_loops(spec: str, mean: int, seed: int, step: int) -> int:
    """The loop count R of training step ``step``, drawn by ``spec`` (``parse_loop_sampling``)
    from (seed, step) alone (``step_seed`` of rank 0): the same on every rank, and a resumed
    run draws it again."""
    kind, low, high = parse_loop_sampling(spec, mean)
    if kind == "fixed":
        return mean
    gen = torch.Generator(device="cpu")  # host-side: one integer per step
    gen.manual_seed(step_seed(seed, step, 0, LOOP_COUNT_SALT))
    if kind == "uniform":
        return int(torch.randint(low, high + 1, (1,), generator=gen, device="cpu"))
    if mean <= 1:
        return 1
    sigma = POISSON_LOGNORMAL_SIGMA
    tau = torch.normal(math.log(mean - 1) - sigma**2 / 2, sigma, (1,), generator=gen,
                       dtype=torch.float64, device="cpu")
    count = 1 + int(torch.poisson(tau.exp(), generator=gen))
    return min(count, high)
