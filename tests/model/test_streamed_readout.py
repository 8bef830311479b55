"""The streamed readout (``looped_readout_tile`` > 0, ``model/streamed_readout.py``): log-probs
of labels over vocabulary tiles, with no [.., V] logits or softmax kept for the backward.

- the function against plain PyTorch (log_softmax(h W^T / T) gathered, written here), fp64:
  log-probs and the gradients of the input and the weight within 1e-12, tiles that do not
  divide V, one row, the whole vocabulary and more;
- the model: one-level joint replay, naive and tree joint replay steps (PPO + k3 KL + entropy
  term, T = 1 and 0.7, tied and untied embeddings, truncated backprop with the exit gate,
  vocabulary 50 in tiles of 7) with the flag equal
  the same steps with the plain readout (fp64: loss, new log-probs and every parameter's
  gradient within 1e-12 relative per tensor); decoding's logits bitwise unchanged;
- tensor parallelism (TP = 2, gloo ranks, MCore DDP): the streamed function against plain
  PyTorch on the full weight, and a joint replay step's reduced gradients (``main_grad``)
  against the plain readout's (MCore's vocab-parallel cross entropy);
- memory (``SavedTensorProbe``): a joint replay step with the flag saves at least
  R x V x 4 x 0.9 bytes per response token less than with the plain readout.
"""

import pytest
import torch
from helpers.sp import grads, make_group
from helpers.tree import DEPTH2, tree_group

from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.config import LoopedTransformerConfig
from scalerlt_mcore.model.streamed_readout import streamed_logprobs
from scalerlt_mcore.rl.objective import RLObjective, rl_forward_step
from scalerlt_mcore.shared_prefix import (
    SavedTensorProbe,
    get_shared_prefix_forward_backward_func,
    naive_step,
)
from scalerlt_mcore.testing import run_distributed

VOCAB, MAX_SEQ, LOOPS, TILE = 50, 32, 3, 7  # 7 does not divide 50
G, P, S, WAVE = 4, 6, 4, 3
FP64_TOL = 1e-12


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.double().abs().max().item()
    assert scale > 0, "the reference is identically zero: the comparison probes nothing"
    return (got.double() - ref.double()).abs().max().item() / scale


def rel_errors(got: dict, ref: dict) -> dict:
    """Per tensor: max |got - ref| / max |ref|; a tensor whose reference gradient is zero
    (truncated backprop leaves some without one) must be zero too (its error: max |got|)."""
    out = {}
    for n, r in ref.items():
        scale = r.double().abs().max().item()
        out[n] = (got[n].double() - r.double()).abs().max().item() / (scale or 1.0)
    readout = "output_layer.weight" if "output_layer.weight" in ref else (
        "embedding.word_embeddings.weight")
    assert ref[readout].abs().max() > 0, "the readout weight's gradient is not probed"
    return out


def _plain(hidden, weight, labels, T):
    """log_softmax(hidden @ weight^T / T) of labels: hidden [S, B, H], labels [B, S] ->
    [B, S]."""
    logits = (hidden @ weight.t()).transpose(0, 1) / T  # [B, S, V]
    return torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None])[..., 0]


def _inputs(vocab: int, seed: int = 0, rows: int = 3, length: int = 5, hidden: int = 8):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(length, rows, hidden, generator=gen, dtype=torch.float64)
    w = 0.7 * torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows, length), generator=gen)
    upstream = torch.randn(rows, length, generator=gen, dtype=torch.float64)
    return h, w, labels, upstream


@pytest.mark.parametrize("tile", [1, TILE, VOCAB, 64])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_function_matches_plain_pytorch(tile, T):
    h, w, labels, upstream = _inputs(VOCAB)
    results = []
    for fn in (lambda a, b: streamed_logprobs(a, b, labels, tile, temperature=T),
               lambda a, b: _plain(a, b, labels, T)):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(a, b)
        out.backward(upstream)
        results.append((out.detach(), a.grad, b.grad))
    (got, gh, gw), (ref, rh, rw) = results
    assert got.shape == ref.shape == labels.shape
    assert max(_rel(got, ref), _rel(gh, rh), _rel(gw, rw)) <= FP64_TOL


def test_function_refuses_a_bad_tile_and_shapes():
    h, w, labels, _ = _inputs(VOCAB)
    with pytest.raises(ValueError, match="looped_readout_tile must be an integer >= 1 here"):
        streamed_logprobs(h, w, labels, 0)
    with pytest.raises(ValueError, match=r"hidden must be \[S, B, H\] and labels \[B, S\]"):
        streamed_logprobs(h, w, labels.t(), TILE)


def test_config_refuses_a_negative_tile():
    with pytest.raises(ValueError, match="looped_readout_tile must be an integer >= 0, got -1"):
        LoopedTransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                looped_readout_tile=-1)


# ---- the model -------------------------------------------------------------------------


def _model(tied: bool, vocab: int = VOCAB, hidden: int = 16, loops: int = LOOPS, **extra):
    """Tiny fp64 looped GPT (prelude, coda, injection); its readout weights scaled up so the
    token distributions are far from uniform."""
    config = LoopedTransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=2, use_cpu_initialization=True,
        looped_num_loops=loops, looped_num_prelude_layers=1, looped_num_coda_layers=1,
        looped_injection="linear_concat", **extra)
    model = LoopedGPTModel(config, get_looped_gpt_layer_local_spec(), vocab, MAX_SEQ,
                           share_embeddings_and_output_weights=tied).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model._output_weight().mul_(20)
        if model.decoder.exit_gate is not None:
            for p in model.decoder.exit_gate.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _objective(gated: bool) -> RLObjective:
    return RLObjective(kl_coef=0.05, entropy_weight=0.01, clip_high=0.28,
                       loop_weights="exit_pdf" if gated else "progressive",
                       exit_gate_coef=0.1 if gated else 0.0)


def _step(model, group, route: str, objective: RLObjective, T: float) -> tuple:
    """(the step's loss, the new log-probs by a forward-only pass, every parameter's
    gradient) of one step of ``group`` by ``route`` (``tree``: a tree group's joint replay)."""
    step = rl_forward_step(objective)
    model.zero_grad(set_to_none=True)
    if route == "naive":
        out = naive_step(model, [group], step, micro_batch_size=2, temperature=T)
        new = naive_step(model, [group], step, micro_batch_size=2, forward_only=True,
                         collect_non_loss_data=True, temperature=T)
        new = torch.cat(new, dim=1)
    else:
        fb = get_shared_prefix_forward_backward_func(WAVE, prompt="recompute")
        run = dict(data_iterator=iter([group]), model=model, num_microbatches=1,
                   seq_length=0, micro_batch_size=1, temperature=T)
        out = fb(forward_step_func=step, **run)
        run["data_iterator"] = iter([group])
        new = fb(forward_step_func=step, forward_only=True, collect_non_loss_data=True,
                 **run)[0]
        new = torch.cat([t.flatten() for t in new]) if isinstance(new, list) else new
    loss = sum(o["loss"] for o in out)
    return loss, new, grads(model)


CASES = [
    ("untied-T1", False, 1.0, {}),
    ("tied-T0.7", True, 0.7, {}),
    ("untied-T0.7-truncated-gated", False, 0.7,
     dict(looped_backprop_loops=2, looped_exit_gate=True)),
]


@pytest.mark.parametrize("route", ["joint_replay", "naive", "tree"])
@pytest.mark.parametrize("name,tied,T,extra", CASES, ids=[c[0] for c in CASES])
def test_steps_match_the_plain_readout(mcore_single, route, name, tied, T, extra):
    model = _model(tied, **extra)
    group = (tree_group(DEPTH2, LOOPS, seed=6, kl=True) if route == "tree"
             else make_group(G, P, S, LOOPS, seed=5, kl=True, vocab=VOCAB))
    objective = _objective(bool(extra))
    results = {}
    for tile in (0, TILE):
        model.config.looped_readout_tile = tile
        results[tile] = _step(model, group, route, objective, T)
    (loss, new, got), (ref_loss, ref_new, ref) = results[TILE], results[0]
    assert _rel(loss, ref_loss) <= FP64_TOL
    assert _rel(new, ref_new) <= FP64_TOL
    errs = rel_errors(got, ref)
    assert max(errs.values()) <= FP64_TOL, {n: e for n, e in errs.items() if e > FP64_TOL}


def test_decoding_is_unaffected(mcore_single):
    """Logits (no labels: decoding, sampling) are the output layer's, bitwise, with the flag;
    scoring a sequence (labels) under no_grad streams and equals the plain log-probs."""
    model = _model(tied=False).eval()
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    out = {}
    for tile in (0, TILE):
        model.config.looped_readout_tile = tile
        with torch.no_grad():
            cache = model.new_kv_cache(2, 8)
            first = model.prefill(cache, tokens, torch.tensor([6, 4]))
            out[tile] = (model(tokens).logits, first, model.decode_step(cache, tokens[:, 0]),
                         model(tokens, labels=tokens).logprobs)
    for plain, streamed in zip(out[0][:3], out[TILE][:3]):
        for a, b in zip(plain, streamed):
            assert torch.equal(a, b)
    assert _rel(out[TILE][3], out[0][3]) <= FP64_TOL


# ---- memory --------------------------------------------------------------------------------


def test_streamed_readout_saves_no_vocabulary_tensor(mcore_single):
    """A joint replay step at a shape where the vocabulary dominates (V = 4096, H = 16): the
    saved-tensor peak per response token drops by at least R x V x 4 x 0.9 bytes with the
    flag (the plain readout keeps each loop's fp32 logits or softmax per token)."""
    vocab, loops = 4096, 2
    model = _model(tied=False, vocab=vocab, hidden=16, loops=loops).float()
    group = make_group(8, 8, 8, loops, seed=2, dtype=torch.float32, vocab=vocab)
    tokens = int(group.loss_mask.ne(0).sum())
    peaks = {}
    for tile in (0, 1024):
        model.config.looped_readout_tile = tile
        model.zero_grad(set_to_none=True)
        fb = get_shared_prefix_forward_backward_func(2, prompt="recompute")
        with SavedTensorProbe(model) as probe:
            fb(forward_step_func=rl_forward_step(RLObjective()), data_iterator=iter([group]),
               model=model, num_microbatches=1, seq_length=0, micro_batch_size=1)
        assert probe.current_bytes == 0
        peaks[tile] = probe.peak_bytes
    wave_tokens = 2 * 8  # the peak holds the last wave of 2 rows of 8 positions
    saved = (peaks[0] - peaks[1024]) / wave_tokens
    print(f"\n[streamed readout] V={vocab} R={loops}: saved-tensor peak {peaks[0]} B plain, "
          f"{peaks[1024]} B streamed; {saved:.0f} B less per wave position "
          f"(R V 4 = {loops * vocab * 4}); {tokens} response tokens in the group")
    assert saved >= 0.9 * loops * vocab * 4


# ---- tensor parallelism ---------------------------------------------------------------------


TP, TP_VOCAB, TP_TILE = 2, 56, 5  # 28 rows per rank: tile 5 does not divide them


def _load_shards(model) -> None:
    """Every parameter set to this rank's shard of a full (TP = 1) value drawn from a seed of
    its name, the readout rows scaled up (far from uniform distributions)."""
    import zlib

    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            split = getattr(p, "tensor_model_parallel", False)
            shape = list(p.shape)
            if split:
                shape[p.partition_dim] *= TP
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = torch.randn(shape, generator=gen, dtype=torch.float64)
            full = (1 + 0.1 * full if "layernorm.weight" in name
                    else full * (0.5 if "word_embeddings" in name else 0.05))
            p.copy_(full.chunk(TP, dim=p.partition_dim)[rank] if split else full)


def _gathered(p, value: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not getattr(p, "tensor_model_parallel", False):
        return value.detach().clone()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(value) for _ in range(TP)]
    dist.all_gather(parts, value.contiguous(), group=group)
    return torch.cat(parts, dim=p.partition_dim)


def _tp_function(rank: int) -> tuple:
    """The streamed function on this rank's rows of a full weight: (log-probs, grad of the
    input, grad of the full weight gathered) and the plain PyTorch reference's."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    h, w, labels, upstream = _inputs(TP_VOCAB, seed=4)
    a = h.clone().requires_grad_()
    mine = w.chunk(TP)[rank].clone().requires_grad_()
    got = streamed_logprobs(a, mine, labels, TP_TILE,
                            parallel_state.get_tensor_model_parallel_group(), 0.7)
    got.backward(upstream)
    parts = [torch.empty_like(mine) for _ in range(TP)]
    dist.all_gather(parts, mine.grad, group=parallel_state.get_tensor_model_parallel_group())
    a_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = _plain(a_ref, w_ref, labels, 0.7)
    ref.backward(upstream)
    return (got.detach(), a.grad, torch.cat(parts)), (ref.detach(), a_ref.grad, w_ref.grad)


def _tp_worker(rank, world_size) -> dict:
    """Function check, then one joint replay step in MCore DDP with the plain and the
    streamed readout: the gathered reduced gradients (``main_grad``) and the step losses."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    out = {"function": _tp_function(rank)}
    model = _model(True, vocab=TP_VOCAB, tensor_model_parallel_size=TP)
    _load_shards(model)
    config = model.config
    ddp = DistributedDataParallel(config=config, module=model, ddp_config=(
        DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2000)))
    config.no_sync_func, config.grad_sync_func = ddp.no_sync, ddp.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    group = make_group(G, P, S, LOOPS, seed=8, kl=True, vocab=TP_VOCAB)
    fb = get_shared_prefix_forward_backward_func(WAVE, prompt="recompute")
    for tile in (0, TP_TILE):
        config.looped_readout_tile = tile
        ddp.zero_grad_buffer()
        res = fb(forward_step_func=rl_forward_step(_objective(False)),
                 data_iterator=iter([group]), model=ddp, num_microbatches=1, seq_length=0,
                 micro_batch_size=1, temperature=0.7)
        out[tile] = (res[0]["loss"], {n: _gathered(p, p.main_grad)
                                      for n, p in model.named_parameters()})
    return out


def test_tensor_parallel_matches_plain():
    """TP = 2 on gloo ranks: the streamed function equals plain PyTorch on the full weight
    (T = 0.7, fp64 1e-12), and a joint replay step through MCore DDP reduces the same
    gradients into ``main_grad`` with the streamed readout as with the plain one (MCore's
    vocab-parallel cross entropy), every tensor within 1e-12."""
    results = run_distributed(_tp_worker, TP, tensor_model_parallel_size=TP)
    for out in results:
        got, ref = out["function"]
        assert max(_rel(a, b) for a, b in zip(got, ref)) <= FP64_TOL
        loss, streamed = out[TP_TILE]
        ref_loss, plain = out[0]
        assert _rel(loss, ref_loss) <= FP64_TOL
        errs = rel_errors(streamed, plain)
        assert max(errs.values()) <= FP64_TOL, {n: e for n, e in errs.items() if e > FP64_TOL}
