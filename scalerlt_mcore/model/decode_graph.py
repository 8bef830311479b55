"""A decode step captured once as a CUDA graph and replayed.

Small models decode launch-bound: a step is hundreds of small kernels. With a static cache
(``DepthKVCache(static=True)``, the default on CUDA) a decode step has the same shapes every
step and reads the host nothing (``model/host_syncs.py``), so it is captured once
(``torch.cuda.CUDAGraph``) and replayed. Its inputs live in static device buffers: the tokens,
the positions and cache slots of the step (computed on the host from the cache's lengths and
copied in before each replay) and, prompt once (or down a tree), the prefix caches' lengths;
the masks are derived from them inside the graph.
"""

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
        side = torch.cuda.Stream(device=self.cache.device)
        side.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._run()
        torch.cuda.current_stream(self.cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self._run()
        return graph, outputs

    def __call__(self, tokens: Tensor) -> tuple:
        """Append one token per sequence (tokens [B] on the device) -> (logits [R, B, V],
        exit distribution [R, B] or None), as ``decode_step(..., with_exit=True)``."""
        cache = self.cache
        config = self.model.config.with_loops(cache.num_loops)
        self.model._check_inputs(tokens[:, None], None, None, cache, config)  # host checks
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
    if cache.device.type != "cuda":
        raise ValueError(f"a CUDA graph of the decode step needs a CUDA cache; this one is on "
                         f"{cache.device}")
    if not cache.static:
        raise ValueError("a CUDA graph of the decode step needs a static cache "
                         "(DepthKVCache(static=True): the same shapes every step)")
    if model.pg_collection.tp.size() != 1:
        raise NotImplementedError("CUDA-graph decoding runs without tensor parallelism (the "
                                  "vocabulary gather is not captured)")
