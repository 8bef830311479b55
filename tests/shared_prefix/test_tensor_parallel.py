"""Tensor parallelism on gloo ranks: TP=2 (2 ranks) and TP=2 x DP=2 (4 ranks).

One tiny looped GPT (prelude, coda, injection, GQA with 4 heads in 2 K/V groups, tied
embeddings, a vocabulary of 49 padded as Megatron pads it) whose FULL weights are drawn in
plain PyTorch from a seed; every rank loads its shard (MCore's ``partition_dim``). Weights and
data are fp32 numbers, used as they are in fp32 and widened to fp64, so the fp64 runs are the
exact gradients of the fp32 problem. Per layout, over two steps with different wave sizes:

- joint replay (A) and naive stock-MCore training (B: every response a full sequence through
  ``get_forward_backward_func()``, RL loss written in plain PyTorch in ``helpers.sp``) on the
  same TP layout, each in MCore DDP (overlapped, bucketed grad reduction); the reduced
  gradients, gathered over the TP group, agree per tensor (fp64: A vs B <= 1e-12; fp32: A and
  B each within 1e-6 of the exact gradient, B's fp64 one, relative to each tensor's max);
- A's gathered gradients equal those of naive training at TP=1 in ONE process with the same
  full weights over all data-parallel ranks' groups (fp64 <= 1e-12; fp32: A and the TP=1 fp32
  run each within 1e-6 of the TP=1 fp64 gradient);
- rollouts with the sharded KV cache and gathered vocab-parallel logits, per row and prompt
  once (``DepthKVCache(prefix=...)``, ``prompt_once_attention`` per head shard; and each
  prompt's K/V copied into its rows, ``prompt_kv`` copied), draw the same tokens on every rank,
  equal to TP=1 per-row rollouts for the same seed, and never draw a padding id although the
  padding logits are made to hold most of the probability mass.
"""

import dataclasses
import zlib

import pytest
import torch
import torch.distributed as dist

from scalerlt_mcore.model.vocab_parallel import padded_vocab_size
from scalerlt_mcore.testing import model_parallel_context, run_distributed

TP = 2
REAL_VOCAB = 49  # token ids the data use; the model's vocabulary is padded beyond it
VOCAB = padded_vocab_size(REAL_VOCAB, 4, TP)  # 56: 7 padding ids
LOOPS, MAX_SEQ = 2, 32
# (wave size, group sizes on every data-parallel rank) per step; P, S fixed per group below
PLAN = ((2, (5, 3)), (3, (4, 2)))
PROMPT, RESPONSE = 6, 4
# Per tensor, max |error| / max |reference|. fp64: the same function in another order. Every
# fp32 gradient (joint replay, and the naive references too) is bounded against the EXACT
# gradient of the same weights (the fp64 run), not against another fp32 evaluation: the RL
# gradient is a sum of terms of both signs (advantages), so for some tensors (layernorm weights)
# it is ~10x smaller than its terms, and each fp32 evaluation carries up to ~9e-7 of rounding
# relative to the tensor (measured for naive and joint replay alike, at TP=1 and 2); two fp32
# evaluations differ by up to the sum of their own roundings (measured 1.1e-6, printed; stock
# naive training at TP=2 against itself at TP=1: 7.5e-7, also printed). Stock MCore's own
# fp32 rounding per tensor depends on the CPU's kernels (1.24e-6 for a coda layernorm weight of
# naive training at TP=2 on one machine, 7.5e-7 on another), so the references' sanity bound is
# over the whole gradient (max |error| / max |reference| over all tensors, as the DDP and CUDA
# tests bound fp32); the per-tensor figure is printed beside it. Joint replay's own fp32 bound
# stays per tensor.
FP64_RTOL, FP32_RTOL = 1e-12, 1e-6
WEIGHT_STD = 0.02  # MCore's init_method_std: near-uniform log-probs, PPO ratios near 1
# Rollouts: 3 prompts x 4 samples, up to 5 new tokens; eos is token 1, pad 0 (banned).
ROLLOUT_PROMPTS = ([5, 9, 13, 2], [7, 3], [11, 12, 20, 30, 40])
ROLLOUT_G, ROLLOUT_NEW, ROLLOUT_SEED, EOS, PAD = 4, 5, 11, 1, 0
# Rollout weights: larger, so that sampling is far from uniform, and the padding rows of the tied
# embedding scaled up so that padding ids would take most of the probability mass.
ROLLOUT_STD, PAD_LOGIT_BOOST = 0.3, 4.0


# ---- model and weights ---------------------------------------------------------------------


def _model(dtype, tp: int):
    from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
    from scalerlt_mcore.model.config import LoopedTransformerConfig

    config = LoopedTransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, params_dtype=dtype,
        looped_num_loops=LOOPS, looped_num_prelude_layers=1, looped_num_coda_layers=1,
        looped_injection="linear_concat",
    )
    model = LoopedGPTModel(config, get_looped_gpt_layer_local_spec(), VOCAB, MAX_SEQ,
                           share_embeddings_and_output_weights=True).to(dtype)
    _load_full_weights(model, tp)
    return model


def _split(p) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def _full_weight(name: str, shape, std: float) -> torch.Tensor:
    """The full (TP=1) value of parameter ``name``, from a seed of its name (fp64)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen, dtype=torch.float64)
    full = 1 + 0.1 * noise if "layernorm.weight" in name else std * noise
    return full.float().double()  # fp32 numbers: exact in both dtypes


@torch.no_grad()
def _load_full_weights(model, tp: int, std: float = WEIGHT_STD, pad_boost: float = 1.0) -> None:
    """Every parameter set to this rank's shard of its full weight."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if _split(p):
            shape[p.partition_dim] *= tp
        full = _full_weight(name, shape, std)
        if name == "embedding.word_embeddings.weight":
            full[REAL_VOCAB:] *= pad_boost
        if _split(p):
            full = full.chunk(tp, dim=p.partition_dim)[rank]
        p.copy_(full)


def _gather(p, value: torch.Tensor) -> torch.Tensor:
    """The full tensor of a TP shard ``value`` of parameter ``p``."""
    from megatron.core import parallel_state

    if not _split(p) or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return value.detach().clone()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    return torch.cat(parts, dim=p.partition_dim)


def _ddp(model):
    """MCore DDP (no distributed optimizer: every rank holds the reduced gradient) with the
    config hooks Megatron's training loop sets for overlapped reduction."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    config = model.config
    ddp = DistributedDataParallel(config=config, module=model, ddp_config=(
        DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2000)))
    config.no_sync_func = ddp.no_sync
    config.grad_sync_func = ddp.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp


# ---- data ----------------------------------------------------------------------------------


def _groups(step: int, dp_rank: int, dtype) -> list:
    """This data-parallel rank's groups (the same on the ranks of a TP group), drawn in fp32
    and widened to ``dtype``."""
    from helpers.sp import make_group

    sizes = PLAN[step][1]
    groups = [make_group(G, PROMPT, RESPONSE, LOOPS, seed=1000 * step + 10 * dp_rank + k,
                         dtype=torch.float32, kl=True, group_id=k, vocab=REAL_VOCAB)
              for k, G in enumerate(sizes)]
    return [_widen(g, dtype) for g in groups]


def _widen(group, dtype):
    fields = {f.name: getattr(group, f.name) for f in dataclasses.fields(group)}
    return type(group)(**{k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                          for k, v in fields.items()})


def _spec():
    from helpers.sp import LossSpec

    return LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="progressive",
                    clip_high=0.28)


# ---- one rank ------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    assert scale > 0, "a reference gradient is identically zero: the test does not probe it"
    return (a.double() - b.double()).abs().max().item() / scale


def _gathered_grads(ddp) -> dict:
    return {n: _gather(p, p.main_grad) for n, p in ddp.module.named_parameters()}


def _train_steps(dtype) -> dict:
    """Per step, the gathered reduced gradients of joint replay (A) and naive training (B)."""
    from helpers.sp import joint_step, naive_step
    from megatron.core import parallel_state

    model_a, model_b = (_ddp(_model(dtype, TP)) for _ in range(2))
    dp_rank = parallel_state.get_data_parallel_rank()
    out = {"a": [], "b": []}
    for step, (wave, _) in enumerate(PLAN):
        groups = _groups(step, dp_rank, dtype)
        for model in (model_a, model_b):
            model.zero_grad_buffer()
        joint_step(model_a, groups, _spec(), wave)
        naive_step(model_b, groups, _spec(), per_mb=2)
        out["a"].append(_gathered_grads(model_a))
        out["b"].append(_gathered_grads(model_b))
    return out


ROLLOUT_MODES = {"per_row": (False, None), "prompt_once_shared": (True, "shared"),
                 "prompt_once_copied": (True, "copied")}
"""name -> (prompt_once, prompt_kv) of the sharded rollouts compared with TP=1's."""


def _rollout(model, prompt_once: bool = False, prompt_kv=None):
    from scalerlt_mcore.rl.rollout import Sampling, generate

    gen = torch.Generator().manual_seed(ROLLOUT_SEED)
    return generate(model, [list(p) for p in ROLLOUT_PROMPTS], ROLLOUT_G, ROLLOUT_NEW, eos_id=EOS,
                    pad_id=PAD, prompt_once=prompt_once, prompt_kv=prompt_kv,
                    sampling=Sampling(temperature=1.0, generator=gen, banned=(PAD,),
                                      vocab_size=REAL_VOCAB))


def _rollout_model(tp: int):
    model = _model(torch.float32, tp).eval()
    _load_full_weights(model, tp, std=ROLLOUT_STD, pad_boost=PAD_LOGIT_BOOST)
    return model


def _worker(rank, world_size) -> dict:
    from megatron.core import parallel_state

    assert parallel_state.get_tensor_model_parallel_world_size() == TP
    out = {"dp": parallel_state.get_data_parallel_world_size()}
    for dtype in (torch.float64, torch.float32):
        out[dtype] = _train_steps(dtype)
    model = _rollout_model(TP)
    out["rollout"] = {mode: (ro.responses, ro.logprobs) for mode in ROLLOUT_MODES
                      for ro in [_rollout(model, *ROLLOUT_MODES[mode])]}
    out["errors"] = _errors()
    out["checkpoint_shapes"] = _checkpoint_shapes(_model(torch.float32, TP))
    return out


def _checkpoint_shapes(model) -> dict:
    """key -> (global shape, this rank's offsets) of every tensor in the model's sharded state
    dict (what distributed checkpoints write)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {t.key: (tuple(t.global_shape), tuple(t.global_offset))
            for t in nested_values(model.sharded_state_dict()) if isinstance(t, ShardedTensor)}


def _errors() -> list:
    """The messages of a vocabulary that does not split over the TP ranks, and of a prefix
    state whose K/V groups were split for another TP size."""
    from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec

    model = _model(torch.float32, TP)
    messages = []
    try:
        LoopedGPTModel(model.config, get_looped_gpt_layer_local_spec(), REAL_VOCAB, MAX_SEQ)
    except ValueError as e:
        messages.append(str(e))
    tokens = torch.tensor([ROLLOUT_PROMPTS[0]])
    state = model(tokens, return_prefix_state=True, readout=False).prefix_state
    other = dataclasses.replace(state, signature=(*state.signature[:-1], 1))
    try:
        model(tokens[:, :2], prefix_state=other)
    except ValueError as e:
        messages.append(str(e))
    return messages


# ---- TP=1 references in this process ------------------------------------------------------


def _tp1_grads(dtype, step: int, dp: int) -> dict:
    """Naive stock-MCore training at TP=1 over every data-parallel rank's groups."""
    from helpers.sp import naive_step

    model = _model(dtype, 1)
    groups = [g for r in range(dp) for g in _groups(step, r, dtype)]
    naive_step(model, groups, _spec(), per_mb=2)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp2xdp2"])
def layout(request):
    """The ranks' results for one layout, and TP=1 references computed here."""
    world = request.param
    ranks = run_distributed(_worker, world, tensor_model_parallel_size=TP, timeout=500)
    dp = world // TP
    with model_parallel_context():
        tp1 = {dtype: [_tp1_grads(dtype, s, dp) for s in range(len(PLAN))]
               for dtype in (torch.float64, torch.float32)}
        shapes = _checkpoint_shapes(_model(torch.float32, 1))
        model = _rollout_model(1)
        ro = _rollout(model)
        prompt = torch.tensor([ROLLOUT_PROMPTS[0]])
        first = model.prefill(model.new_kv_cache(1, 8), prompt,
                              torch.tensor([prompt.shape[1]]))[-1, 0]  # [V], final loop
    pad_mass = first.softmax(-1)[REAL_VOCAB:].sum().item()
    return {"ranks": ranks, "dp": dp, "tp1": tp1, "rollout": ro, "pad_mass": pad_mass,
            "checkpoint_shapes": shapes}


def _worst(got: list, want: list) -> tuple:
    """(max per-tensor relative error, step, tensor) over the steps' gradient dicts."""
    worst = (0.0, None, None)
    for step, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w)
        for name in w:
            assert g[name].shape == w[name].shape, name
            worst = max(worst, (_rel(g[name], w[name]), step, name))
    return worst


def _worst_whole(got: list, want: list) -> tuple:
    """(max over the steps of max |error| / max |reference| over the whole gradient, step)."""
    worst = (0.0, None)
    for step, (g, w) in enumerate(zip(got, want)):
        diff = max((g[n].double() - w[n].double()).abs().max().item() for n in w)
        worst = max(worst, (diff / max(w[n].abs().max().item() for n in w), step))
    return worst


def _note(worst: dict, key: str, err: tuple) -> tuple:
    """Keep the largest error of ``key`` over the ranks (printed by the test); ``err``."""
    worst[key] = max(worst.get(key, err), err)
    return err


def test_joint_replay_matches_naive_same_tp_layout(layout):
    worst = {}
    for r in layout["ranks"]:
        assert r["dp"] == layout["dp"]
        a64, b64, a32, b32 = (r[dt][k] for dt in (torch.float64, torch.float32) for k in "ab")
        err64 = _note(worst, "fp64", _worst(a64, b64))
        err32 = _note(worst, "fp32 joint vs exact", _worst(a32, b64))
        _note(worst, "fp32 naive vs exact, per tensor (not bounded)", _worst(b32, b64))
        ref32 = _note(worst, "fp32 naive vs exact, whole gradient", _worst_whole(b32, b64))
        _note(worst, "fp32 joint vs fp32 naive (not bounded)", _worst(a32, b32))
        assert err64[0] <= FP64_RTOL, f"fp64: {err64}"
        assert err32[0] <= FP32_RTOL, f"fp32 joint replay vs exact: {err32}"
        assert ref32[0] <= FP32_RTOL, f"fp32 naive (the reference) vs exact: {ref32}"
    print(f"DP={layout['dp']} joint replay vs naive, same TP layout:", worst)


def test_tp_gradients_equal_tp1(layout):
    """A's reduced gradients, gathered, on every rank equal TP=1 naive training's: fp64 to
    1e-12; fp32 A within 1e-6 of the TP=1 fp64 gradient per tensor, the fp32 TP=1 run over
    the whole gradient."""
    worst = {}
    exact, tp1_32 = layout["tp1"][torch.float64], layout["tp1"][torch.float32]
    _note(worst, "fp32 TP=1 vs exact, per tensor (not bounded)", _worst(tp1_32, exact))
    ref32 = _note(worst, "fp32 TP=1 vs exact, whole gradient", _worst_whole(tp1_32, exact))
    assert ref32[0] <= FP32_RTOL, f"fp32 TP=1 naive (the reference) vs exact: {ref32}"
    for r in layout["ranks"]:
        err64 = _note(worst, "fp64", _worst(r[torch.float64]["a"], exact))
        err32 = _note(worst, "fp32 vs exact", _worst(r[torch.float32]["a"], exact))
        _note(worst, "fp32 vs fp32 TP=1 (not bounded)", _worst(r[torch.float32]["a"], tp1_32))
        # stock MCore against itself: naive training at this TP layout vs at TP=1, both fp32
        _note(worst, "fp32 stock naive, this layout vs TP=1 (not bounded)",
              _worst(r[torch.float32]["b"], tp1_32))
        assert err64[0] <= FP64_RTOL, f"fp64: {err64}"
        assert err32[0] <= FP32_RTOL, f"fp32 vs exact: {err32}"
    print(f"TP={TP} x DP={layout['dp']} vs TP=1:", worst)


def test_tp_errors_name_the_problem(layout):
    for r in layout["ranks"]:
        vocab, state = r["errors"]
        assert f"vocab_size {REAL_VOCAB} is not divisible by the tensor-parallel size 2" in vocab
        assert "make_vocab_size_divisible_by" in vocab
        assert "different model config: tensor parallel 1 != 2" in state


def test_checkpoint_tensors_have_global_shapes(layout):
    """Distributed checkpoints see every tensor with its TP=1 shape; the TP ranks hold
    different parts of the split ones (a split tensor saved as replicated would be one rank's
    shard posing as the whole tensor)."""
    want = layout["checkpoint_shapes"]
    tp_ranks = layout["ranks"][:TP]  # ranks 0..TP-1 form one TP group
    offsets = [{k: off for k, (_, off) in r["checkpoint_shapes"].items()} for r in tp_ranks]
    for r in layout["ranks"]:
        assert {k: shape for k, (shape, _) in r["checkpoint_shapes"].items()} == {
            k: shape for k, (shape, _) in want.items()}
    split = [k for k in want if offsets[0][k] != offsets[1][k]]
    assert any("layers.0.self_attention.linear_proj" in k for k in split), split
    assert any("coda.0.mlp.linear_fc1" in k for k in split), split
    assert "embedding.word_embeddings.weight" in split


def test_rollouts_equal_tp1(layout):
    want = layout["rollout"]
    assert layout["pad_mass"] > 0.5, "padding ids must be likely for the mask to matter"
    assert int(want.responses.max()) < REAL_VOCAB, "a padding id was sampled"
    assert (want.responses != PAD).sum() > len(ROLLOUT_PROMPTS) * ROLLOUT_G
    for r in layout["ranks"]:
        assert set(r["rollout"]) == set(ROLLOUT_MODES)
        for mode, (responses, logprobs) in r["rollout"].items():
            assert torch.equal(responses, want.responses), mode
            assert (logprobs - want.logprobs).abs().max().item() <= 1e-5
