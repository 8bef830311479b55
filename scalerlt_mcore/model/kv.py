"""Depth-indexed K/V: the prefix state of a prompt, the decoding cache, and the per-forward
context that routes every (loop, layer) position to its own K/V slot.

Virtual depth of a layer application: prelude layer p -> p; core layer l in loop r ->
n_prelude + r * (L_core + n_coda) + l; coda layer c after loop r -> the same base + L_core + c.
MCore keys inference caches by ``layer_number``; a core layer reused across loops has one
``layer_number`` but R depths, so every cache here is keyed by depth, never by layer number.

Under tensor parallelism every rank holds the K/V of its own query groups
(``kv_groups_per_rank``): prefix states, their adjoints and decoding caches are per rank.
"""

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
from torch import Tensor

from ..mcore_compat import mcore_workaround
from .host_syncs import mark_host


def config_signature(config) -> tuple:
    """The model's structure, whatever its parallel layout: loops and the global K/V shape."""
    return (
        config.looped_num_prelude_layers,
        config.num_layers,
        config.looped_num_coda_layers,
        config.looped_num_loops,
        config.num_query_groups or config.num_attention_heads,
        config.kv_channels,
        config.hidden_size,
    )


def state_signature(config) -> tuple:
    """What a per-rank prefix state or cache must agree with: the structure and the
    tensor-parallel size that splits its K/V groups."""
    return (*config_signature(config), config.tensor_model_parallel_size)


STATE_FIELDS = ("prelude", "core", "coda", "loops", "kv groups", "kv channels", "hidden",
                "tensor parallel")
"""Names of the entries of ``state_signature``."""

LOOPS = STATE_FIELDS.index("loops")
"""Index of the loop count R in a signature."""


def kv_groups_per_rank(config) -> int:
    """K/V groups (heads) held by one tensor-parallel rank."""
    groups = config.num_query_groups or config.num_attention_heads
    return groups // config.tensor_model_parallel_size


@dataclass
class PrefixState:
    """A prompt's state at every K/V boundary, for suffixes computed separately.

    keys/values: one per virtual depth, each [P, Bp, ng, hn] (post-RoPE keys; ng: this
                 tensor-parallel rank's K/V groups); empty when ``inputs`` holds the state.
    boundary:    [R, Bp, H], the readout input (pre-final-norm; with ``looped_normed_state``,
                 Ouro, the normed state) at the last prompt position for every loop: it
                 predicts the first suffix token.
    inputs:      None, or one per virtual depth [P, Bp, H]: the attention's input there, from
                 which a suffix's attention derives the prefix K/V again (the same projection,
                 norms and RoPE as the prompt's). Half the storage of K and V with MHA, and so
                 of their adjoints; each suffix pays the projection (``LoopedGPTModel.
                 forward``'s ``state_kind`` ``inputs``).
    """

    keys: list
    values: list
    boundary: Tensor
    signature: tuple
    inputs: Optional[list] = None

    @property
    def length(self) -> int:
        return self.tensors()[0].shape[0]

    @property
    def batch(self) -> int:
        return self.tensors()[0].shape[1]

    @property
    def num_loops(self) -> int:
        """R of the forward that computed the state (a suffix against it runs as many)."""
        return self.signature[LOOPS]

    def tensors(self) -> list:
        """All state tensors in a fixed order: keys, values (or the inputs), boundary."""
        per_depth = [*self.keys, *self.values] if self.inputs is None else self.inputs
        return [*per_depth, self.boundary]

    def at(self, depth: int) -> list:
        """The state tensors of one depth: [key, value] or [input]."""
        return [self.keys[depth], self.values[depth]] if self.inputs is None else [
            self.inputs[depth]]

    def like(self, tensors: list) -> "PrefixState":
        """A state of this one's kind and signature from ``tensors`` in ``tensors()``'s order."""
        if self.inputs is not None:
            return PrefixState([], [], tensors[-1], self.signature, list(tensors[:-1]))
        return PrefixState.from_tensors(tensors, self.signature)

    def with_depths(self, depths: list, tensors: list) -> "PrefixState":
        """This state with the tensors of ``depths`` replaced by ``tensors`` (``at``'s order,
        depth by depth)."""
        mine, per = self.tensors(), len(self.at(0))
        count = (len(mine) - 1) // per  # depths: ``tensors()`` holds ``per`` runs of them
        for i, d in enumerate(depths):
            for j in range(per):
                mine[j * count + d] = tensors[per * i + j]
        return self.like(mine)

    def depth_flags(self, trained: list) -> list:
        """``trained`` (one bool per depth) per state tensor but the boundary."""
        return [*trained, *trained] if self.inputs is None else list(trained)

    @classmethod
    def from_tensors(cls, tensors: list, signature: tuple) -> "PrefixState":
        depth = (len(tensors) - 1) // 2
        return cls(tensors[:depth], tensors[depth : 2 * depth], tensors[-1], signature)

    def detached_leaves(self, dtype: Optional[torch.dtype] = None,
                        trained: Optional[list] = None) -> "PrefixState":
        """A copy whose tensors are detached leaves that require grad (they collect adjoints).
        ``dtype``: each leaf is promoted to at least it (the same numbers, e.g. fp32 leaves of a
        bf16 state, so that the adjoints they collect are accumulated in fp32). ``trained``
        (one bool per depth, ``trained_depths``): a depth marked False is detached as it is,
        not a leaf and not promoted: nothing backpropagates into it, so it has no adjoint."""
        tensors = self.tensors()
        flags = (self.depth_flags(trained) if trained is not None
                 else [True] * (len(tensors) - 1))
        leaves = [_promoted(t.detach(), dtype).requires_grad_(True) if grad else t.detach()
                  for t, grad in zip(tensors, [*flags, True])]
        return self.like(leaves)

    def check_compatible(self, config) -> None:
        """Raise if this state was not produced by a model of ``config``'s structure."""
        expected = state_signature(config)
        if self.signature != expected:
            names = STATE_FIELDS
            diffs = ", ".join(f"{n} {a} != {b}" for n, a, b in zip(names, self.signature, expected)
                              if a != b)
            raise ValueError(
                f"prefix state comes from a different model config: {diffs} (prefix state vs "
                f"model; signature ({', '.join(names)}) = {self.signature}, model has {expected})"
            )
        depths = config.looped_num_depths
        if self.inputs is not None:
            self._check_inputs(config)
        elif len(self.keys) != depths or len(self.values) != depths:
            raise ValueError(
                f"prefix state has {len(self.keys)} key / {len(self.values)} value depths, "
                f"model needs {depths} (loops={config.looped_num_loops})"
            )
        kv_shape = (self.length, self.batch, kv_groups_per_rank(config), config.kv_channels)
        for d, (k, v) in enumerate(zip(self.keys, self.values)):
            if tuple(k.shape) != kv_shape or tuple(v.shape) != kv_shape:
                raise ValueError(
                    f"prefix state depth {d}: key {tuple(k.shape)} / value {tuple(v.shape)}, "
                    f"expected {kv_shape} [P, batch, kv groups on this rank, kv channels]"
                )
        b_shape = (config.looped_num_loops, self.batch, config.hidden_size)
        if tuple(self.boundary.shape) != b_shape:
            raise ValueError(
                f"prefix state boundary has shape {tuple(self.boundary.shape)}, "
                f"expected {b_shape} [loops, batch, hidden]"
            )

    def _check_inputs(self, config) -> None:
        depths, shape = config.looped_num_depths, (self.length, self.batch, config.hidden_size)
        if len(self.inputs) != depths:
            raise ValueError(f"prefix state has {len(self.inputs)} input depths, model needs "
                             f"{depths} (loops={config.looped_num_loops})")
        for d, x in enumerate(self.inputs):
            if tuple(x.shape) != shape:
                raise ValueError(f"prefix state depth {d}: input {tuple(x.shape)}, expected "
                                 f"{shape} [P, batch, hidden]")


def trained_depths(config) -> list:
    """Per virtual depth: whether a suffix's gradient reaches the prefix K/V there. False for
    the core and coda depths of loops that truncated backprop runs graph-free
    (``looped_backprop_loops``); prelude depths always train."""
    per_loop = config.num_layers + config.looped_num_coda_layers
    frozen = config.looped_num_graph_free_loops
    loops = [r >= frozen for r in range(config.looped_num_loops) for _ in range(per_loop)]
    return [True] * config.looped_num_prelude_layers + loops


def loop_of(config, depth: int) -> Optional[int]:
    """The loop (0-based) of a virtual depth; None for a prelude depth."""
    pre = config.looped_num_prelude_layers
    return None if depth < pre else (depth - pre) // (config.num_layers
                                                       + config.looped_num_coda_layers)


def exit_read(config, depth: int) -> Optional[int]:
    """The depth one loop earlier of the same layer, whose K/V a position that exited before
    ``depth``'s loop keeps there (``LoopKV.exit_kv``); None in the prelude and the first loop."""
    loop = loop_of(config, depth)
    return depth - config.num_layers - config.looped_num_coda_layers if loop else None


def own(t: Tensor) -> Tensor:
    """``t`` in a storage of its own size: a view into a larger one (a value, or an unrotated
    key, is a view of its depth's whole QKV output) is copied, so that keeping it does not keep
    the queries. A recorded graph holds that output anyway; a state recorded without one keeps
    only K and V (``LoopedSelfAttention``)."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _promoted(t: Tensor, dtype: Optional[torch.dtype]) -> Tensor:
    return t if dtype is None else t.to(torch.promote_types(t.dtype, dtype))


class DepthKVCache:
    """Decoding cache: per-depth K/V for a batch with per-sequence lengths.

    keys/values: [D, B, ng, T_max, hn] (ng: this tensor-parallel rank's K/V groups), on the
    model's device: each (row, K/V head)'s keys contiguous, the layout the attention kernels
    read (a masked grouped-query CPU SDPA at the decode bench's RL shape, one thread: 132 us
    over this layout, 206 us over MCore's [T, B, ng, hn]); ``write`` and ``read`` take and give
    MCore's layout; ``lengths[b]`` = tokens of sequence b in the cache, a long tensor on the
    *host*: the positions of every step are known there, so that reading them never waits for
    the device. A forward with this cache writes its new K/V at positions lengths[b] ...
    lengths[b]+s-1 and attends to every cached position <= the query's own.

    ``prefix`` (prompt-once decoding): a cache holding N prompts (right-padded, its ``lengths``
    the prompt lengths) that rows n*G ... n*G+G-1 of this cache continue, G = B / N. This cache
    then holds only the continuations' K/V (slot 0 = the first token after the prompt); every
    row reads its prompt's K/V from the single copy in ``prefix``. The prefix may itself
    continue a prefix (tree decoding): a chain of caches, one per level of a prefix tree, each
    row of a level continuing one row of the level above (``chain``); a row attends to its own
    K/V and to the K/V of each ancestor on its root-to-node path, every segment stored once.

    ``static``: attend to the whole preallocated cache (and prefix caches) under a mask, so that
    every decode step has the same shapes (what a CUDA graph needs); otherwise to the cache up
    to the longest row (host-known: no sync either, fewer keys). None: static on CUDA only
    (on CPU the shorter attention is faster; ``benchmarks/decode.py`` measures both).
    """

    def __init__(self, config, batch: int, max_length: int, dtype=None, device=None,
                 prefix: Optional["DepthKVCache"] = None, static: Optional[bool] = None):
        groups = kv_groups_per_rank(config)
        shape = (config.looped_num_depths, batch, groups, max_length, config.kv_channels)
        dtype = dtype or config.params_dtype
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = mark_host(torch.zeros(batch, dtype=torch.long, device="cpu"))
        self.signature = state_signature(config)
        self.prefix = prefix
        self.static = self.keys.device.type == "cuda" if static is None else bool(static)
        self.fresh = False
        """Set while ``prefill`` writes an emptied cache (every row's positions 0 ... T-1):
        attention is then plain causal over the new K/V (``is_causal``, a fused kernel)."""
        if prefix is not None:
            _check_prefix_cache(prefix, self)

    @property
    def max_length(self) -> int:
        return self.keys.shape[3]

    @property
    def num_loops(self) -> int:
        """R of the cache's depths (the forwards that write it run as many loops)."""
        return self.signature[LOOPS]

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    def write(self, depth: int, step: "CacheStep", key: Tensor, value: Tensor) -> None:
        """Store a forward's new K/V [s, B, ng, hn] (MCore's layout) of ``depth`` at the
        step's slots: slots 0 ... s-1 of every row in a ``fresh`` prefill (one strided copy),
        else scattered to each row's slots."""
        for cached, new in ((self.keys, key), (self.values, value)):
            if self.fresh:
                cached[depth][:, :, : new.shape[0]] = new.permute(1, 2, 0, 3)  # [B, ng, s, hn]
            else:
                cached[depth][step.rows, :, step.slots] = new.transpose(0, 1).to(cached.dtype)

    def read(self, depth: int, span: int, dtype: torch.dtype) -> tuple:
        """The K/V of ``depth``'s first ``span`` slots of every row in ``dtype``, as views
        in MCore's layout: ([span, B, ng, hn], [span, B, ng, hn])."""
        return tuple(t[depth][:, :, :span].to(dtype).permute(2, 0, 1, 3)
                     for t in (self.keys, self.values))

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def chain(self) -> list:
        """The prefix caches this cache continues, root first (empty without a prefix)."""
        return [] if self.prefix is None else [*self.prefix.chain(), self.prefix]

    def copy_rows_of(self, prefix: "DepthKVCache") -> None:
        """Fill this per-row cache (no ``prefix`` of its own) with the K/V and lengths of
        ``prefix``'s N rows, each copied into the G = B / N rows that continue it (rows
        n*G ... n*G+G-1): prompt-once decoding with the prompts' K/V ``copied`` (one copy per
        row, read as per-row decoding reads its cache; ``rl/rollout.py``'s ``prompt_kv``)."""
        if self.prefix is not None:
            raise ValueError("copy_rows_of fills a per-row cache; this one continues a prefix")
        _check_prefix_cache(prefix, self)
        n, span = prefix.batch, prefix.max_length
        if span > self.max_length:
            raise ValueError(f"the prefix cache holds {span} positions per row, this cache "
                             f"{self.max_length}")
        for mine, theirs in ((self.keys, prefix.keys), (self.values, prefix.values)):
            rows = mine[:, :, :, :span].unflatten(1, (n, self.batch // n))  # [D, N, G, ng, P, hn]
            rows.copy_(theirs[:, :, None])
        self.lengths.copy_(prefix.lengths.repeat_interleave(self.batch // n))

    def keep_exits(self, config, loops: Tensor) -> None:
        """Each row's last written position keeps, at every depth of a loop after its exit
        loop ``loops[b]`` (from 1), the same layer's K/V of that loop: a serving engine's
        finalization of an early exit (vllm-rlt's ``last_exited``), read by every later
        position (``LoopKV.exit_kv`` replays it). loops [B] on the cache's device."""
        pre = config.looped_num_prelude_layers
        per = config.num_layers + config.looped_num_coda_layers
        D, B = self.keys.shape[:2]
        depth = torch.arange(D, device=self.device)[:, None]  # [D, 1]
        loop = (depth - pre).clamp(min=0) // per  # [D, 1]
        exit_loop = (loops - 1)[None, :]  # [1, B], from 0
        deeper = (depth >= pre) & (loop > exit_loop)  # [D, B]
        source = torch.where(deeper, depth - (loop - exit_loop) * per, depth)  # [D, B]
        rows = torch.arange(B, device=self.device)
        slots = upload(self.lengths - 1, self.device)  # [B]: each row's last position
        for cached in (self.keys, self.values):
            at = cached.permute(1, 3, 0, 2, 4)  # [B, T, D, ng, hn] view
            current = at[rows, slots]  # [B, D, ng, hn]
            index = source.t()[:, :, None, None].expand_as(current)
            at[rows, slots] = current.gather(1, index)

    def reserve(self, max_length: int) -> None:
        """Grow the cache to hold ``max_length`` positions per row (a copy of this cache
        only; nothing if it already does). A cache continuing this one reads the new
        tensors; a ``DecodeGraph`` captured on this cache would not (build it after)."""
        if max_length <= self.max_length:
            return
        grown = []
        for t in (self.keys, self.values):
            shape = (*t.shape[:3], max_length, t.shape[4])
            new = torch.zeros(shape, dtype=t.dtype, device=t.device)
            new[:, :, :, : t.shape[3]] = t
            grown.append(new)
        self.keys, self.values = grown

    def ends(self) -> Tensor:
        """[B] absolute position after every row's last cached token (host)."""
        return mark_host(self.offsets() + self.lengths)

    def offsets(self) -> Tensor:
        """[B] absolute position of every row's slot 0 (host): the end of the row it
        continues in ``prefix`` (its prompt's length prompt once; 0 without a prefix)."""
        if self.prefix is None:
            return mark_host(torch.zeros_like(self.lengths))
        return mark_host(self.prefix.ends().repeat_interleave(self.batch // self.prefix.batch))

    def positions(self, steps: int) -> Tensor:
        """Absolute positions of the next ``steps`` tokens of every sequence: [B, s] (host)."""
        offsets = mark_host(torch.arange(steps, device="cpu"))
        start = self.lengths if self.prefix is None else self.lengths + self.offsets()
        return mark_host(start[:, None] + offsets[None, :])

    def plan(self, steps: int) -> "CacheStep":
        """Where a forward of ``steps`` tokens per row reads and writes this cache, from the
        host-known lengths, uploaded to the cache's device (``CacheStep``)."""
        positions = self.positions(steps)  # [B, s] host
        slots = positions - self.offsets()[:, None] if self.prefix is not None else positions
        chain = self.chain()
        if self.static:
            span = self.max_length
            prefix_spans = tuple(c.max_length for c in chain)
            rope_span = span + sum(prefix_spans)
        else:
            span = int(slots.max()) + 1
            prefix_spans = tuple(int(c.lengths.max()) for c in chain)
            rope_span = int(positions.max()) + 1
        prefix_lengths = tuple(upload(c.lengths, self.device) for c in chain)
        return CacheStep(_positions_on(positions, steps, self.device), upload(slots, self.device),
                         prefix_lengths, span, prefix_spans, rope_span).with_masks()


def _positions_on(positions: Tensor, steps: int, device) -> Tensor:
    """The step's positions [B, s] (host) on ``device``; a prefill (s > 1) whose rows all have
    the same positions (checked on the host) as an expand of one row, which RoPE computes
    once for all rows (``LoopedGPTModel._rope``). Never for a decode step: a CUDA graph
    captures that step once for rows of any positions."""
    if steps > 1 and bool((positions == positions[:1]).all()):
        return upload(positions[:1], device).expand(positions.shape)
    return upload(positions, device)


def upload(host: Tensor, device) -> Tensor:
    """A device copy of a small host tensor (always a new tensor; no sync: host to device)."""
    return host.to(device, non_blocking=True, copy=True)


@dataclass
class CacheStep:
    """One forward's reads and writes of a ``DepthKVCache``, computed once per forward (not
    per layer application). Device tensors: ``positions`` [B, s] absolute positions,
    ``slots`` [B, s] the cache slots written (positions after the prefix with one),
    ``prefix_lengths`` one [N_j] per prefix cache of the chain (root first; empty without a
    prefix); host ints: ``span`` keys of the own cache attended, ``prefix_spans`` keys of each
    prefix cache, ``rope_span`` rows of the RoPE table. ``with_masks`` derives (on the device)
    ``rows`` [B, s] and ``prefix_allowed``, one [N_j, P_j] per prefix cache (True on its rows'
    cached tokens); ``allowed`` [B, s, span] (True = attend: slot <= the query's) and
    ``masked``, its negation [B, 1, s, span] (MCore's convention), are derived when first read
    (a fresh prefill reads neither: with a static cache they would be [B, s, max_length])."""

    positions: Tensor
    slots: Tensor
    prefix_lengths: tuple
    span: int
    prefix_spans: tuple
    rope_span: int
    rows: Optional[Tensor] = None
    prefix_allowed: tuple = ()
    memo: dict = field(default_factory=dict)
    """What the layer applications of the forward derive once from the step (its masks, their
    additive forms: ``kernels.additive_mask``)."""

    def with_masks(self) -> "CacheStep":
        device, slots = self.slots.device, self.slots
        self.rows = torch.arange(slots.shape[0], device=device)[:, None].expand_as(slots)
        self.prefix_allowed = tuple(
            torch.arange(span, device=device)[None, :] < lengths[:, None]  # [N_j, P_j]
            for lengths, span in zip(self.prefix_lengths, self.prefix_spans))
        return self

    @property
    def allowed(self) -> Tensor:
        """[B, s, span], True = attend (slot <= the query's), made on first read."""
        if "allowed" not in self.memo:
            self.memo["allowed"] = self._keys()[None, None, :] <= self.slots[:, :, None]
        return self.memo["allowed"]  # [B, s, T]

    @property
    def masked(self) -> Tensor:
        """[B, 1, s, span], True = masked (slot > the query's: MCore's convention), made on
        first read."""
        if "masked" not in self.memo:
            self.memo["masked"] = self._keys() > self.slots[:, None, :, None]
        return self.memo["masked"]  # [B, 1, s, T]

    def _keys(self) -> Tensor:
        return torch.arange(self.span, device=self.slots.device)  # [T]


def _check_prefix_cache(prefix: DepthKVCache, cache: DepthKVCache) -> None:
    """A continuation cache's prefix: same model structure, dtype and device, one row of the
    prefix per G rows."""
    if prefix.signature != cache.signature:
        raise ValueError("the prefix cache was built for a different model config")
    if cache.batch % prefix.batch:
        raise ValueError(f"a prompt-once cache of batch {cache.batch} cannot continue "
                         f"{prefix.batch} prompts: its batch must be a multiple (G rows per "
                         f"prompt)")
    if (prefix.keys.dtype, prefix.keys.device) != (cache.keys.dtype, cache.keys.device):
        raise ValueError(f"the prefix cache is {prefix.keys.dtype} on {prefix.keys.device}, the "
                         f"continuation cache {cache.keys.dtype} on {cache.keys.device}")


@mcore_workaround
@dataclass
class LoopKV:
    """Per-forward routing of K/V by virtual depth, passed to layers as ``inference_context``.

    The block sets ``depth`` before running each layer application. Attention then either
    records its new K/V (``record``), attends to a prefix state, or reads and writes a cache.

    MCore's TransformerLayer passes ``inference_context`` on to self-attention and asks it the
    ``MCORE_METHODS`` below; MCore's own contexts key K/V by ``layer_number``, which a layer
    reused across loops shares, so LoopKV stands in for one (ledger row W1).
    """

    prefix: Optional[PrefixState] = None
    cache: Optional[DepthKVCache] = None
    positions: Optional[Tensor] = None  # [B, s] absolute positions (cache mode)
    step: Optional[CacheStep] = None  # the cache's reads and writes (cache mode)
    record: bool = False
    record_inputs: bool = False
    """Set only with ``record``: record each depth's attention input instead of its K/V (a
    state of kind ``inputs``)."""
    prefix_rope: object = None
    """With a prefix state of kind ``inputs``: the RoPE of its positions (as the forward's
    ``rotary_pos_emb``), which its derived keys are rotated by; None without RoPE."""
    prefix_attention: str = "cascade"
    depth: int = 0
    recorded: dict = field(default_factory=dict)
    exits: Optional[Tensor] = None
    """[s, b]: the loops each position ran (1..R; a serving engine's exit depths), None: all.
    A position past its exit keeps its exit loop's K/V (``exit_kv``)."""
    used: dict = field(default_factory=dict)
    """With ``exits``: depth -> the (K, V) later positions read there (and with
    ``record_inputs`` the attention input they come from), kept for the same layer's depth in
    the next loop."""

    def exit_kv(self, config, *tensors: Tensor) -> tuple:
        """The K/V [s, b, ng, hn] later positions read at this ``depth`` (and the attention
        input [s, b, H] they come from, when given), as a serving engine with vllm-rlt's
        ``last_exited`` layout keeps them: a position that exited after loop e reads as loop
        e's K/V at every deeper loop (the same layer, so the same projection of loop e's
        input), so a query at loop d reads loop min(d, e)'s. Prelude depths and the first
        loop are every position's own."""
        d = self.depth
        loop = None if self.exits is None else loop_of(config, d)
        if loop is None:
            return tensors
        if loop > 0:
            ran = self.exits > loop  # [s, b]
            kept = self.used.pop(exit_read(config, d))
            tensors = tuple(torch.where(ran.view(*ran.shape, *[1] * (t.dim() - 2)), t, k)
                            for t, k in zip(tensors, kept))
        self.used[d] = tensors
        return tensors

    # Exactly what MCore 0.16.1's TransformerLayer asks of an inference context.
    MCORE_METHODS: ClassVar[tuple] = (
        "is_decode_only", "is_static_batching", "using_cuda_graph_this_step",
    )

    def is_decode_only(self) -> bool:
        """No: a forward may carry many tokens per sequence (MCore's prefill case), so MCore
        picks no decode CUDA graph for it."""
        return False

    def is_static_batching(self) -> bool:
        """Yes: one fixed batch per forward (MCore then asks no dynamic-batching question)."""
        return True

    def using_cuda_graph_this_step(self) -> bool:
        """No: looped forwards are not CUDA-graph captured (asked of dynamic contexts only)."""
        return False
