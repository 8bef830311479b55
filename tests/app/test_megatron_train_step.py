"""A Megatron-LM training step with the shared-prefix schedule swapped in for stock MCore's.

``megatron_train_step`` follows Megatron-LM's ``train_step`` (``megatron/training/training.py``)
where it applies without pipeline parallelism, unchanged otherwise: zero every model chunk's
grad buffer and the optimizer's grads; call the forward-backward function with Megatron-LM's
keyword arguments; step the optimizer, AND the success flag and take the max grad norm over
the model-parallel group; step the LR schedule by the samples consumed; reduce the returned loss
dicts (``x[key].view(-1)``: two-element values summed, all-reduced over data-parallel ranks and
divided, one-element values averaged over microbatches); then accumulate them the way
``training_log`` does. ``megatron_evaluate`` is Megatron-LM's ``evaluate`` reduction of a
forward-only step. The config hooks are set as Megatron-LM's ``train`` sets them.

On 2 gloo ranks (DP=2), tiny looped GPT in MCore DDP (overlapped grad reduction) with the
MCore optimizer (SGD, so that a gradient difference moves the parameters linearly; MCore's
distributed optimizer takes only Adam):
- run A: ``forward_backward_func`` = the shared-prefix schedule, groups as microbatches,
  ``forward_step_func`` = ``rl_forward_step(RLObjective)``;
- run B: stock ``get_forward_backward_func()``, every response a full sequence, with a
  ``forward_step_func`` whose loss is the plain-PyTorch reference of ``helpers.sp`` and whose
  loss dict is scaled so that Megatron-LM's microbatch average is the mean group loss.
The step runs, every reduced value is a float tensor, A's losses, token counts and grad norm
equal B's, the parameter updates agree to rounding, ranks stay identical, and a forward-only
evaluation before the step gives the training loss.
"""

import math
from functools import partial

import torch
import torch.distributed as dist

from scalerlt_mcore.testing import run_distributed

WORLD, LOOPS, VOCAB, MAX_SEQ = 2, 2, 48, 32
LR = 0.5
PLAN = (2, (4, 3))  # wave size; group sizes on every rank
RTOL = 1e-6  # fp32: the same loss / gradient computed in another order


# ---- Megatron-LM's step, without pipeline parallelism ---------------------------------------


def megatron_train_step(forward_step_func, data_iterator, model, optimizer, scheduler,
                        forward_backward_func, num_microbatches, micro_batch_size, seq_length):
    from megatron.core import parallel_state

    for model_chunk in model:
        model_chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size, decoder_seq_length=None, forward_only=False,
        adjust_tensor_shapes_fn=None, force_all_reduce=False, p2p_communicator=None,
        pg_collection=None)
    update_successful, grad_norm, _ = optimizer.step()
    mp_group = parallel_state.get_model_parallel_group()
    update_successful = _logical_and(update_successful, mp_group)
    grad_norm = _reduce_max(grad_norm, mp_group)
    if update_successful:
        dp = parallel_state.get_data_parallel_world_size()
        scheduler.step(increment=num_microbatches * micro_batch_size * dp)
    loss_reduced = {}
    for key in losses_reduced[0].keys():
        val = [x[key].view(-1) for x in losses_reduced]
        if val[0].numel() == 2:
            val = torch.vstack(val).sum(dim=0)
            dist.all_reduce(val, group=parallel_state.get_data_parallel_group(
                with_context_parallel=True))
            loss_reduced[key] = val[0] / val[1]
        elif val[0].numel() == 1:
            loss_reduced[key] = torch.cat(val).mean()
        else:
            raise ValueError(f"Invalid value shape: {val[0].shape} for key {key}")
    return loss_reduced, not update_successful, grad_norm


def _logical_and(flag: bool, group) -> bool:
    t = torch.tensor([flag], dtype=torch.int)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _reduce_max(value, group):
    t = torch.tensor([value or 0.0], dtype=torch.float)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def training_log_accumulate(loss_dict: dict, total_loss_dict: dict) -> None:
    """How ``training_log`` adds a step's reduced losses to its running totals."""
    for key in loss_dict:
        total_loss_dict[key] = total_loss_dict.get(
            key, torch.tensor([0.0], dtype=torch.float)) + loss_dict[key]


def megatron_evaluate(forward_step_func, data_iterator, model, forward_backward_func,
                      num_microbatches, micro_batch_size, seq_length) -> dict:
    """Megatron-LM's ``evaluate`` for one batch: forward only, losses summed per key."""
    total_loss_dict = {}
    with torch.no_grad():
        loss_dicts = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, decoder_seq_length=None, forward_only=True,
            adjust_tensor_shapes_fn=None, pg_collection=None, p2p_communicator=None)
    for key in loss_dicts[0].keys():
        total_loss_dict.setdefault(key, torch.tensor([0.0, 0.0], dtype=torch.float))
        val = [x[key].view(-1) for x in loss_dicts]
        assert val[0].numel() == 1, key
        total_loss_dict[key][0] += torch.cat(val).sum()
        total_loss_dict[key][1] += len(loss_dicts)
    return {k: v[0] / v[1] for k, v in total_loss_dict.items()}


# ---- the model, as Megatron-LM's train() sets it up -----------------------------------------


def _setup():
    from helpers.sp import build_model
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(3)
    gpt = build_model(R=LOOPS, arch=True, hidden=16, heads=2, layers=1, vocab=VOCAB)
    config = gpt.config
    model = [DistributedDataParallel(config=config, module=gpt, ddp_config=(
        DistributedDataParallelConfig(use_distributed_optimizer=False, overlap_grad_reduce=True,
                                      bucket_size=3000)))]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0, clip_grad=1.0,
        use_distributed_optimizer=False, bf16=False, fp16=False), model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=100,
        lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=100,
        wd_incr_style="constant")
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model[0].no_sync
    config.grad_sync_func = model[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, scheduler


def _groups(rank: int) -> list:
    from helpers.sp import make_group

    return [make_group(G, 6, 4, LOOPS, seed=100 * rank + k, dtype=torch.float32, kl=True,
                       group_id=k, vocab=VOCAB) for k, G in enumerate(PLAN[1])]


def _spec():
    from helpers.sp import LossSpec

    return LossSpec(normalization="token_mean", kl_coef=0.05, loop_weights="uniform")


# ---- run B's stock-MCore forward step: full sequences, plain-PyTorch loss -------------------


def _naive_batches(groups) -> list:
    from helpers.sp import naive_microbatches

    batches = naive_microbatches(groups, _spec(), per_mb=2)
    factor = len(batches) / len(groups)  # Megatron-LM averages over microbatches
    for b in batches:
        b["factor"] = factor
        b["mask"] = (b["coef"] != 0).float()
    return batches


def _naive_loss(batch, output):
    from helpers.sp import ref_rl_loss

    loss = ref_rl_loss(_spec(), output, batch["old"], batch["adv"], batch["coef"], batch["ref"])
    f = batch["factor"]
    return loss * f, {"loss": loss.detach() * f, "tokens": batch["mask"].sum() * f}


def _naive_forward_step(data_iterator, model):
    batch = next(data_iterator)
    logprobs = model(batch["tokens"], labels=batch["labels"]).logprobs  # [R, b, T]
    return logprobs, partial(_naive_loss, batch)


# ---- one rank ------------------------------------------------------------------------------


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model[0].parameters()]).clone()


def _run(schedule: str, rank: int) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from scalerlt_mcore.rl.objective import rl_forward_step
    from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func

    model, optimizer, scheduler = _setup()
    groups = _groups(rank)
    if schedule == "shared_prefix":
        fb = get_shared_prefix_forward_backward_func(PLAN[0])
        step, data, mbs = rl_forward_step(_spec().objective()), groups, 1
    else:
        fb = get_forward_backward_func()
        step, data, mbs = _naive_forward_step, _naive_batches(groups), 2
    before = _flat(model)
    evaluated = megatron_evaluate(step, iter(data), model, fb, len(data), mbs, MAX_SEQ)
    loss, skipped, grad_norm = megatron_train_step(
        step, iter(data), model, optimizer, scheduler, fb, len(data), mbs, MAX_SEQ)
    totals = {}
    training_log_accumulate(loss, totals)
    return {"loss": loss, "eval": evaluated, "skipped": skipped, "grad_norm": grad_norm,
            "totals": totals, "update": _flat(model) - before,
            "samples": scheduler.num_steps}


def _worker(rank, world_size) -> dict:
    return {name: _run(name, rank) for name in ("shared_prefix", "stock")}


def test_megatron_train_step_with_shared_prefix_schedule():
    ranks = run_distributed(_worker, WORLD, timeout=500)
    for r in ranks:
        a, b = r["shared_prefix"], r["stock"]
        assert set(a["loss"]) == {"loss", "clipped", "kl", "tokens", "num_waves", "wave_size",
                                  "retain", "naive", "prompt_segments",
                                  "state_inputs"}  # the plan, beside
        for key, value in a["loss"].items():
            assert value.is_floating_point() and value.numel() == 1, key
            assert a["totals"][key].dtype == torch.float32, key
        assert not a["skipped"] and not b["skipped"]
        assert a["loss"]["num_waves"].item() == sum(math.ceil(G / PLAN[0]) for G in PLAN[1]) / 2
        for key in ("loss", "tokens"):
            want = b["loss"][key].item()
            assert abs(a["loss"][key].item() - want) <= RTOL * abs(want), key
            assert abs(a["eval"][key].item() - want) <= RTOL * abs(want), key
        assert a["grad_norm"] > 0
        assert abs(a["grad_norm"] - b["grad_norm"]) <= RTOL * b["grad_norm"]
        assert a["samples"] == len(PLAN[1]) * 1 * WORLD  # microbatches x size x DP
        scale = b["update"].abs().max().item()
        assert scale > 0
        assert (a["update"] - b["update"]).abs().max().item() <= 1e-5 * scale
    assert torch.equal(ranks[0]["shared_prefix"]["update"], ranks[1]["shared_prefix"]["update"])
