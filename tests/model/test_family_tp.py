"""The public looped families under tensor parallelism, on 2 gloo ranks.

Ouro (sandwich norms, SwiGLU, GQA, the exit gate), Huginn (norms after the residual adds,
per-head query/key biases, the injection, prelude and coda, a random initial state),
Retrofitted Recurrence and Nanbeige, each imported from a tiny random Hugging Face checkpoint
at TP = 2, each rank taking its shard of every whole tensor, in fp64:

- every loop's log-probs of the labels (at full depth and replaying a serving engine's exit
  depths) and the exit gate's log-distribution equal the same import at TP = 1 in one
  process, and so do the gradients of a fixed mix of them, gathered over the
  tensor-parallel group (fp64 <= 1e-12 relative to each tensor's largest entry);
- the export of the TP = 2 model (whole tensors gathered from the shards, under the
  checkpoint's own names) gives back every tensor of the checkpoint bitwise;
- the model saved with MCore's distributed checkpointing at TP = 2 loads at TP = 1 into the
  same numbers as the checkpoint's import (Huginn's query/key biases are split by head).
"""

import multiprocessing
import tempfile
from pathlib import Path

import pytest
import torch
from helpers.reference_huginn import write_huginn_checkpoint, write_retrofit_checkpoint
from helpers.reference_nanbeige import write_nanbeige_checkpoint
from helpers.reference_ouro import write_ouro_checkpoint
from safetensors.torch import load_file

from scalerlt_mcore.model.hf_export import export_format, hf_state_dict
from scalerlt_mcore.model.looped_import import looped_gpt_from_pretrained
from scalerlt_mcore.model.shards import whole_tensor
from scalerlt_mcore.testing import model_parallel_context, run_distributed

TP, B, S, SEED = 2, 2, 9, 5
FP64_RTOL = 1e-12
WRITERS = {"ouro": write_ouro_checkpoint, "huginn": write_huginn_checkpoint,
           "retrofitted": write_retrofit_checkpoint, "nanbeige": write_nanbeige_checkpoint}


def _import(path: str, tp: int):
    model = looped_gpt_from_pretrained(path, use_cpu_initialization=True,
                                       tensor_model_parallel_size=tp,
                                       params_dtype=torch.float64)
    model.set_initial_state_draw(SEED, 1)  # Huginn's random s_0: the same on every rank
    return model


def _inputs(vocab: int) -> tuple:
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, vocab, (B, S), generator=gen)
    labels = torch.randint(0, vocab, (B, S), generator=gen)
    return tokens, labels, gen


def _step(model, vocab: int) -> tuple:
    """(per-loop log-probs [R, B, S] of a forward at full depth and of one replaying exit
    depths, exit log-distribution or None, {name: whole grad of a mix of them})."""
    tokens, labels, gen = _inputs(vocab)
    R = model.config.looped_num_loops
    exits = torch.randint(1, R + 1, tokens.shape, generator=gen)  # a serving engine's
    out, early = model(tokens, labels=labels), model(tokens, labels=labels, exit_depths=exits)
    mix = torch.randn(out.logprobs.shape, generator=gen, dtype=torch.float64)
    loss = (mix * out.logprobs).sum() + (mix.roll(1, dims=2) * early.logprobs).sum()
    if out.exit_logprobs is not None:
        loss = loss + (mix.flip(0) * out.exit_logprobs).sum()
    loss.backward()
    grads = {n: whole_tensor(n, p, p.grad, model.config).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    gate = None if out.exit_logprobs is None else out.exit_logprobs.detach().clone()
    logprobs = torch.stack([out.logprobs, early.logprobs]).detach().clone()
    return logprobs, gate, grads


def _tp_rank(rank, world_size, path: str, vocab: int, save_dir: str) -> tuple:
    """At TP = 2: the step, the export's tensors and a distributed checkpoint in ``save_dir``."""
    from megatron.core import dist_checkpointing

    from scalerlt_mcore.app.checkpoint import _in_process_write_results

    model = _import(path, TP)
    logprobs, gate, grads = _step(model, vocab)
    exported = hf_state_dict(model, export_format(model))
    multiprocessing.current_process().daemon = False  # MCore's writer starts worker processes
    with _in_process_write_results():
        dist_checkpointing.save(model.sharded_state_dict(), save_dir)
    return logprobs, gate, grads, exported


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_family_at_tp2_equals_tp1(family):
    with tempfile.TemporaryDirectory() as d:
        source, saved = Path(d) / "hf", Path(d) / "dist"
        WRITERS[family](source)
        saved.mkdir()
        vocab = 64  # the tiny checkpoints' vocabulary (divisible by TP)
        ranks = run_distributed(_tp_rank, TP, str(source), vocab, str(saved),
                                tensor_model_parallel_size=TP)
        with model_parallel_context(seed=1):
            reference = _import(str(source), 1)
            want_logprobs, want_gate, want_grads = _step(reference, vocab)
            loaded = _import(str(source), 1)
            _load_dist_checkpoint(loaded, saved)
            resaved = {k: v.clone() for k, v in loaded.state_dict().items()
                       if not k.endswith("_extra_state")}
            imported = {k: v.clone() for k, v in reference.state_dict().items()
                        if not k.endswith("_extra_state")}
        checkpoint = load_file(str(source / "model.safetensors"))
    for rank, (logprobs, gate, grads, exported) in enumerate(ranks):
        assert _close(logprobs, want_logprobs) <= FP64_RTOL, (family, rank)
        if want_gate is not None or gate is not None:
            assert _close(gate, want_gate) <= FP64_RTOL, (family, rank)
        assert grads.keys() == want_grads.keys(), (family, rank)
        worst = max((_close(grads[n], want_grads[n]), n) for n in want_grads)
        print(f"\n[tp2] {family} rank {rank}: log-probs "
              f"{_close(logprobs, want_logprobs):.1e}, worst gradient {worst[0]:.1e} ({worst[1]})")
        assert worst[0] <= FP64_RTOL, (family, rank, worst)
        assert exported.keys() >= {k for k in checkpoint if k != "freqs_cis"}, family
        for name, tensor in checkpoint.items():
            if name in exported:
                assert torch.equal(exported[name].double(), tensor.double()), (family, name)
    assert resaved.keys() == imported.keys()
    for name, tensor in imported.items():
        assert torch.equal(resaved[name], tensor), (family, name)


def _load_dist_checkpoint(model, directory: Path) -> None:
    """``model`` (TP = 1) set to the distributed checkpoint in ``directory``."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), str(directory))
    model.load_state_dict(state, strict=False)
