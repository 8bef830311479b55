"""Planning a group's shared-prefix step: predicted memory and time, and the plan they pick.

Memory (docs/design.md): the bytes autograd saves for backward (what ``SavedTensorProbe``
measures) and the prefix adjoints, per (model, group, plan, checkpointed waves), and for naive
training of the same group. One model of the joint replay, ``tree_memory``, walks the replay
engine's order (``tree_schedule.TreeReplay``) over the group's tree (a one-level group's:
``tree.flat_tree``), each moment the retained graphs of the current path plus one working set:

- a wave holds its own activations and the prefix state it reads (leaves that share the
  no-grad state's K/V storage, or in a bf16/fp16 model fp32 copies of it);
- a replay holds its chain's graphs (recomputed, or retained from the descent) and its last
  wave; a retained root holds its graph while every wave runs;
- checkpointed waves: a wave's activations exist only while it is recomputed in its backward
  (the probe does not see them; ``activation_bytes`` counts them);
- a prompt in segments: the K/V leaves beside one wave, then beside one segment's replay;
- naive: one microbatch of full prompt+response sequences;
- activation recompute (MCore's ``recompute_*``): a checkpointed chunk saves its input and the
  prefix K/V of its depths in the forward; each graph's backward is a moment of its own: its
  forward less its readouts and loss (done first) plus the largest chunk it recomputes, less
  what the backward freed before it (``recompute_bytes``); the prompt's backward comes after
  its waves'. ``selective`` saves a recomputed module's inputs and rebuilds one at a time.

The bytes of every forward are measured on the live model, not copied from a layer spec:
``calibration`` runs a few one-row causal forwards under ``SavedTensorProbe`` (1 and 2 loops,
with and without readouts, two lengths; on the model's device, dtype, TP shards and recompute
setting) and fits saved bytes per token of the embedding and prelude, of each trained loop and
of each readout; each attention call adds its core attention's own model (``saved_bytes``,
beside the kernels in ``model/kernels.py``: what a kernel keeps against a prefix of any
length). Under ``full`` recompute the same forwards without it give what a recomputed layer
saves (``layer_bytes``); under ``selective`` recompute of ``mlp`` one MLP's forward gives what
it rebuilds (``mlp_bytes``). Tests hold the sum to within 10% of the probe for every family,
with and without recompute. Time: ``CostModel`` (a fixed
cost per layer call plus a cost per FLOP, calibrated by a short measurement).
"""

import contextlib
import math
import time
import weakref
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from ..model.attention import LoopedCoreAttention
from ..model.config import FieldError
from .probe import SavedTensorProbe
from .replay import segment_bounds
from .tree import flat_tree
from .tree_schedule import chain_parent, nodes_with_loss

PROMPT_MODES = ("recompute", "retain")
DEFAULT_PROMPT = "auto"
"""The prompt mode when none is given (the ``Planner``'s, hence the schedule's and the app's)."""
SCHEDULES = ("joint_replay", "naive", "auto")
DEFAULT_SEGMENTS = "auto"
"""Prompt segments when none are given: one unless only more fit the memory budget."""
STATE_KINDS = ("kv", "inputs", "auto")
DEFAULT_STATE = "auto"
"""What prefix states keep when not given: K/V unless only inputs fit the memory budget."""
INT64 = 8


@dataclass(frozen=True)
class GroupPlan:
    """How one group is trained."""

    wave_size: int
    """Responses per wave (per microbatch when ``naive``)."""

    retain: bool = False
    """Keep the prompt producer's graph and backpropagate through it (no prompt recompute)."""

    naive: bool = False
    """Train the group as full prompt+response sequences instead of joint replay."""

    retain_nodes: Optional[tuple] = None
    """A tree group: per node (root first), whether its graph is kept from its first forward
    (True) or recomputed in its replay (False); None: every node as ``retain``. A node that
    continues its parent's replay chain (``tree_chain_parent``) is retained only with it.
    Always None for a one-level group."""

    prompt_segments: int = 1
    """Joint replay: the prompt (a tree's root) replayed in this many query segments, each in a
    backward of its own (``replay.replay_segments``); > 1 needs the prompt recomputed."""

    state_kind: str = "kv"
    """Joint replay: what the prefix states keep per depth, ``kv`` (K and V) or ``inputs`` (the
    attention's input, ``PrefixState.inputs``: half the state and adjoints with MHA; every
    wave projects the prefix's K/V again, its FLOPs, ``derive_flops``)."""

    def __post_init__(self):
        if not isinstance(self.wave_size, int) or self.wave_size < 1:
            raise ValueError(f"GroupPlan.wave_size must be an integer >= 1, got "
                             f"{self.wave_size!r}")
        segments = self.prompt_segments
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ValueError(f"GroupPlan.prompt_segments must be an integer >= 1, got "
                             f"{segments!r}")
        nodes = self.retain_nodes
        if nodes is not None and (not isinstance(nodes, tuple)
                                  or not all(isinstance(r, bool) for r in nodes)):
            raise ValueError(f"GroupPlan.retain_nodes must be a tuple of bools (one per tree "
                             f"node) or None, got {nodes!r}")
        if self.state_kind not in ("kv", "inputs"):
            raise ValueError(f"GroupPlan.state_kind must be 'kv' or 'inputs', got "
                             f"{self.state_kind!r}")
        if segments > 1 and (self.retain or self.naive or (nodes and nodes[0])):
            raise ValueError(f"GroupPlan.prompt_segments {segments} replays a recomputed "
                             f"prompt: it cannot go with retain, naive or a retained root")

    def node_retained(self, num_nodes: int) -> tuple:
        """Per node of a tree of ``num_nodes``: whether its graph is retained."""
        if self.retain_nodes is None:
            return (self.retain,) * num_nodes
        if len(self.retain_nodes) != num_nodes:
            raise ValueError(f"GroupPlan.retain_nodes has {len(self.retain_nodes)} entries; "
                             f"the tree has {num_nodes} nodes")
        return self.retain_nodes


@dataclass(frozen=True)
class ModelShape:
    """What the memory and time predictions read from a looped GPT."""

    hidden: int
    ffn: int
    gated: bool
    heads: int
    kv_groups: int
    kv_channels: int
    vocab: int
    loops: int
    prelude: int
    core: int
    coda: int
    rope_dim: int
    """Rotary dimension; 0 with learned absolute positions."""
    prefix_attention: str
    dtype_bytes: int
    """Bytes per activation element (the parameters' dtype)."""
    acc_bytes: int
    """Bytes per element of fp32-or-wider accumulators (log-softmax, LSE, norm statistics)."""
    graph_free_loops: int = 0
    """Leading loops that truncated backprop runs without a graph (``looped_backprop_loops``):
    they save nothing, and their prefix K/V get no adjoint."""
    core_attention: type = LoopedCoreAttention
    """The layers' core attention: its ``saved_bytes(shape, rows, s, mode, prefix)`` is the
    memory model of every attention call (a swapped-in core attention brings its own)."""
    recompute: Optional[str] = None
    """MCore's ``recompute_granularity`` (``full``, ``selective``) or None."""
    chunks: tuple = ((), (), ())
    """Under ``full`` recompute: the (start, end, checkpointed) chunks of the prelude, core and
    coda layer lists (``model.recompute.layer_chunks``)."""
    recompute_modules: tuple = ()
    """Under ``selective`` recompute: the recomputed modules (``core_attn``, ``mlp``, ...)."""
    token_bytes: tuple = (0.0, 0.0, 0.0, 0.0)
    """Measured saved bytes per token of (the embedding and prelude, each trained loop, a
    trained loop's readout, what two consecutive readouts save once: the loop output that is
    the next loop's input), the attention kernels' own bytes and the token ids aside; see
    ``calibration``."""
    layer_bytes: float = 0.0
    """Under ``full`` recompute: measured saved bytes per token of one layer application
    without recompute (its input included, its attention kernel aside): what a checkpointed
    chunk rebuilds in its backward."""
    mlp_bytes: float = 0.0
    """Under ``selective`` recompute of ``mlp``: measured bytes per token an MLP saves beyond
    its input (what its backward rebuilds)."""
    state_kind: str = "kv"
    """What the prefix states keep per depth (``GroupPlan.state_kind``): set by the whole-step
    predictions from the plan."""

    @classmethod
    def from_model(cls, model, num_loops: Optional[int] = None) -> "ModelShape":
        """The shape of ``model`` running ``num_loops`` loops (None: ``looped_num_loops``),
        calibrated on the model (``calibration``, once per model, dtype and device)."""
        return replace(cls.uncalibrated(model, num_loops), **calibration(model))

    @classmethod
    def uncalibrated(cls, model, num_loops: Optional[int] = None) -> "ModelShape":
        """The shape of ``model`` read from its config, nothing measured: per rank, with heads,
        K/V groups, FFN width and vocabulary split over tensor parallelism."""
        c = model.config.with_loops(num_loops)
        dtype = next(model.parameters()).dtype
        rope = getattr(model, "rotary_pos_emb", None)
        tp = c.tensor_model_parallel_size
        return cls(
            hidden=c.hidden_size, ffn=c.ffn_hidden_size // tp, gated=bool(c.gated_linear_unit),
            heads=c.num_attention_heads // tp,
            kv_groups=(c.num_query_groups or c.num_attention_heads) // tp,
            kv_channels=c.kv_channels, vocab=model.vocab_size // tp, loops=c.looped_num_loops,
            prelude=c.looped_num_prelude_layers, core=c.num_layers, coda=c.looped_num_coda_layers,
            rope_dim=0 if rope is None else 2 * rope.inv_freq.numel(),
            prefix_attention=c.looped_prefix_attention, dtype_bytes=dtype.itemsize,
            acc_bytes=torch.promote_types(dtype, torch.float32).itemsize,
            graph_free_loops=c.looped_num_graph_free_loops,
            core_attention=_core_attention(model), **_recompute_fields(c),
        )

    @property
    def depths(self) -> int:
        return self.prelude + self.loops * (self.core + self.coda)

    @property
    def trained_loops(self) -> int:
        """Loops that build a graph (the last ``looped_backprop_loops``, or all)."""
        return self.loops - self.graph_free_loops

    @property
    def trained_depths(self) -> int:
        """Depths whose prefix K/V a suffix's gradient reaches (``kv.trained_depths``)."""
        return self.prelude + self.trained_loops * (self.core + self.coda)

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_groups) * self.kv_channels

    @property
    def state_width(self) -> int:
        """Prefix-state elements per position and depth: K and V, or the attention's input."""
        return 2 * self.kv_groups * self.kv_channels if self.state_kind == "kv" else self.hidden

    @property
    def leaf_read_bytes(self) -> int:
        """Bytes per element of what a forward saves of the state's (>= fp32) leaves: the
        leaves themselves, but of input leaves wider than the activations nothing (their
        copies in the activations' dtype are ``derived_kv_bytes``)."""
        wide = self.acc_bytes != self.dtype_bytes
        return 0 if self.state_kind == "inputs" and wide else self.acc_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak bytes of one group's training step."""

    saved_bytes: int
    """Peak bytes autograd saves for backward, as ``SavedTensorProbe`` measures them."""

    activation_bytes: int
    """``saved_bytes`` plus what checkpointed waves recompute in their backward."""

    adjoint_bytes: int
    """Prefix adjoints: the accumulators (fp32 or wider) plus the leaves' gradients."""

    @property
    def peak_bytes(self) -> int:
        """What a memory budget is checked against: activations plus adjoints."""
        return self.activation_bytes + self.adjoint_bytes


def _recompute_fields(c) -> dict:
    """``ModelShape``'s recompute fields of config ``c`` (its chunks by ``layer_chunks``)."""
    from ..model.recompute import layer_chunks

    granularity = c.recompute_granularity
    counts = (c.looped_num_prelude_layers, c.num_layers, c.looped_num_coda_layers)
    full = granularity == "full"
    return dict(recompute=granularity,
                chunks=tuple(tuple(layer_chunks(c, k)) if full else ((0, k, False),)
                             for k in counts),
                recompute_modules=tuple(c.recompute_modules or ())
                if granularity == "selective" else ())


def _core_attention(model) -> type:
    """The class of the model's core attention (every layer's is the same spec's), checked to
    carry a saved-bytes model."""
    layers = [*model.decoder.prelude, *model.decoder.layers, *model.decoder.coda]
    kinds = {type(layer.self_attention.core_attention) for layer in layers}
    if len(kinds) != 1:
        raise ValueError(f"the planner needs one core attention for every layer, got "
                         f"{sorted(k.__name__ for k in kinds)}")
    kind = kinds.pop()
    if not callable(getattr(kind, "saved_bytes", None)):
        raise ValueError(f"core attention {kind.__name__} has no saved_bytes(shape, rows, s, "
                         f"mode, prefix): the planner cannot predict its memory")
    return kind


# ---- saved bytes of one forward, calibrated on the live model ---------------------------------


def _attention_calls(m: ModelShape, core: bool = True) -> int:
    """Attention applications of one forward whose kernel saves for backward: the trained
    layer applications outside checkpointed chunks (none where ``core_attn`` is recomputed,
    unless ``core`` is False: the applications themselves)."""
    if core and "core_attn" in m.recompute_modules:
        return 0
    plain = [sum(end - start for start, end, ck in chunks if not ck) for chunks in m.chunks]
    return plain[0] + m.trained_loops * (plain[1] + plain[2])


def block_bytes(m: ModelShape, rows: int, s: int, kind: str, prefix: int = 0,
                readout: bool = True) -> int:
    """Saved bytes of the looped block's forward over ``rows`` x ``s`` tokens (prelude, trained
    loops, their readouts): the measured bytes per token plus each saving attention call's
    kernel model (``kind`` causal, cascade or concat against ``prefix`` keys). Token ids,
    positions and prefix K/V storage are the caller's."""
    prelude, loop, read, shared = m.token_bytes
    k = m.trained_loops
    per_token = prelude + k * loop + readout * (k * read - max(k - 1, 0) * shared)
    attention = m.core_attention.saved_bytes(m, rows, s, kind, prefix)
    return (round(rows * s * per_token) + _attention_calls(m) * attention
            + _attention_calls(m, core=False) * derived_kv_bytes(m, prefix))


def derived_kv_bytes(m: ModelShape, P: int) -> int:
    """What a layer application saves of deriving the K/V of P prefix positions (0: none, a
    causal forward) from a state of kind ``inputs``: the projection's input in the
    activations' dtype (a copy of wider leaves; narrower ones are the state's storage), the
    RoPE cos and sin, and the K/V the core attention keeps (the projection's output, which
    the values view, and the rotated keys) where it keeps them: cascade attention, or a
    checkpointed one (``core_attn``) whose checkpoint takes them."""
    if m.state_kind == "kv":
        return 0
    wide = m.acc_bytes != m.dtype_bytes
    kernel = m.prefix_attention == "cascade" or "core_attn" in m.recompute_modules
    rotated = m.kv_groups * m.kv_channels * bool(m.rope_dim)
    kept = m.hidden * wide + 2 * m.rope_dim + (m.qkv_width + rotated) * kernel
    return P * kept * m.dtype_bytes


def recompute_bytes(m: ModelShape, rows: int, s: int, kind: str, prefix: int = 0) -> int:
    """The largest working set activation recompute rebuilds in a backward of ``rows`` x ``s``
    tokens: a ``selective`` module, or a ``full`` chunk's layers beyond its saved input, less
    what the backward freed before it: in the last loop the saves of the plain layers and the
    inputs of the chunks after it (the prelude's chunks: nothing freed, an upper bound)."""
    n = rows * s
    attention = m.core_attention.saved_bytes(m, rows, s, kind, prefix)
    if m.recompute == "selective":
        return max(attention * ("core_attn" in m.recompute_modules),
                   round(m.mlp_bytes * n) * ("mlp" in m.recompute_modules))
    layer = round(m.layer_bytes * n) + attention + derived_kv_bytes(m, prefix)
    chunk_input = n * m.hidden * m.dtype_bytes
    worst = 0
    for lists in ((2, 1), (0,)) if m.trained_loops else ((0,),):
        freed = 0  # what the backward has freed of the lists after the chunk (last loop)
        for which in lists:
            for start, end, checkpointed in reversed(m.chunks[which]):
                rebuilt = (end - start) * layer - chunk_input if end > start else 0
                if checkpointed:
                    worst = max(worst, rebuilt - freed)
                freed += chunk_input if checkpointed else rebuilt
    return worst


CALIBRATION_TOKENS = (8, 16)
"""Token counts of the calibration forwards (one row each): two, so that a fixed cost per call
does not count as a cost per token."""

_CALIBRATIONS = weakref.WeakKeyDictionary()  # model -> {(dtype, device): measured fields}


def calibration(model) -> dict:
    """``ModelShape``'s measured fields of ``model`` (``token_bytes``, ``layer_bytes``,
    ``mlp_bytes``): measured once per (model, dtype, device)."""
    p = next(model.parameters())
    cached = _CALIBRATIONS.setdefault(model, {})
    key = (p.dtype, p.device)
    if key not in cached:
        with _config_as(model.config, looped_backprop_loops=0):  # every loop measured
            cached[key] = _calibrate(model)
    return cached[key]


def _calibrate(model) -> dict:
    """The measured fields: bytes per token under the model's recompute setting; under
    ``full`` recompute also without it (what a recomputed layer saves, ``layer_bytes``); under
    ``selective`` with ``mlp`` one MLP's saves (``mlp_bytes``)."""
    m = ModelShape.uncalibrated(model, 1)
    ours = _token_bytes(model)
    fields = dict(token_bytes=ours)
    checkpointed = [end - start for chunks in m.chunks for start, end, ck in chunks if ck]
    if checkpointed:  # the prelude's and one loop's chunks
        with _config_as(model.config, recompute_granularity=None):
            plain = _token_bytes(model)
        rebuilt = plain[0] + plain[1] - ours[0] - ours[1]  # sum over chunks of k layers - input
        inputs = len(checkpointed) * m.hidden * m.dtype_bytes
        fields["layer_bytes"] = (rebuilt + inputs) / sum(checkpointed)
    if "mlp" in m.recompute_modules:
        fields["mlp_bytes"] = _mlp_bytes(model, m)
    return fields


def _token_bytes(model) -> tuple:
    """``ModelShape.token_bytes``: saved bytes per token of (the embedding and prelude, a
    loop, a loop's readout, what two readouts share), from causal forwards of 1 and 2 loops
    with and without readouts: what the probe measures less the attention kernels' own model
    and the token ids."""
    f1, f2, r1, r2 = (_per_token(model, R, readout)
                      for R, readout in ((1, False), (2, False), (1, True), (2, True)))
    return (2 * f1 - f2, f2 - f1, r1 - f1, 2 * (r1 - f1) - (r2 - f2))


def _per_token(model, R: int, readout: bool) -> float:
    """Bytes per token of an R-loop forward beyond its attention calls and token ids: the
    slope between two lengths."""
    m = ModelShape.uncalibrated(model, R)
    lengths = [min(s, model.max_sequence_length) for s in CALIBRATION_TOKENS]
    if lengths[0] == lengths[1]:
        lengths[0] //= 2
    rest = []
    for s in lengths:
        attention = _attention_calls(m) * m.core_attention.saved_bytes(m, 1, s, "causal", 0)
        ids = s * INT64 * (1 + readout) + s * INT64 * (not m.rope_dim)  # ids, labels, positions
        rest.append(_measured_forward(model, R, s, readout) - attention - ids)
    return (rest[1] - rest[0]) / (lengths[1] - lengths[0])


def _mlp_bytes(model, m: ModelShape) -> float:
    """What a core layer's MLP saves per token beyond its input (what selective recompute
    rebuilds): its forward on two lengths under the probe."""
    mlp, device = model.decoder.layers[0].mlp, next(model.parameters()).device
    sizes = []
    for s in CALIBRATION_TOKENS:
        x = torch.zeros(s, 1, m.hidden, dtype=next(model.parameters()).dtype, device=device,
                        requires_grad=True)
        with torch.enable_grad(), SavedTensorProbe(model) as probe:
            mlp(x)
        probe.release()
        sizes.append(probe.peak_bytes)
    per_token = (sizes[1] - sizes[0]) / (CALIBRATION_TOKENS[1] - CALIBRATION_TOKENS[0])
    return per_token - m.hidden * m.dtype_bytes


@contextlib.contextmanager
def _config_as(config, **fields):
    """``config`` with ``fields`` set for the block (the model's modules share it)."""
    old = {name: getattr(config, name) for name in fields}
    for name, value in fields.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(config, name, value)


def _measured_forward(model, R: int, s: int, readout: bool) -> int:
    """Peak saved bytes of a training-mode forward of one row of ``s`` tokens, R loops; the
    labels are a tensor of their own, as a group's are. Leaves the model and RNGs as they were."""
    device = next(model.parameters()).device
    tokens = torch.zeros(1, s, dtype=torch.long, device=device)
    labels = torch.zeros_like(tokens) if readout else None
    training = model.training
    model.train()
    try:
        with (torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
              _flash_on_meta(device), torch.enable_grad(), SavedTensorProbe(model) as probe):
            model(tokens, labels=labels, readout=readout, num_loops=R)
        probe.release()
        return probe.peak_bytes
    finally:
        model.train(training)


@contextlib.contextmanager
def _flash_on_meta(device):
    """On ``meta`` (a model sized for a GPU, no GPU here) plain SDPA would run its math
    kernel and save the scores; a GPU (flash in half precision, memory-efficient in fp32) and
    a CPU (its flash kernel) save no scores: calls without a mask go to the flash op (whose
    ``meta`` kernel saves q, k, v, the output and the log-sum-exp)."""
    if device.type != "meta":
        yield
        return
    plain = torch.nn.functional.scaled_dot_product_attention

    def flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if attn_mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return plain(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                     scale=scale, **kw)

    torch.nn.functional.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = plain


# ---- the pieces of a step -------------------------------------------------------------------


def prefix_bytes(m: ModelShape, P: int) -> int:
    """Storage of the prefix-state K/V recorded without a graph (K and V of every depth in
    storage of their own, ``kv.own``)."""
    return m.depths * P * m.state_width * m.dtype_bytes


def graph_free_prefix_bytes(m: ModelShape, P: int) -> int:
    """The part of ``prefix_bytes`` at the depths of graph-free loops (truncated backprop):
    computed under no_grad, so no prompt graph holds it."""
    return prefix_bytes(m, P) * (m.depths - m.trained_depths) // m.depths


def wave_bytes(m: ModelShape, P: int, S: int, W: int,
               loss_per_position: Optional[float], readout: bool = True) -> int:
    """One wave against the prefix state (the prefix K/V storage not included); ``readout``
    False: without its readouts and loss (what its backward holds once they are done)."""
    total = 2 * W * S * INT64  # the wave's token and label ids
    if readout:
        total += _boundary_bytes(m, W) + _loss_bytes(m, W, P + S, loss_per_position)
    if S > 1:
        total += block_bytes(m, W, S - 1, m.prefix_attention, prefix=P, readout=readout)
        total += (S - 1) * INT64 * (not m.rope_dim)  # positions
    return total


def _boundary_bytes(m: ModelShape, rows: int) -> int:
    """The readout of a path's last position for ``rows`` first labels: its final norm per
    trained loop, and each row's log-probs over the vocabulary per loop."""
    k = m.trained_loops  # loops whose boundary readout builds a graph
    return k * m.hidden * m.dtype_bytes * 2 + k * 2 * m.acc_bytes + (
        rows * m.loops * m.vocab * m.acc_bytes)


def naive_bytes(m: ModelShape, T: int, rows: int, loss_per_position: Optional[float],
                readout: bool = True) -> int:
    """One naive microbatch of ``rows`` full sequences of length T (``readout``: as in
    ``wave_bytes``)."""
    ids = 2 * rows * T * INT64 + T * INT64 * (not m.rope_dim)  # ids, labels, positions
    loss = _loss_bytes(m, rows, T, loss_per_position) if readout else 0
    return block_bytes(m, rows, T, "causal", readout=readout) + ids + loss


def _backward_peak(m: ModelShape, forward: int, rows: int, s: int, kind: str,
                   prefix: int = 0) -> int:
    """Under activation recompute, a graph's backward: what its forward saved less its
    readouts and loss (done first), plus the largest working set it recomputes less what the
    backward freed before (``recompute_bytes``)."""
    if m.recompute is None:
        return 0
    return forward + recompute_bytes(m, rows, s, kind, prefix)


def _recomputed_kv_bytes(m: ModelShape, P: int, width: int) -> int:
    """The prefix K/V (``width`` bytes per element) a recomputing forward saves as inputs of
    its checkpoints beyond an attention's own saves: ``full`` chunks take the K/V of their
    depths; a ``selective`` core attention those of every depth (concat, whose own
    concatenation is then not saved)."""
    per_depth = P * m.state_width * width
    if m.recompute == "full":
        ck = [sum(end - start for start, end, c in chunks if c) for chunks in m.chunks]
        return (ck[0] + m.trained_loops * (ck[1] + ck[2])) * per_depth
    if "core_attn" in m.recompute_modules and m.prefix_attention == "concat":
        return m.trained_depths * per_depth * (m.state_kind == "kv")  # inputs: derived
    return 0


def _loss_bytes(m: ModelShape, rows: int, T: int, per_position: Optional[float]) -> int:
    """What the caller's loss saves: ``per_position`` accumulator tensors of [R, rows, T]."""
    if per_position is None:
        raise ValueError(NEEDS_LOSS_BYTES)
    return int(per_position * m.loops * rows * T * m.acc_bytes)


def _kv_numel(m: ModelShape, P: int) -> int:
    """Elements of the prefix K/V that are grad leaves (the trained depths')."""
    return m.trained_depths * P * m.state_width


def adjoint_bytes(m: ModelShape, P: int) -> int:
    """Prefix adjoints: the gradients of the state's leaves, which are at least fp32."""
    return (_kv_numel(m, P) + m.loops * m.hidden) * m.acc_bytes


# ---- whole steps ----------------------------------------------------------------------------


NEEDS_LOSS_BYTES = ("a memory prediction needs loss_per_position: the number of accumulator "
                    "tensors of shape [R, rows, T] the caller's loss saves for backward (the "
                    "loss's own figure, e.g. its saved_per_position)")


def segment_moments(m: ModelShape, P: int, segments: int, group_tokens: int) -> int:
    """The largest moment of a subdivided prompt's replays: one segment's graph (or under
    recompute its backward's peak) beside the K/V leaves it reads (the first reads none)."""
    worst = 0
    for start, end in _largest_segments(segment_bounds(P, segments)):
        held = 0 if start == 0 else _leaf_read_bytes(m, P)  # read and saved through views
        kind = "causal" if start == 0 else m.prefix_attention
        graph = segment_bytes(m, start, end, group_tokens)
        worst = max(worst, held + graph,
                    held + _backward_peak(m, graph, 1, end - start, kind, start))
    return worst


def _leaf_read_bytes(m: ModelShape, P: int) -> int:
    """What a forward against a subdivided prompt's K/V leaves saves of them: their storage
    at the trained depths under cascade attention (graph-free loops read theirs without
    saving), at least what recomputing checkpoints take."""
    reads = m.prefix_attention == "cascade" or m.state_kind == "inputs"
    trained = _kv_numel(m, P) * m.leaf_read_bytes if reads else 0
    return max(trained, _recomputed_kv_bytes(m, P, m.acc_bytes))


def segment_counts(P: int) -> list:
    """The prompt segment counts a planner tries, fewest first: 2, 4, 8, ..., then P."""
    counts, n = [], 2
    while n < 2 * P:
        counts.append(min(n, P))
        n *= 2
    return counts


def _largest_segments(bounds: list) -> list:
    """The segments whose replay can hold the most: the first (causal, no prefix), and of the
    others the first, the last long one and the last (a segment's bytes grow with its length
    and with its prefix; the longer segments come first)."""
    long = max(k for k, (s, e) in enumerate(bounds) if e - s == bounds[0][1] - bounds[0][0])
    return [bounds[k] for k in sorted({0, 1, long, len(bounds) - 1}) if k < len(bounds)]


def segment_bytes(m: ModelShape, start: int, end: int, group_tokens: int) -> int:
    """A prompt segment's replay graph (positions ``start`` .. ``end`` against the earlier
    ones; the prefix K/V storage not included); ``group_tokens``: the group's token ids,
    whose storage its slice keeps."""
    kind = "causal" if start == 0 else m.prefix_attention
    ids = group_tokens * INT64 + (end - start) * INT64 * (not m.rope_dim)  # ids, positions
    return block_bytes(m, 1, end - start, kind, prefix=start, readout=False) + ids


def naive_memory(m: ModelShape, P: int, S: int, G: int, micro_batch_size: int,
                 loss_per_position: Optional[float] = None) -> MemoryEstimate:
    """Peak memory of naive training of one group in microbatches of full sequences."""
    rows = min(micro_batch_size, G)
    peak = max(naive_bytes(m, P + S, rows, loss_per_position),
               _backward_peak(m, naive_bytes(m, P + S, rows, loss_per_position, readout=False),
                              rows, P + S, "causal"))
    return MemoryEstimate(saved_bytes=peak, activation_bytes=peak, adjoint_bytes=0)


def plan_memory(m: ModelShape, P: int, S: int, G: int, plan: GroupPlan,
                checkpoint_waves: bool = False,
                loss_per_position: Optional[float] = None) -> MemoryEstimate:
    """Peak memory of one-level group (prompt P, G responses of <= S tokens) by ``plan``: a
    naive plan's microbatches, or the tree walk of its depth-1 tree (``tree_memory``)."""
    if plan.naive:
        return naive_memory(m, P, S, G, plan.wave_size, loss_per_position)
    return tree_memory(m, flat_tree(P, P + S, G), plan, [False] * (G + 1), loss_per_position,
                       checkpoint_waves)


# ---- trees ----------------------------------------------------------------------------------
#
# A tree group (``tree_schedule.TreeReplay``) holds, at any moment, the retained graphs of the
# nodes on the current root-to-leaf path whose chains have not been replayed, plus one working
# set: a leaf wave (phase 2), or a replay (its chain's recomputed graphs and its last wave).
# ``tree_memory`` walks the tree in the schedule's order and takes the worst moment; adjoints
# are those of the worst path's nodes that train a unit before their replay. Each forward is
# priced by the one-level pieces (``_block``, ``wave_bytes``) against its prefix length;
# cascade attention also saves the prefix K/V it reads (the root's: views of its qkv output,
# or its own K/V where it was recorded without a graph; a deeper path's: its concatenation).


def _path_kv_bytes(m: ModelShape, P: int, width: int) -> int:
    """The K/V of P path positions at the trained depths (graph-free loops save nothing),
    ``width`` bytes per element."""
    return _kv_numel(m, P) * width


def _chain_top(tree, n: int) -> int:
    while chain_parent(tree, n) is not None:
        n = chain_parent(tree, n)
    return n


def _read_prefix_bytes(m: ModelShape, tree, n: int, via_chain: bool,
                       root_retained: bool, segmented: bool = False) -> int:
    """What a cascade forward against node n's path saves of the path's K/V storage.
    ``via_chain``: the path of a replay chain (the chain's states), else n's leaves. The root's
    alone: its graph's qkv output (in its chain; its leaves when retained and as wide), its
    no-grad K/V, or fp32 leaf copies of a narrower state. A deeper path is a
    concatenation (new storage), fp32 where it holds fp32 leaves of a narrower model. Under
    activation recompute, at least the K/V its checkpoints take (``_recomputed_kv_bytes``),
    which a recomputing graph of the root does not hold. ``segmented``: the root's prompt is
    replayed in segments (its state is leaves throughout)."""
    P, wide = tree.ends[n], m.acc_bytes != m.dtype_bytes
    root = tree.parents[n] < 0
    if segmented and root:
        return _leaf_read_bytes(m, P)
    via_chain = via_chain and not segmented
    leaves = not via_chain if root else not via_chain or _chain_top(tree, n) != 0
    inputs = _recomputed_kv_bytes(m, P, m.acc_bytes if leaves and wide else m.dtype_bytes)
    if m.prefix_attention != "cascade" and m.state_kind == "kv":
        return inputs
    if root:
        if via_chain:
            return inputs
        if wide:
            return max(_path_kv_bytes(m, P, m.leaf_read_bytes), inputs)
        cascade = 0 if root_retained else prefix_bytes(m, P) - graph_free_prefix_bytes(m, P)
        return max(cascade, inputs)
    return max(_path_kv_bytes(m, P, m.leaf_read_bytes if leaves else m.dtype_bytes), inputs)


def tree_node_bytes(m: ModelShape, tree, n: int, has_loss: bool, root_retained: bool,
                    loss_per_position: Optional[float], segmented: bool = False) -> int:
    """Node n's own forward with grad against its ancestors (and its own-token loss)."""
    L, start = tree.ends[n] - tree.starts[n], tree.starts[n]
    positions = L * INT64 * (not m.rope_dim)
    if tree.parents[n] < 0:  # the prompt: its ids a view of the group's [G, T] ids
        ids = len(tree.leaf_of_row) * max(tree.ends) * INT64
        return block_bytes(m, 1, L, "causal", readout=False) + ids + positions
    total = block_bytes(m, 1, L, m.prefix_attention, prefix=start, readout=has_loss)
    total += L * INT64 + positions  # token ids
    via_chain = chain_parent(tree, n) is not None
    total += _read_prefix_bytes(m, tree, tree.parents[n], via_chain, root_retained, segmented)
    if has_loss:  # the first label from the parent's boundary; the loss over the rows below
        total += _boundary_bytes(m, 1) + L * INT64
        total += _loss_bytes(m, len(tree.rows_below(n)), L, loss_per_position)
    return total


def tree_wave_bytes(m: ModelShape, tree, n: int, leaves: list, last: bool, root_retained: bool,
                    loss_per_position: Optional[float], segmented: bool = False) -> int:
    """A wave of node n's leaf children ``leaves`` against n's path (``last``: n's last unit,
    in its replay chain; else against n's leaves); under activation recompute the larger of
    its forward and its backward (``_backward_peak``)."""
    P, W = tree.ends[n], len(leaves)
    S = max(tree.ends[c] for c in leaves) - P
    wave = wave_bytes(m, P, S, W, loss_per_position)  # its loss over the group layout [P + S]
    if tree.depth > 1:  # a deeper tree's loss: over the wave's span
        wave += _loss_bytes(m, W, S, loss_per_position) - _loss_bytes(m, W, P + S,
                                                                      loss_per_position)
    back = _backward_peak(m, wave_bytes(m, P, S, W, loss_per_position, readout=False), W,
                          S - 1, m.prefix_attention, P)
    return max(wave, back) + _read_prefix_bytes(m, tree, n, last, root_retained, segmented)


def _tree_node_recompute_bytes(m: ModelShape, tree, n: int) -> int:
    """What node n's own graph recomputes in its backward (``recompute_bytes``)."""
    if m.recompute is None:
        return 0
    L, start = tree.ends[n] - tree.starts[n], tree.starts[n]
    kind = "causal" if tree.parents[n] < 0 else m.prefix_attention
    return recompute_bytes(m, 1, L, kind, start)


def _checkpoint_input_bytes(m: ModelShape, tree, n: int, last: bool,
                            root_retained: bool, segmented: bool = False) -> int:
    """What a checkpointed wave against node n's path saves: its inputs, the whole path state
    (every depth; a graph holding the root's trained depths already has them)."""
    P = tree.ends[n]
    free = (m.depths - m.trained_depths) * P * m.state_width * m.dtype_bytes
    last = last and not segmented
    if segmented and tree.parents[n] < 0:
        return _path_kv_bytes(m, P, m.acc_bytes) + free
    if tree.parents[n] < 0:
        if last or (root_retained and m.acc_bytes == m.dtype_bytes):
            return graph_free_prefix_bytes(m, P)
        if m.acc_bytes != m.dtype_bytes:
            return _path_kv_bytes(m, P, m.acc_bytes) + graph_free_prefix_bytes(m, P)
        return prefix_bytes(m, P)
    leaves = not last or _chain_top(tree, n) != 0
    return _path_kv_bytes(m, P, m.acc_bytes if leaves else m.dtype_bytes) + free


def tree_memory(m: ModelShape, tree, plan: GroupPlan, has_loss: list,
                loss_per_position: Optional[float] = None,
                checkpoint_waves: bool = False, cache: Optional[dict] = None) -> MemoryEstimate:
    """Peak memory of joint replay of a tree group by ``plan`` (its per-node retain choice);
    ``has_loss``: per node, whether any of its tokens is trained. Checkpointed waves save
    their inputs; what they recompute in their backward counts in ``activation_bytes``.
    ``cache``: a dict kept across calls on the same (m, tree, has_loss, loss, waves) to
    reuse the bytes of each node and wave (a planner's search)."""
    retained = plan.node_retained(tree.num_nodes)
    W, root, split = plan.wave_size, retained[0], plan.prompt_segments > 1
    m = replace(m, state_kind=plan.state_kind)
    cache = {} if cache is None else cache.setdefault(plan.state_kind, {})

    def memo(key, compute) -> int:
        if key not in cache:
            cache[key] = compute()
        return cache[key]

    node = {n: memo(("node", n, root, split), lambda n=n: tree_node_bytes(
        m, tree, n, has_loss[n], root, loss_per_position, split)) for n in tree.inner_nodes}

    node_recompute = {n: memo(("recompute", n), lambda n=n: _tree_node_recompute_bytes(
        m, tree, n)) for n in node}
    units_of = memo(("units", W), lambda: {  # internal children, then leaf waves (tuples)
        n: [*tree.inner_children(n), *tree.leaf_waves(n, W)] for n in range(tree.num_nodes)})

    def full(n, leaves, last) -> int:
        return memo(("wave", n, leaves, last, root, split), lambda: tree_wave_bytes(
            m, tree, n, leaves, last, root, loss_per_position, split))

    def wave(n, leaves, last, visible) -> int:
        if not checkpoint_waves:
            return full(n, leaves, last)
        saved = _checkpoint_input_bytes(m, tree, n, last, root, split)
        return saved + (0 if visible else full(n, leaves, last))

    def peak(visible: bool) -> int:
        worst = 0

        def descend(n: int, held: int) -> tuple:
            """-> (held after n's descent, the chain's recomputed bytes, its last wave's, the
            largest working set a chain node's graph recomputes in its backward)."""
            nonlocal worst
            held += node[n] if retained[n] else 0
            units = units_of[n]
            for unit in units[:-1]:
                if isinstance(unit, tuple):
                    worst = max(worst, held + wave(n, unit, False, visible))
                else:
                    train(unit, held)
            last = units[-1]
            rebuilt = 0 if split and n == 0 else node_recompute[n]  # the root: in segments
            recomputed = 0 if retained[n] or (split and n == 0) else node[n]
            if isinstance(last, tuple):
                return held, recomputed, wave(n, last, True, visible), rebuilt
            held, below, last_wave, deeper = descend(last, held)
            return held, recomputed + below, last_wave, max(rebuilt, deeper)

        def train(n: int, held: int) -> None:
            """The chain's replay: its last wave, then (the wave done) each node's backward,
            the graphs of the chain still held (an upper bound)."""
            nonlocal worst
            top, recomputed, last_wave, rebuilt = descend(n, held)
            worst = max(worst, top + recomputed + max(last_wave, rebuilt))

        train(0, 0)
        if split:  # the root's segments, after every other replay
            worst = max(worst, segment_moments(m, tree.ends[0], plan.prompt_segments,
                                               len(tree.leaf_of_row) * max(tree.ends)))
        return worst

    adjoints = memo(("adjoints", W, split), lambda: max(
        sum(adjoint_bytes(m, tree.ends[a] - tree.starts[a]) for a in _ancestors(tree, leaf)
            if len(units_of[a]) > 1 or (split and a == 0)) for leaf in tree.leaf_of_row))
    return MemoryEstimate(saved_bytes=peak(True), activation_bytes=peak(False),
                          adjoint_bytes=adjoints)


def _node_flops(m: ModelShape, tree, n: int, has_loss: bool) -> float:
    """Forward FLOPs of node n's own state (what recomputing it costs again)."""
    L, start = tree.ends[n] - tree.starts[n], tree.starts[n]
    return pass_flops(m, 1, L, start, readout=has_loss)


def _ancestors(tree, n: int) -> list:
    out = []
    while tree.parents[n] >= 0:
        n = tree.parents[n]
        out.append(n)
    return out


# ---- time -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Predicted step time = ``call_s`` x layer calls + ``flop_s`` x FLOPs (forward 1,
    backward 2; attention counted over the causal pairs). On CPU the fixed cost of a call
    is what makes many small waves slower than their FLOPs (short prompts)."""

    call_s: float
    """Seconds per layer application (forward or backward), independent of its size."""

    flop_s: float
    """Seconds per FLOP."""

    def joint_time(self, m: ModelShape, P: int, S: int, G: int, plan: GroupPlan,
                   checkpoint_waves: bool = False) -> float:
        W, k = min(plan.wave_size, G), plan.prompt_segments
        n = -(-G // W)
        recomputed = not plan.retain and (n > 1 or k > 1)
        prompt_passes = 4 if recomputed else 3  # forward(s) + backward (2)
        wave_passes = 4 if checkpoint_waves else 3
        flops = (prompt_passes * pass_flops(m, 1, P, 0)
                 + wave_passes * pass_flops(m, G, S, P, readout=True))
        if plan.state_kind == "inputs":  # every wave and later segment derives the K/V
            flops += (n * wave_passes + 2 * (k - 1)) * derive_flops(m, P)
        prompt_calls = 3 * k if k > 1 else 2 + recomputed  # per segment: forward twice, backward
        calls = (n * 2 + prompt_calls) * m.depths
        calls += n * m.depths * checkpoint_waves
        return self.call_s * calls + self.flop_s * flops

    def naive_time(self, m: ModelShape, P: int, S: int, G: int, micro_batch_size: int) -> float:
        n = -(-G // min(micro_batch_size, G))
        flops = 3 * pass_flops(m, G, P + S, 0, readout=True)
        return self.call_s * 2 * n * m.depths + self.flop_s * flops

    def time(self, m: ModelShape, P: int, S: int, G: int, plan: GroupPlan,
             checkpoint_waves: bool = False) -> float:
        if plan.naive:
            return self.naive_time(m, P, S, G, plan.wave_size)
        return self.joint_time(m, P, S, G, plan, checkpoint_waves)

    @classmethod
    def calibrate(cls, model, shapes: tuple = ((1, 2), (4, 128)),
                  repetitions: int = 5) -> "CostModel":
        """Time forward + backward of a tiny and a larger batch (rows, tokens; tokens capped
        by the position table) on ``model``, interleaved, fastest of ``repetitions`` each (a
        busy host only ever slows a run down), and solve for the two constants. Gradients are
        computed, not accumulated (``_time_step``)."""
        m = ModelShape.from_model(model)
        device = next(model.parameters()).device
        batches = [torch.randint(0, m.vocab, (rows, min(s, model.max_sequence_length)),
                                 device=device) for rows, s in shapes]
        best = [math.inf] * len(batches)
        for rep in range(repetitions + 1):  # the first round warms up
            for i, tokens in enumerate(batches):
                t = _time_step(model, tokens)
                best[i] = min(best[i], t) if rep else best[i]
        (c1, f1), (c2, f2) = [(2 * m.depths, 3 * pass_flops(m, *b.shape, 0, readout=True))
                              for b in batches]
        (t1, t2), det = best, c1 * f2 - c2 * f1
        flop_s = max((c1 * t2 - c2 * t1) / det, 0.0) if det else 0.0
        call_s = max((t1 - flop_s * f1) / c1, 0.0)
        return cls(call_s=call_s, flop_s=flop_s)


def shared_cost_model(model) -> CostModel:
    """``CostModel.calibrate(model)`` measured on rank 0 and broadcast, so every rank plans
    alike (every rank of the job: the ranks of a tensor-parallel group must run the same
    schedule too, so the data-parallel size does not decide)."""
    cost = CostModel.calibrate(model)
    device = next(model.parameters()).device
    values = torch.tensor([cost.call_s, cost.flop_s], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(values, src=0)
    return CostModel(call_s=float(values[0]), flop_s=float(values[1]))


def derive_flops(m: ModelShape, P: int) -> float:
    """Forward FLOPs of projecting P prefix positions' K/V (and queries: the layer's own
    projection) from a state of kind ``inputs`` at every depth."""
    return m.depths * 2 * P * m.hidden * m.qkv_width


def pass_flops(m: ModelShape, rows: int, s: int, prefix: int, readout: bool = False) -> float:
    """Forward FLOPs of ``rows`` x ``s`` tokens through every layer application (causal
    attention over ``prefix`` + own keys) and, optionally, the readouts."""
    hn, H = m.kv_channels, m.hidden
    per_token = 2 * (H * m.qkv_width + m.heads * hn * H + H * m.ffn * (1 + m.gated) + m.ffn * H)
    pairs = rows * (s * prefix + s * (s + 1) / 2)
    flops = m.depths * (rows * s * per_token + 4 * m.heads * hn * pairs)
    if readout:
        flops += m.loops * rows * s * 2 * H * m.vocab
    return flops


def _time_step(model, tokens) -> float:
    """Seconds of one forward + backward. ``autograd.grad`` computes the parameter gradients
    without accumulating them: ``.grad``, DDP's grad buffers and its hooks are untouched. On
    CUDA the clock brackets the kernels, not their launches (a device sync on both sides).
    In eval mode: without activation recompute (whose MCore checkpoint refuses
    ``autograd.grad``), the three passes the FLOP count prices."""
    params = [p for p in model.parameters() if p.requires_grad]
    sync = torch.cuda.synchronize if tokens.is_cuda else (lambda: None)
    training = model.training
    model.eval()
    sync()
    start = time.perf_counter()
    try:
        with torch.enable_grad():  # also when the first plan is made while scoring
            loss = model(tokens, labels=tokens).logprobs.sum()
            torch.autograd.grad(loss, params, allow_unused=True)
        sync()
        return time.perf_counter() - start
    finally:
        model.train(training)


# ---- choosing a plan ------------------------------------------------------------------------


def _check_segments(segments, prompt: str) -> None:
    if segments == "auto":
        return
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise FieldError("prompt_segments", f"must be an integer >= 1 or 'auto', got "
                         f"{segments!r}")
    if segments > 1 and prompt == "retain":
        raise FieldError("prompt_segments", f"{segments} replays the prompt in segments, which "
                         f"recomputes it: it cannot go with prompt 'retain'")


def _check_wave_size(wave_size) -> None:
    if wave_size == "auto":
        return
    if isinstance(wave_size, bool) or not isinstance(wave_size, int):
        raise FieldError("wave_size", f"must be an integer >= 1 or 'auto', got {wave_size!r}")
    if wave_size < 1:
        raise FieldError("wave_size", f"must be >= 1, got {wave_size}")



class Planner:
    """Picks a ``GroupPlan`` per group (the schedule's ``chooser``).

    wave_size: an integer, or "auto": the largest wave whose predicted peak (activations plus
        prefix adjoints) fits ``memory_budget`` bytes, recompute where retain does not fit.
    prompt: "retain", "recompute", or "auto" (retain unless only recompute fits the budget).
        A tree group (depth >= 2, an integer ``wave_size``): "retain" / "recompute" every
        node; "auto" without a budget retains every node, with one chooses per node
        (``_tree_greedy`` on ``tree_memory``), a budget below recomputing every node an error.
    schedule: "joint_replay"; "naive": every group as full sequences in microbatches of
        ``naive_micro_batch_size`` (or the largest that fits); or "auto": joint replay or
        naive by ``cost_model``'s time.
    cost_model: a ``CostModel``, or a function ``model -> CostModel`` called at the first plan
        (e.g. ``shared_cost_model``).
    loss_per_position: the caller's loss's saved accumulator tensors of [R, rows, T] per
        position (needed with a memory budget); the planner knows no loss.
    prompt_segments: an integer: a group's prompt (a tree's root) replayed in that many query
        segments (> 1: the prompt recomputed); "auto": one, or where no plan fits the budget
        otherwise the fewest segments (a power of two) with which one does, at the largest
        wave that fits with them (a tree: its nodes below the root retained as they fit).
    state_kind: what prefix states keep (``GroupPlan.state_kind``), "kv", "inputs", or
        "auto": the whole search with K/V, and where nothing fits the budget, again with
        inputs.
    """

    def __init__(self, wave_size, prompt: str = DEFAULT_PROMPT,
                 memory_budget: Optional[float] = None, schedule: str = "joint_replay",
                 cost_model: Optional[CostModel] = None, checkpoint_waves: bool = False,
                 naive_micro_batch_size: Optional[int] = None,
                 loss_per_position: Optional[float] = None, prompt_segments=DEFAULT_SEGMENTS,
                 state_kind: str = DEFAULT_STATE):
        _check_wave_size(wave_size)
        if state_kind not in STATE_KINDS:
            raise FieldError("state_kind", f"must be one of {STATE_KINDS}, got {state_kind!r}")
        _check_segments(prompt_segments, prompt)
        if prompt not in PROMPT_MODES + ("auto",):
            raise FieldError("prompt", f"must be one of {PROMPT_MODES + ('auto',)}, got {prompt!r}")
        if schedule not in SCHEDULES:
            raise FieldError("schedule", f"must be one of {SCHEDULES}, got {schedule!r}")
        if wave_size == "auto" and memory_budget is None:
            raise FieldError("memory_budget", "must be set when the wave size is 'auto'")
        if memory_budget is not None and memory_budget <= 0:
            raise FieldError("memory_budget", f"must be > 0, got {memory_budget:g} bytes "
                             f"({memory_budget / 2**20:g} MiB)")
        if schedule == "auto" and cost_model is None:
            raise FieldError("schedule", "'auto' needs a cost model (CostModel.calibrate(model))")
        if memory_budget is not None and loss_per_position is None:
            raise ValueError(f"a memory budget: {NEEDS_LOSS_BYTES}")
        self.wave_size, self.prompt, self.budget = wave_size, prompt, memory_budget
        self.schedule, self.cost_model = schedule, cost_model
        self.checkpoint_waves = checkpoint_waves
        self.naive_micro_batch_size = naive_micro_batch_size
        self.loss_per_position = loss_per_position
        self.prompt_segments = prompt_segments
        self.state_kind = state_kind
        self._kind = None  # during a search: the state kind its plans are priced with

    def __call__(self, group, model, num_loops: Optional[int] = None) -> GroupPlan:
        """The plan of ``group`` on ``model`` running ``num_loops`` loops (None: the config's):
        the search under each state kind it may choose, K/V first (``_kinds``)."""
        self._check_recompute(model)
        error = None
        for kind in self._kinds():
            self._kind = kind
            try:
                plan = self._plan(group, model, num_loops)
            except ValueError as e:
                error = e  # the last kind's: the leanest plans
                continue
            finally:
                self._kind = None
            return plan if plan.naive else replace(plan, state_kind=kind)
        raise error

    def _kinds(self) -> tuple:
        if self.state_kind == "auto":
            return ("kv",) if self.budget is None else ("kv", "inputs")
        return (self.state_kind,)

    def _plan(self, group, model, num_loops) -> GroupPlan:
        P, S, G = group.prompt_length, group.response_length, group.group_size
        tree = getattr(group, "tree", None)
        if tree is not None and tree.depth > 1 and self.schedule != "naive":
            return self._tree(group, model, num_loops)
        if self.schedule == "joint_replay" and "auto" not in (self.wave_size, self.prompt,
                                                              self.prompt_segments):
            return self._fixed(min(self.wave_size, G))
        m = ModelShape.from_model(model, num_loops)
        if callable(self.cost_model) and not isinstance(self.cost_model, CostModel):
            self.cost_model = self.cost_model(model)  # calibrated at the first plan
        if self.schedule == "naive":
            return self._naive_or_raise(m, P, S, G, group.group_id)
        joint = self._joint(m, P, S, G, group.group_id)
        if self.schedule != "auto":
            return joint
        naive = self._naive(m, P, S, G)
        if naive is None:
            return joint
        cost = self.cost_model
        if cost.time(m, P, S, G, naive) < cost.time(m, P, S, G, self._priced(joint),
                                                     self.checkpoint_waves):
            return naive
        return joint

    def _check_recompute(self, model) -> None:
        """Under activation recompute the memory model holds (within 10%) for naive, one-level
        and tree joint replay; a budget is not planned with checkpointed waves there (what a
        checkpointed wave recomputes over recomputing layers is not modelled)."""
        granularity = getattr(model.config, "recompute_granularity", None)
        if (self.budget is not None and granularity is not None and self.checkpoint_waves
                and self.schedule != "naive"):
            raise FieldError("memory_budget", f"cannot plan checkpointed waves under activation "
                             f"recompute (recompute_granularity {granularity!r}) yet: its "
                             f"memory model does not hold there; give a wave size and no "
                             f"budget, or no checkpointed waves")

    def _tree(self, group, model, num_loops) -> GroupPlan:
        """A tree group's joint replay: waves of ``wave_size`` of each node's leaf children;
        per node, its graph retained or recomputed. ``prompt`` "retain" / "recompute": every
        node so (unchecked, as for a one-level group). "auto": without a budget every node
        retained (as a one-level group retains); with one, ``_tree_greedy`` at the largest
        wave (``wave_size`` "auto": a node's most leaf children down to 1) and the fewest
        root segments that fit; none fits: the error of the smallest wave with the whole
        root."""
        tree, G = group.tree, group.group_size
        widest = max(len(tree.leaf_children(n)) for n in tree.inner_nodes)
        widths = (range(widest, 0, -1) if self.wave_size == "auto"
                  else (min(self.wave_size, G),))
        segments = self.prompt_segments
        fixed = segments not in (1, "auto")
        if self.prompt != "auto" or self.budget is None:
            if self.wave_size == "auto":
                raise ValueError(f"group {group.group_id}: wave_size 'auto' of a tree group "
                                 f"(depth {tree.depth}) is planned with prompt 'auto' and a "
                                 f"memory budget")
            if fixed:
                return GroupPlan(widths[0], prompt_segments=segments)
            return GroupPlan(widths[0], retain=self.prompt != "recompute")
        m = ModelShape.from_model(model, num_loops)
        counts = [segments] if fixed else [1, *(segment_counts(group.prompt_length)
                                               if segments == "auto" else ())]
        error = None
        for n in counts:  # the fewest root segments, then the largest wave, that fit
            for W in widths:
                try:
                    return self._tree_greedy(m, group, W, n)
                except ValueError as e:
                    error = e if n == counts[0] else error  # the smallest wave's, whole root
        raise error

    def _tree_greedy(self, m: ModelShape, group, W: int, segments: int = 1) -> GroupPlan:
        """Start from recomputing every node (the least memory; below it: an error) and retain
        nodes one at a time, each round the one saving the most recompute FLOPs (its forward)
        per byte it adds to the predicted peak (``tree_memory``), among those that keep the
        peak within the budget and may be retained (a chain's retained nodes are its top),
        until none fits. Greedy, not optimal: a node that adds nothing to the peak is taken
        first (largest FLOPs first). ``segments`` > 1: the root's prompt replayed in that many
        segments (never retained)."""
        tree, has_loss = group.tree, nodes_with_loss(group)
        internal = [n for n in tree.inner_nodes if n or segments == 1]
        retained = [False] * tree.num_nodes

        def plan(flags) -> GroupPlan:
            if segments > 1:
                return GroupPlan(W, retain_nodes=tuple(flags), prompt_segments=segments)
            return GroupPlan(W, retain=all(flags[n] for n in internal),
                             retain_nodes=tuple(flags))

        cache = {}

        def peak(flags) -> int:
            return tree_memory(m, tree, self._priced(plan(flags)), has_loss,
                               self.loss_per_position, self.checkpoint_waves, cache).peak_bytes

        current = peak(retained)
        if current > self.budget:
            raise ValueError(
                f"group {group.group_id} (tree of {tree.num_nodes} nodes, depth {tree.depth}, "
                f"G={group.group_size}): no joint-replay plan fits the memory budget of "
                f"{self.budget / 2**20:.2f} MiB; the smallest (every node recomputed, wave "
                f"size {W}{f', {segments} prompt segments' if segments > 1 else ''}) needs "
                f"{current / 2**20:.2f} MiB")
        while True:
            best = None
            for n in internal:
                p = chain_parent(tree, n)
                if retained[n] or (p is not None and not retained[p]):
                    continue
                trial = [*retained[:n], True, *retained[n + 1:]]
                need = peak(trial)
                if need > self.budget:
                    continue
                flops = _node_flops(m, tree, n, has_loss[n])
                score = (flops / max(need - current, 1), flops)
                if best is None or score > best[0]:
                    best = (score, n, need)
            if best is None:
                return plan(retained)
            _, n, current = best
            retained[n] = True

    def memory(self, m: ModelShape, P: int, S: int, G: int, plan: GroupPlan) -> MemoryEstimate:
        """``plan_memory`` of ``plan`` (``_priced``)."""
        return plan_memory(m, P, S, G, self._priced(plan), self.checkpoint_waves,
                           self.loss_per_position)

    def _priced(self, plan: GroupPlan) -> GroupPlan:
        """``plan`` as a search prices it: a joint plan of the state kind searched (``_kind``);
        outside a search as it is."""
        if self._kind is None or plan.naive:
            return plan
        return replace(plan, state_kind=self._kind)

    def group_memory(self, m: ModelShape, group, plan: GroupPlan) -> MemoryEstimate:
        """``memory`` of ``group`` by ``plan``: a deeper tree's joint replay by its own walk."""
        tree = getattr(group, "tree", None)
        if plan.naive or tree is None or tree.depth == 1:
            return self.memory(m, group.prompt_length, group.response_length,
                               group.group_size, plan)
        return tree_memory(m, tree, plan, nodes_with_loss(group), self.loss_per_position,
                           self.checkpoint_waves)

    def _fits(self, m, P, S, G, plan) -> bool:
        return self.budget is None or self.memory(m, P, S, G, plan).peak_bytes <= self.budget

    def _modes(self) -> tuple:
        return {"retain": (True,), "recompute": (False,), "auto": (True, False)}[self.prompt]

    def _fixed(self, W: int) -> GroupPlan:
        """The plan of a given wave size, prompt mode and segment count."""
        if self.prompt_segments not in (1, "auto"):
            return GroupPlan(W, prompt_segments=self.prompt_segments)
        return GroupPlan(W, retain=self.prompt == "retain")

    def _joint(self, m, P, S, G, group_id) -> GroupPlan:
        if self.wave_size != "auto":
            W = min(self.wave_size, G)
            if self.prompt != "auto" or self.prompt_segments not in (1, "auto"):
                plan = self._fixed(W)
            else:
                plan = GroupPlan(W, retain=self._fits(m, P, S, G, GroupPlan(W, retain=True)))
            if self.prompt_segments == "auto" and not plan.retain and not self._fits(
                    m, P, S, G, plan):
                return self._subdivided(m, P, S, G, (W,)) or plan
            return plan
        for W in range(G, 0, -1):
            for plan in self._whole_prompt_plans(W):
                if self._fits(m, P, S, G, plan):
                    return plan
        if self.prompt_segments == "auto" and self.prompt != "retain":
            plan = self._subdivided(m, P, S, G, range(G, 0, -1))
            if plan is not None:
                return plan
        smallest = self._priced(self.smallest_plan(P))
        need = self.memory(m, P, S, G, smallest).peak_bytes
        raise ValueError(
            f"group {group_id} (P={P}, S={S}, G={G}): no joint-replay plan fits the memory "
            f"budget of {self.budget / 2**20:.2f} MiB; the smallest ({smallest}) needs "
            f"{need / 2**20:.2f} MiB")

    def smallest_plan(self, P: int) -> GroupPlan:
        """The one-level joint plan of the least memory this planner may choose: waves of 1,
        the prompt in P segments where it may subdivide, else recomputed where it may."""
        if self.prompt_segments == "auto" and self.prompt != "retain":
            return GroupPlan(1, prompt_segments=P) if P > 1 else GroupPlan(1)
        return self._whole_prompt_plans(1)[-1]

    def _whole_prompt_plans(self, W: int) -> list:
        if self.prompt_segments not in (1, "auto"):
            return [GroupPlan(W, prompt_segments=self.prompt_segments)]
        return [GroupPlan(W, retain=retain) for retain in self._modes()]

    def _subdivided(self, m, P, S, G, widths) -> Optional[GroupPlan]:
        """The fewest prompt segments (2, 4, 8, ... up to P) with which a wave of ``widths``
        (largest first) fits the budget, at the largest such wave; None if none does."""
        for n in segment_counts(P):
            for W in widths:
                plan = GroupPlan(W, prompt_segments=n)
                if self._fits(m, P, S, G, plan):
                    return plan
        return None

    def _naive_or_raise(self, m, P, S, G, group_id) -> GroupPlan:
        plan = self._naive(m, P, S, G)
        if plan is None:
            rows = self.naive_micro_batch_size or 1
            need = self.memory(m, P, S, G, GroupPlan(min(rows, G), naive=True)).peak_bytes
            raise ValueError(
                f"group {group_id} (P={P}, S={S}, G={G}): no naive microbatch of "
                f"{'<= ' if self.naive_micro_batch_size is None else ''}{rows} sequences fits "
                f"the memory budget of {self.budget / 2**20:.2f} MiB (it needs "
                f"{need / 2**20:.2f} MiB)")
        return plan

    def _naive(self, m, P, S, G) -> Optional[GroupPlan]:
        if self.naive_micro_batch_size is not None:
            plan = GroupPlan(min(self.naive_micro_batch_size, G), naive=True)
            return plan if self._fits(m, P, S, G, plan) else None
        for rows in range(G, 0, -1):
            plan = GroupPlan(rows, naive=True)
            if self._fits(m, P, S, G, plan):
                return plan
        return None
