"""Decode graphs kept across rollouts (``DecodeGraphs``, ``--rl-decode-cuda-graph``), on CPU.

A CUDA graph cannot be captured here, so ``capture`` is replaced by a stand-in that replays
as a graph does: into the output buffers of the capture, and only while every tensor the
capture read (the caches, the step buffers, the weights) is the storage it was then (a real
graph would silently read the old storage). With it, a rollout through kept graphs samples the
eager static-cache rollout's tokens with its log-probs (fp64 1e-12): per row, prompt once
``shared`` and ``copied``, across rollouts whose prompts share a padded width and one that
does not; weights updated in place keep the graph, weights moved to new storage recapture it;
the least recently used shape is dropped at ``capacity``; the graphed step runs on ``meta``
(no host read); and what graphed decoding refuses, by name.
"""

import pytest
import torch
from helpers.decode import LOOPS, VOCAB, build

from scalerlt_mcore.app.config import parse_args
from scalerlt_mcore.app.config.rl import check_rl
from scalerlt_mcore.app.trainer import decode_graphs_for
from scalerlt_mcore.model import decode_graph
from scalerlt_mcore.model.decode_graph import DecodeGraph, DecodeGraphs
from scalerlt_mcore.rl.rollout import Sampling, generate

MODES = {"per_row": {}, "shared": {"prompt_once": True, "prompt_kv": "shared"},
         "copied": {"prompt_once": True, "prompt_kv": "copied"}}
ROOM_8 = ([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]], [[11, 12, 13, 14, 15, 16], [3, 4], [5] * 7])
ROOM_16 = [[7] * 10, [2, 9, 4]]  # padded to 16 with bucket 8


class _StandInGraph:
    """``run`` replayed as a captured CUDA graph would be (see the module docstring)."""

    def __init__(self, run):
        self.run, self.owner = run, run.__self__  # the DecodeGraph
        self.outputs = run()
        self.storage = self._storage()

    def _storage(self) -> list:
        g = self.owner
        tensors = [g.tokens, g.step.positions, g.step.slots, *g.step.prefix_lengths,
                   *g.model.parameters()]
        for cache in (*g.cache.chain(), g.cache):
            tensors += [cache.keys, cache.values]
        return [t.data_ptr() for t in tensors]

    def replay(self) -> None:
        assert self._storage() == self.storage, "replayed on storage it was not captured on"
        for buffer, value in zip(self.outputs, self.run()):
            if buffer is not None:
                buffer.copy_(value)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(decode_graph, "_check_cuda", lambda cache: None)
    monkeypatch.setattr(decode_graph, "capture", _stand_in_capture)


def _stand_in_capture(run, device, warmup: int) -> tuple:
    graph = _StandInGraph(run)
    return graph, graph.outputs


def _rollout(model, prompts, mode: str, **kwargs):
    gen = torch.Generator().manual_seed(len(prompts) + sum(map(len, prompts)))
    return generate(model, prompts, 2, 6, eos_id=VOCAB + 1, pad_id=0,
                    sampling=Sampling(banned=(0,), generator=gen), **MODES[mode], **kwargs)


def _assert_as_eager(model, prompts, mode: str, graphs: DecodeGraphs) -> None:
    graphed = _rollout(model, prompts, mode, cuda_graph=graphs)
    eager = _rollout(model, prompts, mode, static_cache=True)
    assert torch.equal(graphed.responses, eager.responses)
    assert torch.allclose(graphed.loop_logprobs, eager.loop_logprobs, atol=1e-12, rtol=0)
    assert torch.allclose(graphed.logprobs, eager.logprobs, atol=1e-12, rtol=0)


@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
@pytest.mark.parametrize("mode", list(MODES))
def test_kept_graphs_decode_as_eager(mcore_single, stand_in, mode, pe):
    model = build(pe)[0].eval()
    graphs = DecodeGraphs(bucket=8)
    for prompts in (*ROOM_8, ROOM_16):
        _assert_as_eager(model, prompts, mode, graphs)
    assert graphs.captures == 2  # the two prompt sets of width <= 8 share one graph
    assert [key[1] for key in graphs.keys()] == [8, 16]


def test_weights_in_place_keep_the_graph_new_storage_recaptures(mcore_single, stand_in):
    model = build("rope")[0].eval()
    graphs = DecodeGraphs(bucket=8)
    _assert_as_eager(model, ROOM_8[0], "shared", graphs)
    with torch.no_grad():  # an optimizer step: the same storage
        for p in model.parameters():
            p.mul_(1.05)
    _assert_as_eager(model, ROOM_8[1], "shared", graphs)
    assert graphs.captures == 1
    for p in model.parameters():  # a reload into new storage
        p.data = p.data.clone()
    _assert_as_eager(model, ROOM_8[0], "shared", graphs)
    assert graphs.captures == 2


def test_least_recent_shape_dropped_at_capacity(mcore_single, stand_in):
    model = build("rope")[0].eval()
    graphs = DecodeGraphs(capacity=1, bucket=8)
    for prompts in (ROOM_8[0], ROOM_16, ROOM_8[1]):
        _assert_as_eager(model, prompts, "per_row", graphs)
    assert graphs.captures == 3 and [key[1] for key in graphs.keys()] == [8]


def test_graphed_step_runs_on_meta(mcore_single, stand_in):
    """The graphed step (buffers copied in, the capture replayed) reads nothing on the host
    (``meta`` cannot be read) and gives the eager step's shapes."""
    model = build("rope", torch.float32)[0].to("meta").eval()
    model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.to("meta")
    prefix = model.new_kv_cache(3, 8, static=True)
    prefix.lengths.copy_(torch.tensor([3, 7, 5]))
    cache = model.new_kv_cache(6, 5, prefix=prefix, static=True)
    step = DecodeGraph(model, cache)
    logits, exit_lp = step(torch.zeros(6, dtype=torch.long, device="meta"))
    assert logits.device.type == "meta" and logits.shape == (LOOPS, 6, VOCAB)
    assert exit_lp is None and cache.lengths.tolist() == [1] * 6


def test_graphed_decoding_refusals(mcore_single):
    with pytest.raises(ValueError, match="needs capacity >= 1 and bucket >= 1, got 0 and 64"):
        DecodeGraphs(capacity=0)
    model = build("rope")[0].eval()
    with pytest.raises(ValueError, match="cuda_graph decoding needs static caches"):
        _rollout(model, ROOM_8[0], "per_row", cuda_graph=DecodeGraphs(), static_cache=False)
    with pytest.raises(ValueError, match="needs a CUDA cache; this one is on cpu"):
        _rollout(model, ROOM_8[0], "per_row", cuda_graph=DecodeGraphs())
    cfg = parse_args(["--rl-decode-cuda-graph", "true"])
    with pytest.raises(ValueError, match=r"rl_decode_cuda_graph needs a CUDA device .* this "
                                         r"run is on cpu"):
        decode_graphs_for(cfg, torch.device("cpu"))
    assert decode_graphs_for(parse_args([]), torch.device("cpu")) is False
    cfg.model.tensor_model_parallel_size = 2
    assert any("rl_decode_cuda_graph runs without tensor parallelism" in e for e in check_rl(cfg))


def test_the_trainer_keeps_its_graphs_across_rollouts(monkeypatch):
    """``--rl-decode-cuda-graph``: every rollout of the run gets the trainer's one
    ``DecodeGraphs`` (built once, on CUDA: here a stand-in object)."""
    from types import SimpleNamespace

    from scalerlt_mcore.app import trainer as trainer_module
    from scalerlt_mcore.app.config import tokenizer_from
    from scalerlt_mcore.app.trainer import RLTrainer

    calls = []
    monkeypatch.setattr(trainer_module, "generate",
                        lambda *args, **kwargs: calls.append(kwargs["cuda_graph"]))
    tr = RLTrainer.__new__(RLTrainer)
    tr.cfg = parse_args(["--rl-decode-cuda-graph", "true"])
    tr.tok, tr.device, tr.rank = tokenizer_from(tr.cfg), torch.device("cpu"), 0
    tr.path_tokens, tr.banned = tr.cfg.rl.rl_max_response_length, (0, 1)
    tr.model, tr.decode_graphs = torch.nn.Linear(1, 1), object()
    problems = [SimpleNamespace(prompt="ab>")]
    tr.rollout(1, problems, 2)
    tr.rollout(2, problems, 1, temperature=0.0)
    assert calls == [tr.decode_graphs, tr.decode_graphs]
