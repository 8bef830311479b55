"""Stock MCore training step on 2 gloo CPU ranks equals 1 rank on the concatenated data.

GPTModel (local spec) -> MCore DistributedDataParallel -> distributed optimizer (Adam),
driven by `get_forward_backward_func()` with config.no_sync_func / grad_sync_func /
finalize_model_grads_func set the way Megatron's training loop sets them.

Loss normalisation, two ways, both the same function for (D=2 ranks, M microbatches each)
and (D=1, 2*M microbatches) on the concatenated data:
- per-microbatch (default MCore): each microbatch returns (sum of masked token losses) /
  TOKENS_PER_MB, a constant equal on every rank; the schedule divides by M and DDP averages
  gradients over D, so the gradient is that of  sum_all masked losses / (D*M*TOKENS_PER_MB).
- per-token (`calculate_per_token_loss=True`): each microbatch returns (sum, token count);
  DDP sums gradients and finalize_model_grads divides them by the token count all-reduced
  over D, so the gradient is that of  sum_all masked losses / sum_all mask.
"""

import gc
import os
import weakref
from functools import partial

import pytest
import torch
import torch.distributed as dist

from scalerlt_mcore.testing import run_distributed, thread_count

WORLD = 2
SEQ, VOCAB, MICRO_BATCH = 16, 64, 2
MICROBATCHES_TOTAL = 4  # per step, over all ranks: 2 per rank on 2 ranks, 4 on 1 rank
STEPS = 4
TOKENS_PER_MB = MICRO_BATCH * SEQ
BUCKET_SIZE = 4000  # elements; the ~29k-parameter model then spans several buckets
LR = 1e-2

# fp32 tolerance. The two runs compute the same function; they differ only in the order of
# floating-point sums (grads: local accumulation + reduce-scatter vs one accumulation; loss:
# all-reduce of partial sums). Each such sum carries a relative error of a few fp32 ulps
# (eps = 1.2e-7) times log2(#terms) < 10, i.e. < ~1e-6; four Adam steps at lr 1e-2 on a
# ~3-4 loss do not amplify that past 1e-5 (measured: at most 1 ulp, ~1.1e-7 relative).
RTOL = 1e-5


def _data():
    """Tokens, labels, loss masks for all steps and microbatches: (STEPS, MB_TOTAL, b, s)."""
    gen = torch.Generator().manual_seed(0)
    shape = (STEPS, MICROBATCHES_TOTAL, MICRO_BATCH, SEQ + 1)
    seqs = torch.randint(0, VOCAB, shape, generator=gen)
    mask = (torch.rand(shape[:-1] + (SEQ,), generator=gen) < 0.75).float()
    return seqs[..., :-1], seqs[..., 1:], mask


def _build(overlap_grad_reduce: bool, per_token_loss: bool = False):
    """Tiny fp32 GPTModel in MCore DDP + distributed Adam; config funcs as in training.py."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=per_token_loss,
    )
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=BUCKET_SIZE,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=LR, use_distributed_optimizer=True, bf16=False, fp16=False,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    config.grad_scale_func = optimizer.scale_loss
    if overlap_grad_reduce:  # as Megatron's training loop: only with overlapped reduction
        config.no_sync_func = model.no_sync
        config.grad_sync_func = model.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer


def _loss_func(mask, per_token_loss, token_losses):
    """Masked token-loss sum, normalised as in the module docstring."""
    token_sum = (token_losses * mask).sum()
    report = {"token_sum": token_sum.detach(), "tokens": mask.sum()}
    if per_token_loss:
        return token_sum, mask.sum().int(), report
    return token_sum / TOKENS_PER_MB, report


def _forward_step(per_token_loss, data_iterator, model):
    """MCore forward_step_func: per-token loss (b, s) from GPTModel with labels."""
    tokens, labels, mask = next(data_iterator)
    positions = torch.arange(SEQ).expand_as(tokens)  # (b, s)
    token_losses = model(tokens, positions, None, labels=labels)  # (b, s)
    return token_losses, partial(_loss_func, mask, per_token_loss)


def _global_loss(reports, per_token_loss) -> torch.Tensor:
    """This step's loss over all ranks' microbatches, normalised like the gradient."""
    sums = torch.stack([torch.stack([r["token_sum"], r["tokens"]]) for r in reports]).sum(0)
    dist.all_reduce(sums)  # (token_sum, tokens) over all ranks
    if per_token_loss:
        return sums[0] / sums[1]
    return sums[0] / (MICROBATCHES_TOTAL * TOKENS_PER_MB)


def _flat_params(model) -> torch.Tensor:
    """All parameters as one fp32 vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _train(rank, world_size, overlap_grad_reduce, per_token_loss):
    """Run STEPS steps on this rank's share of microbatches; return losses, norms, params."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, optimizer = _build(overlap_grad_reduce, per_token_loss)
    init = _flat_params(model)
    tokens, labels, mask = _data()
    per_rank = MICROBATCHES_TOTAL // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    losses, grad_norms = [], []
    model.train()
    for step in range(STEPS):
        batches = zip(tokens[step, mine], labels[step, mine], mask[step, mine])
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, per_token_loss),
            data_iterator=iter(list(batches)), model=[model], num_microbatches=per_rank,
            seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append(_global_loss(reports, per_token_loss))
        grad_norms.append(grad_norm)
    return {"init": init, "params": _flat_params(model), "losses": torch.stack(losses),
            "grad_norms": torch.tensor(grad_norms)}


@pytest.mark.parametrize("per_token_loss", [False, True])
@pytest.mark.parametrize("overlap_grad_reduce", [False, True])
def test_two_ranks_match_one_rank(overlap_grad_reduce, per_token_loss):
    """Identical params on both ranks; loss and grad-norm sequences equal the 1-rank run."""
    two = run_distributed(_train, WORLD, overlap_grad_reduce, per_token_loss, timeout=240)
    (one,) = run_distributed(_train, 1, overlap_grad_reduce, per_token_loss, timeout=240)

    assert torch.equal(two[0]["params"], two[1]["params"])
    assert torch.equal(two[0]["losses"], two[1]["losses"])
    assert torch.equal(two[0]["init"], one["init"]), "runs must start from the same init"
    assert not torch.equal(one["init"], one["params"]), "the optimizer must change params"
    rel = ((two[0]["losses"] - one["losses"]).abs() / one["losses"]).max().item()
    assert rel <= RTOL, f"2-rank vs 1-rank loss: max rel diff {rel:.2e} > {RTOL}"
    torch.testing.assert_close(two[0]["grad_norms"], one["grad_norms"], rtol=RTOL, atol=0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_model_parallel_context_releases_its_process_groups():
    """A RoPE model built in one context must not keep that context's gloo groups (threads,
    sockets) alive after it: MCore's RotaryEmbedding.forward cache holds the model."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
    from scalerlt_mcore.model.config import LoopedTransformerConfig
    from scalerlt_mcore.testing import model_parallel_context

    def build_and_run():
        with model_parallel_context():
            config = LoopedTransformerConfig(
                num_layers=1, hidden_size=16, num_attention_heads=2, looped_num_loops=2,
                use_cpu_initialization=True, perform_initialization=True)
            model = LoopedGPTModel(config, get_looped_gpt_layer_local_spec(), vocab_size=11,
                                   max_sequence_length=8, position_embedding_type="rope")
            model(torch.zeros(1, 4, dtype=torch.long))
            assert RotaryEmbedding.forward.cache_info().currsize >= 1  # the cache was used

    build_and_run()
    before = thread_count()
    for _ in range(3):
        build_and_run()
    assert thread_count() <= before, f"threads grew from {before} to {thread_count()}"


def _ddp_step():
    """In a fresh context: a tiny GPTModel in MCore DDP + distributed Adam, wired as Megatron's
    training loop wires them (the config holds the optimizer's ``scale_loss``), one forward and
    backward. Returns the DDP and the context's data-parallel group."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from scalerlt_mcore.testing import model_parallel_context

    with model_parallel_context():
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                   use_cpu_initialization=True)
        gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=11, max_sequence_length=8)
        ddp = DistributedDataParallel(config=config, module=gpt,
                                      ddp_config=DistributedDataParallelConfig(
                                          use_distributed_optimizer=True))
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=LR, use_distributed_optimizer=True, bf16=False, fp16=False),
            [ddp])
        config.grad_scale_func = optimizer.scale_loss
        tokens = torch.zeros(1, 4, dtype=torch.long)
        ddp(tokens, torch.arange(4)[None], None, labels=tokens).sum().backward()
        # DDP's hooks ran inside the context: the gradient is in the buffer, not in .grad
        assert all(p.grad is None for p in gpt.parameters())
        assert any(p.main_grad.abs().sum() > 0 for p in gpt.parameters())
        return ddp, parallel_state.get_data_parallel_group()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_model_parallel_context_releases_a_ddp_model_and_its_process_groups():
    """A model in MCore DDP with the distributed optimizer must be freed after its context,
    with the context's gloo groups (threads, sockets): DDP's backward hooks close over the DDP
    and autograd's C++ nodes, kept alive by the optimizer's parameter shards, hold the hooks."""
    _ddp_step()
    gc.collect()
    before = thread_count()
    refs = [tuple(map(weakref.ref, _ddp_step())) for _ in range(2)]
    gc.collect()
    assert [(ddp() is None, group() is None) for ddp, group in refs] == [(True, True)] * 2
    assert thread_count() <= before, f"threads grew from {before} to {thread_count()}"


def test_a_ddp_model_after_its_context_refuses_a_backward_pass():
    """Its process groups are gone: a backward pass reaching its parameters is an error."""
    ddp, _ = _ddp_step()
    with pytest.raises(RuntimeError, match="built inside model_parallel_context ran a backward "
                       "pass after the context exited"):
        sum(p.sum() for p in ddp.parameters()).backward()
