"""A decode step captured once as a CUDA graph and replayed.

Small models decode launch-bound: a step is hundreds of small kernels. With a static cache
(``DepthKVCache(static=True)``, the default on CUDA) a decode step has the same shapes every
step and reads the host nothing (``model/host_syncs.py``), so it is captured once
(``torch.cuda.CUDAGraph``) and replayed. Its inputs live in static device buffers: the tokens,
the positions and cache slots of the step (computed on the host from the cache's lengths and
copied in before each replay) and, prompt once (or down a tree), the prefix caches' lengths;
the masks are derived from them inside the graph. ``DecodeGraphs`` keeps graphs and their
caches across rollouts, so that a training run captures once per rollout shape.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .kv import CacheStep, DepthKVCache


class DecodeGraph:
    """``model.decode_step(cache, tokens, with_exit=True)`` as a replayed CUDA graph (the
    same values as the eager step). Built for one cache (its buffers are captured); the
    returned logits are copies (the graph's outputs are overwritten by the next replay)."""

    def __init__(self, model, cache: DepthKVCache, warmup: int = 2):
        _check_graphable(model, cache)
        self.model, self.cache = model, cache
        plan = cache.plan(1)  # the spans are fixed by the static cache
        self.tokens = torch.zeros(cache.batch, dtype=torch.long, device=cache.device)
        self.step = CacheStep(plan.positions.clone(), plan.slots.clone(),
                              tuple(t.clone() for t in plan.prefix_lengths),
                              plan.span, plan.prefix_spans, plan.rope_span)
        self.graph, self.outputs = self._capture(warmup)

    @torch.no_grad()
    def _run(self) -> tuple:
        step = CacheStep(self.step.positions, self.step.slots, self.step.prefix_lengths,
                         self.step.span, self.step.prefix_spans, self.step.rope_span)
        return self.model.decode_on_device(self.cache, self.tokens, step.with_masks())

    def _capture(self, warmup: int) -> tuple:
        """Warm-up runs on a side stream (they write the K/V of the current slots, which the
        first real step rewrites), then the capture."""
        return capture(self._run, self.cache.device, warmup)

    def __call__(self, tokens: Tensor) -> tuple:
        """Append one token per sequence (tokens [B] on the device) -> (logits [R, B, V],
        exit distribution [R, B] or None), as ``decode_step(..., with_exit=True)``."""
        cache = self.cache
        config = self.model.config.with_loops(cache.num_loops)
        self.model.check_inputs(tokens[:, None], None, None, cache, config)  # host checks
        plan_positions = cache.positions(1)  # [B, 1] host
        slots = (plan_positions - cache.offsets()[:, None] if cache.prefix is not None
                 else plan_positions)
        self.step.positions.copy_(plan_positions, non_blocking=True)
        self.step.slots.copy_(slots, non_blocking=True)
        for buffer, prefix in zip(self.step.prefix_lengths, cache.chain()):
            buffer.copy_(prefix.lengths, non_blocking=True)
        self.tokens.copy_(tokens)
        self.graph.replay()
        cache.lengths += 1
        logits, exit_lp = self.outputs
        return logits.clone(), None if exit_lp is None else exit_lp.clone()


def _check_graphable(model, cache: DepthKVCache) -> None:
    _check_cuda(cache)
    if not cache.static:
        raise ValueError("a CUDA graph of the decode step needs a static cache "
                         "(DepthKVCache(static=True): the same shapes every step)")
    if model.pg_collection.tp.size() != 1:
        raise NotImplementedError("CUDA-graph decoding runs without tensor parallelism (the "
                                  "vocabulary gather is not captured)")


def _check_cuda(cache: DepthKVCache) -> None:
    if cache.device.type != "cuda":
        raise ValueError(f"a CUDA graph of the decode step needs a CUDA cache; this one is on "
                         f"{cache.device}")


def capture(run, device, warmup: int) -> tuple:
    """``run()`` captured as a CUDA graph on ``device`` after ``warmup`` runs on a side
    stream -> (the graph, ``run``'s outputs: the graph's output buffers)."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    return graph, outputs


@dataclass
class _Shape:
    """What ``DecodeGraphs`` keeps for one rollout shape."""

    caches: list = field(default_factory=list)
    graph: Optional[DecodeGraph] = None
    weights: tuple = ()


class DecodeGraphs:
    """Decode graphs kept across rollouts (``generate(cuda_graph=...)``), one per rollout
    shape. A graph reads the buffers of the caches it was captured on, so those caches are
    kept with it and emptied for the next rollout of the same shape: a run captures once per
    shape, not once per rollout (each capture synchronises and empties the caching
    allocator). Prompts are padded to a multiple of ``bucket`` tokens (``room``), so that
    nearby prompt lengths share a shape. A graph is captured again when the parameters moved
    to new storage (a reload). At most ``capacity`` shapes are kept, the least recently used
    dropped: kept caches stay allocated between rollouts, memory the training step lacks."""

    def __init__(self, capacity: int = 2, bucket: int = 64):
        if capacity < 1 or bucket < 1:
            raise ValueError(f"DecodeGraphs needs capacity >= 1 and bucket >= 1, got "
                             f"{capacity} and {bucket}")
        self.capacity, self.bucket = capacity, bucket
        self._shapes: OrderedDict = OrderedDict()  # key -> _Shape, least recent first
        self.captures, self.capture_s = 0, 0.0

    def room(self, prompt_width: int) -> int:
        """Cache positions for prompts of ``prompt_width`` tokens: rounded up to ``bucket``."""
        return -(-prompt_width // self.bucket) * self.bucket

    def keys(self) -> list:
        """The kept shapes' keys, least recently used first."""
        return list(self._shapes)

    def cache_maker(self, model, key):
        """``model.new_kv_cache`` for one rollout of shape ``key`` (static caches): the caches
        kept for that shape, emptied, in the order they were first asked for; else new ones,
        kept."""
        shape = self._enter(key)
        kept = iter(list(shape.caches))

        def new_cache(batch: int, max_length: int, prefix=None, static=None, num_loops=None):
            cache = next(kept, None)
            if cache is None:
                cache = model.new_kv_cache(batch, max_length, prefix=prefix, static=True,
                                           num_loops=num_loops)
                shape.caches.append(cache)
            elif (cache.batch, cache.max_length, cache.prefix) != (batch, max_length, prefix):
                raise RuntimeError(f"decode graph shape {key}: a kept cache does not match the "
                                   f"rollout's ({batch} rows x {max_length} positions)")
            cache.lengths.zero_()
            return cache

        return new_cache

    def step(self, model, key, cache: DepthKVCache) -> DecodeGraph:
        """The graph of shape ``key``'s decode step on ``cache``: the kept one, or captured
        now (the first rollout of the shape, or the parameters moved to new storage)."""
        shape = self._shapes[key]
        weights = tuple(p.data_ptr() for p in model.parameters())
        if shape.graph is None or shape.graph.cache is not cache or shape.weights != weights:
            start = time.perf_counter()
            shape.graph, shape.weights = DecodeGraph(model, cache), weights
            self.captures += 1
            self.capture_s += time.perf_counter() - start
        return shape.graph

    def _enter(self, key) -> _Shape:
        """The kept shape of ``key`` (new if unseen), now the most recent; the least recent
        dropped beyond ``capacity``."""
        shape = self._shapes.pop(key, None) or _Shape()
        self._shapes[key] = shape
        while len(self._shapes) > self.capacity:
            self._shapes.popitem(last=False)
        return shape
