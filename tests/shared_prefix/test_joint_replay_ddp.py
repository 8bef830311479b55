"""Joint replay under MCore DDP + distributed AdamW equals naive training, on 2 gloo ranks.

Per rank, replicas of one LoopedGPTModel (same seed), each in its own MCore
`DistributedDataParallel` (distributed optimizer; several buckets with overlapped reduction)
with its own distributed AdamW:
- A is trained by the shared-prefix joint-replay schedule on SharedPrefixGroups;
- B is trained naively: every response a full, independent sequence (prompt + response)
  through stock `get_forward_backward_func()`, one microbatch per response, with the RL loss
  written here in plain PyTorch (same group normalisation, loop weights, PPO clip and k3 KL);
- C is B's naive step evaluated at A's current parameters (copied in before every step; its
  optimizer never steps).

Each step every rank gets its own 1 or 2 groups, and the wave size makes the number of waves
differ between steps, between groups and between ranks (so the joint replay's sync-enabled
backward has a different shape on the two ranks). The prompt mode alternates between steps
(``recompute``: the prompt run again in the joint replay; ``retain``: its graph kept from the
prompt producer), starting with one mode with overlapped reduction and with the other
without, so both modes meet both DDP settings and several wave counts; two more runs alternate
the prompt replayed in 3 segments (with K/V, and with a prefix state of layer inputs,
``GroupPlan.state_kind``) with the retained prompt, with overlapped reduction. Checks:
- every step, after finalize_model_grads: A's reduced gradients equal C's (same parameters,
  so this is the schedule's exactness, to fp32 rounding), and so do the group losses;
- B's trajectory drifts from A's by more than rounding: AdamW's first steps are ~lr*sign(g),
  so entries whose gradient is as small as its rounding error (|g| <~ 1e-6 max|g|) move
  differently in A and B, and from step 1 on B's gradients are taken at (slightly) different
  parameters (measured: A-vs-B ~3e-6 per tensor, C-vs-B the same, A-vs-C ~5e-7). So A and B's
  gradients are compared to GRAD_RTOL at step 0 only, and after the last step A and B's
  parameters and Adam moments must agree within elementwise bounds propagated through AdamW
  from the measured gradient differences (`_AdamErrorBound`), bounds that must themselves be
  tight (few vacuous entries, small in norm against the training movement);
- A's (and B's) parameters are bitwise identical on both ranks.

Loss scaling, so that both schedules minimise the same number: the joint replay scales each
group's loss by 1 / (groups on this rank), as MCore divides each microbatch loss by the
number of microbatches; B has one microbatch per response, which MCore divides by
(responses on this rank), so B's loss function multiplies by responses / groups. DDP then
averages both over the 2 ranks.
"""

import math
from functools import partial

import pytest
import torch
from helpers.ddp import (
    ADAM_EPS,
    BETAS,
    LOOPS,
    LR,
    MAX_SEQ,
    VOCAB,
    _build,
    _global_rel_error,
    _num_buckets,
    _reduced_grads,
)

from scalerlt_mcore.testing import run_distributed

WORLD = 2
CLIP_LOW, CLIP_HIGH, KL_COEF = 0.2, 0.28, 0.05
NORMALIZATIONS = ("token_mean", "seq_mean", "constant")  # cycled over steps

# (wave size, group sizes G on rank 0, on rank 1) per step; waves per group = ceil(G / W).
# Waves of the last (sync-enabled) group on rank 0: 1 2 3 1 4 1 2 1 1 3; on rank 1:
# 1 1 2 1 1 2 3 1 4 1. Groups per rank (= num_microbatches of A): 1 or 2.
PLAN = (
    (2, (2,), (3, 2)),
    (2, (4, 3), (1,)),
    (1, (3,), (2,)),
    (3, (3,), (3, 2)),
    (1, (4,), (2, 1)),
    (2, (1, 2), (4,)),
    (1, (2,), (3,)),
    (4, (4, 2), (3,)),
    (1, (3, 1), (4,)),
    (2, (5,), (2,)),
)

# Reduced gradients at equal parameters: max |g_A - g_C| / max |g_C| over the whole reduced
# gradient <= GRAD_RTOL. The two schedules compute the same function in a different order
# (prompt once + prefix adjoints and cascade attention vs G full sequences), so fp32 gradients
# differ by rounding only: a few ulps (u = 2^-24 = 6e-8) per op through ~10 layer
# applications; measured 2e-7..5e-7 over the whole gradient. Per tensor (also recorded and
# printed) most measure 1e-7..8e-7, but a few reach up to 2.2e-6: the worst were found to be
# the prelude layernorm weights, whose gradients (max ~1e-4) are sums of much larger per-token
# terms that cancel, so their error relative to their own tiny max is fp32 rounding of the
# summands and moves with the attention kernel's summation order (cascade on matmuls: 8.7e-7;
# on PyTorch's CPU flash kernel: 2.2e-6; concat: 1.9e-6 by step 8), not a schedule error.
# The single-process exactness tests keep the per-tensor bound.
GRAD_RTOL = 1e-6
# Group losses: |L_A - L_C| <= LOSS_RTOL * sum |per-token terms| (fp32 log-probs of size
# log V ~ 4 with ~1e-7 relative error; measured <= 1e-7).
LOSS_RTOL = 1e-6
# A bound on the parameters or moments is vacuous for an entry when it allows a full Adam
# step (lr) or the moment's own size; at most this fraction of entries may be vacuous ...
MAX_VACUOUS = 0.01
# ... and ||bound|| / ||reference|| (param: B's distance from init; moments: the moment) at
# most this: a mismatch above 0.1% of the training movement could not hide inside the bound.
MAX_BOUND_NORM = 1e-3
# fp32 rounding of AdamW's own arithmetic, per step and per state tensor, relative to the
# value: every quantity passes through <= 4 fp32 ops (lerp; mul + addcmul; sqrt, div, add;
# mul, addcdiv), each of which may round A's and B's slightly different inputs differently
# by <= 1 ulp of the result each: 4 ops x 2 runs x u, doubled for margin.
ADAM_ROUNDING = 16 * 2.0**-24


# ---- data ----------------------------------------------------------------------------------


def _group(gen, group_size: int, group_id: int):
    """One GRPO group: random prompt, right-padded responses of random lengths, behaviour and
    reference log-probs near the untrained model's (about -log V) so that the PPO clip is
    active for some tokens and not others."""
    from scalerlt_mcore.rl.batch import RLGroup

    P = int(torch.randint(4, 9, (1,), generator=gen))
    S = int(torch.randint(2, 6, (1,), generator=gen))
    T = P + S
    lens = torch.randint(1, S + 1, (group_size,), generator=gen)
    lens[0] = S
    tokens = torch.zeros(group_size, T, dtype=torch.long)
    tokens[:, :P] = torch.randint(1, VOCAB, (P,), generator=gen)
    mask = torch.zeros(group_size, T, dtype=torch.float64)
    for i, n in enumerate(lens.tolist()):
        tokens[i, P : P + n] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[i, P - 1 : P - 1 + n] = 1  # positions whose label is a response token
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    base = -math.log(VOCAB)
    return RLGroup(
        tokens=tokens, labels=labels, loss_mask=mask, prompt_length=P,
        advantages=torch.randn(group_size, generator=gen, dtype=torch.float64),
        old_logprobs=base + 0.3 * torch.randn(LOOPS, group_size, T, generator=gen,
                                              dtype=torch.float64),
        ref_logprobs=base + 0.3 * torch.randn(LOOPS, group_size, T, generator=gen,
                                              dtype=torch.float64),
        group_id=group_id,
    )


def _groups(step: int, rank: int) -> list:
    """This rank's groups for this step (different prompts and responses per rank and step)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    sizes = PLAN[step][1 + rank]
    return [_group(gen, G, 10 * step + g) for g, G in enumerate(sizes)]


# ---- the naive reference: plain PyTorch loss, one full sequence per response ----------------


def _plain_token_weights(normalization: str, mask):
    """c [G, T] from the whole group's mask (never per response)."""
    G, T = mask.shape
    if normalization == "token_mean":
        return mask / mask.sum()
    if normalization == "seq_mean":
        return mask / (mask.sum(dim=1, keepdim=True) * G)
    return mask / (G * T)


def _naive_microbatches(groups, normalization: str) -> list:
    """One microbatch per response: its unpadded sequence (prompt + response minus the last
    token as input) with its slice of the group-normalised token weights."""
    n_resp = sum(g.group_size for g in groups)
    factor = n_resp / len(groups)  # MCore divides by n_resp; joint replay by len(groups)
    mbs = []
    for gi, g in enumerate(groups):
        c = _plain_token_weights(normalization, g.loss_mask)
        lengths = (g.loss_mask != 0).sum(dim=1) + g.prompt_length - 1
        for i, L in enumerate(lengths.tolist()):
            assert c[i, L:].abs().sum() == 0
            mbs.append({
                "tokens": g.tokens[i : i + 1, :L], "labels": g.labels[i : i + 1, :L],
                "old": g.old_logprobs[:, i : i + 1, :L], "ref": g.ref_logprobs[:, i : i + 1, :L],
                "adv": g.advantages[i], "c": c[i : i + 1, :L], "factor": factor, "group": gi,
            })
    return mbs


def _plain_rl_loss(mb, logprobs):
    """PPO-clipped loss + k3 KL, progressive loop weights, token weights c: a scalar, and the
    sum of |per-token terms| (the scale of the loss's rounding error)."""
    acc = logprobs.dtype
    r = torch.arange(1, LOOPS + 1, dtype=torch.float64)
    w = (r / r.sum()).to(acc)[:, None, None]  # [R, 1, 1]
    ratio = torch.exp(logprobs - mb["old"].to(acc))  # [R, 1, L]
    adv = mb["adv"].to(acc)
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * adv)
    delta = mb["ref"].to(acc) - logprobs
    kl = torch.exp(delta) - delta - 1
    terms = w * mb["c"].to(acc)[None] * (surrogate + KL_COEF * kl)
    return terms.sum(), terms.detach().abs().sum()


def _naive_loss_func(mb, logprobs):
    loss, scale = _plain_rl_loss(mb, logprobs)
    return loss * mb["factor"], {"loss": loss.detach(), "scale": scale, "group": mb["group"]}


def _naive_forward_step(data_iterator, model):
    """MCore forward_step_func: per-loop log-probs [R, 1, L] of one full sequence."""
    mb = next(data_iterator)
    logprobs = model(mb["tokens"], labels=mb["labels"]).logprobs
    return logprobs, partial(_naive_loss_func, mb)


# ---- model, DDP, optimizer -----------------------------------------------------------------


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _max_rel_error(a: dict, b: dict) -> float:
    """max over tensors of max |a - b| / max |b| (0/0 counts as 0, x/0 as inf)."""
    worst = 0.0
    for name, ref in b.items():
        diff, scale = (a[name] - ref).abs().max().item(), ref.abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst


# ---- Adam error propagation ----------------------------------------------------------------


class _AdamErrorBound:
    """Elementwise bounds on |m_A - m_B|, |v_A - v_B|, |p_A - p_B| for one optimizer shard,
    propagated through torch AdamW from the gradient differences of the two trajectories.

    Step k, B's values g, m, v, p and e = |g_A - g_B| (elementwise, this step's reduced
    gradients; that they agree at equal parameters is checked separately, against C):
        Em <- b1 Em + (1 - b1) e                         (m is linear in g)
        Ev <- b2 Ev + (1 - b2) (2 |g| e + e^2)           (g^2 moves by <= 2|g|e + e^2)
        D = sqrt(v) / sqrt(bc2) + eps,  ED = min(Ev / sqrt(v), sqrt(Ev)) / sqrt(bc2)
        |m_A / D_A - m / D| <= Em / D_lo + |m| ED / (D D_lo),   D_lo = max(D - ED, eps)
        Ep <- (1 - lr wd) Ep + lr / bc1 * (that)
    plus ADAM_ROUNDING * |value| per step for AdamW's own rounding. The bound is tight where
    sqrt(v) >> eps and e << |g|, and large where a gradient is as small as its own rounding
    error: there m / sqrt(v) turns a relative gradient error of O(1) into an O(lr) step."""

    def __init__(self, numel: int):
        self.Em, self.Ev, self.Ep = (torch.zeros(numel, dtype=torch.float64) for _ in range(3))

    def update(self, e, g, m, v, p, step: int, lr: float, wd: float) -> None:
        e, g, m, v, p = (t.detach().double() for t in (e, g, m, v, p))
        b1, b2 = BETAS
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        self.Em = b1 * self.Em + (1 - b1) * e + ADAM_ROUNDING * m.abs()
        self.Ev = b2 * self.Ev + (1 - b2) * (2 * g.abs() * e + e * e) + ADAM_ROUNDING * v
        sqrt_v = v.sqrt()
        D = sqrt_v / math.sqrt(bc2) + ADAM_EPS
        ED = torch.minimum(self.Ev / sqrt_v.clamp_min(1e-300), self.Ev.sqrt()) / math.sqrt(bc2)
        ED = ED + ADAM_ROUNDING * D
        D_lo = (D - ED).clamp_min(ADAM_EPS)
        Ed = self.Em / D_lo + m.abs() * ED / (D * D_lo) + ADAM_ROUNDING * (m / D).abs()
        self.Ep = (1 - lr * wd) * self.Ep + lr / bc1 * Ed + ADAM_ROUNDING * p.abs()


def _distributed(optimizer):
    """The one DistributedOptimizer inside get_megatron_optimizer's ChainedOptimizer."""
    (inner,) = getattr(optimizer, "chained_optimizers", [optimizer])
    return inner


def _shards(optimizer, model) -> list:
    """(model param, shard param, range) for every shard this rank's AdamW updates; the
    shard params are views of the model params, in the same order for identical models."""
    optimizer = _distributed(optimizer)
    out = []
    for model_group, shard_group in zip(optimizer.model_fp32_groups, optimizer.shard_fp32_groups):
        for param, shard in zip(model_group, shard_group):
            out.append((param, shard, optimizer._get_model_param_range_map(param)["param"]))
    return out


def _shard_grads(shards) -> list:
    """This rank's reduced gradient of every shard (its own part of the grad buffer)."""
    return [param.main_grad.view(-1)[r.start : r.end].clone() for param, _, r in shards]


# ---- one rank ------------------------------------------------------------------------------


def _step_a(model_a, groups, wave_size: int, normalization: str, prompt: str) -> list:
    from scalerlt_mcore.rl.objective import RLObjective, rl_forward_step
    from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func

    objective = RLObjective(normalization=normalization, loop_weights="progressive",
                            clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=KL_COEF)
    # the prompt replayed in 3 query segments ("inputs": with a prefix state of layer inputs)
    segments = {"segments": 3, "inputs": 3}.get(prompt, 1)
    schedule = get_shared_prefix_forward_backward_func(
        wave_size, prompt="recompute" if segments > 1 else prompt, prompt_segments=segments,
        state_kind="inputs" if prompt == "inputs" else "kv")
    return schedule(forward_step_func=rl_forward_step(objective), data_iterator=iter(groups),
                    model=[model_a], num_microbatches=len(groups), seq_length=MAX_SEQ,
                    micro_batch_size=1)


def _step_naive(model, groups, normalization: str) -> list:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mbs = _naive_microbatches(groups, normalization)
    return get_forward_backward_func()(
        forward_step_func=_naive_forward_step, data_iterator=iter(mbs), model=[model],
        num_microbatches=len(mbs), seq_length=MAX_SEQ, micro_batch_size=1,
    )


def _loss_error(results_a, results_naive, num_groups: int) -> float:
    """max over groups of |L_A - L_naive| / sum |terms|."""
    worst = 0.0
    for gi in range(num_groups):
        mine = [r for r in results_naive if r["group"] == gi]
        loss = sum(r["loss"] for r in mine).item()
        scale = sum(r["scale"] for r in mine).item()
        worst = max(worst, abs(results_a[gi]["loss"].item() - loss) / scale)
    return worst


@torch.no_grad()
def _copy_params(dst, src) -> None:
    for d, s in zip(dst.parameters(), src.parameters()):
        d.copy_(s)


def _train(rank, world_size, overlap_grad_reduce, prompts):
    """Train A (joint replay) and B (naive) side by side; C (naive) is evaluated at A's
    parameters every step. Returns per-step gradient errors and final state errors."""
    (model_a, opt_a), (model_b, opt_b), (model_c, _) = (_build(overlap_grad_reduce)
                                                        for _ in range(3))
    init = _flat_params(model_a)
    assert torch.equal(init, _flat_params(model_b)), "replicas must start identical"
    shards_a, shards_b = _shards(opt_a, model_a), _shards(opt_b, model_b)
    bounds = [_AdamErrorBound(shard.numel()) for _, shard, _ in shards_b]
    init_b = [shard.detach().clone() for _, shard, _ in shards_b]
    torch_groups = {id(p): g for g in opt_b.optimizer.param_groups for p in g["params"]}
    out = {"buckets": [_num_buckets(m) for m in (model_a, model_b, model_c)],
           "err_ac": [], "err_ac_tensor": [], "err_ab": [], "err_cb": [], "loss_err": [],
           "waves": [], "retain": [], "segments": [], "inputs": []}
    for step, (wave_size, *_) in enumerate(PLAN):
        normalization = NORMALIZATIONS[step % len(NORMALIZATIONS)]
        groups = _groups(step, rank)
        for model in (model_a, model_b, model_c):
            model.zero_grad_buffer()
        opt_a.zero_grad()
        opt_b.zero_grad()
        _copy_params(model_c, model_a)
        prompt = prompts[step % len(prompts)]
        results_a = _step_a(model_a, groups, wave_size, normalization, prompt)
        _step_naive(model_b, groups, normalization)
        results_c = _step_naive(model_c, groups, normalization)
        out["waves"].append([r["num_waves"] for r in results_a])
        out["retain"].append([int(r["retain"]) for r in results_a])
        out["segments"].append([int(r["prompt_segments"]) for r in results_a])
        out["inputs"].append([int(r["state_inputs"]) for r in results_a])
        out["loss_err"].append(_loss_error(results_a, results_c, len(groups)))
        grads = [_reduced_grads(m, rank, world_size) for m in (model_a, model_b, model_c)]
        out["err_ac"].append(_global_rel_error(grads[0], grads[2]))
        out["err_ac_tensor"].append(_max_rel_error(grads[0], grads[2]))
        out["err_ab"].append(_max_rel_error(grads[0], grads[1]))
        out["err_cb"].append(_max_rel_error(grads[2], grads[1]))
        g_a, g_b = _shard_grads(shards_a), _shard_grads(shards_b)
        for opt in (opt_a, opt_b):
            ok, _, _ = opt.step()
            assert ok
        for (_, shard, _), ga, gb, bound in zip(shards_b, g_a, g_b, bounds):
            state, group = opt_b.optimizer.state[shard], torch_groups[id(shard)]
            assert group["lr"] == LR
            bound.update((ga - gb).abs(), gb, state["exp_avg"], state["exp_avg_sq"], shard,
                         int(state["step"]), group["lr"], group["weight_decay"])
    out.update(_final_errors(opt_a, opt_b, shards_a, shards_b, bounds, init_b))
    out.update(init=init, params_a=_flat_params(model_a), params_b=_flat_params(model_b))
    return out


def _final_errors(opt_a, opt_b, shards_a, shards_b, bounds, init_b) -> dict:
    """Per quantity (param, exp_avg, exp_avg_sq) over this rank's shards: max |A - B|, the
    largest |A - B| / bound, the entries whose bound is vacuous (param: >= lr, a full Adam
    step; moments: >= |value|), and ||bound|| / ||reference|| (param: the distance B moved
    from its init; moments: the moment itself)."""
    report = {}
    for key, attr in (("param", "Ep"), ("exp_avg", "Em"), ("exp_avg_sq", "Ev")):
        err, ratio, vacuous, total, sq_bound, sq_ref = 0.0, 0.0, 0, 0, 0.0, 0.0
        for (_, sa, _), (_, sb, _), bound, p0 in zip(shards_a, shards_b, bounds, init_b):
            if key == "param":
                a, b = sa.detach().double(), sb.detach().double()
                ref, floor = b - p0.double(), LR
            else:
                a = opt_a.optimizer.state[sa][key].double()
                b = opt_b.optimizer.state[sb][key].double()
                ref = floor = b.abs()
            diff, limit = (a - b).abs(), getattr(bound, attr)
            err = max(err, diff.max().item())
            ratio = max(ratio, torch.where(diff == 0, 0.0, diff / limit).max().item())
            vacuous += int(((limit > 0) & (limit >= floor)).sum())
            total += b.numel()
            sq_bound += limit.square().sum().item()
            sq_ref += ref.square().sum().item()
        report[key] = {"err": err, "ratio": ratio, "vacuous": vacuous, "total": total,
                       "norm_ratio": math.sqrt(sq_bound / sq_ref)}
    return report


# ---- the test ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap_grad_reduce,prompts", [
    (True, ("retain", "recompute")), (False, ("recompute", "retain")),
    (True, ("segments", "retain")), (True, ("inputs", "retain"))])
def test_joint_replay_matches_naive_under_ddp(overlap_grad_reduce, prompts):
    ranks = run_distributed(_train, WORLD, overlap_grad_reduce, prompts, timeout=150)
    r0, r1 = ranks
    for r in ranks:  # MCore sets bucket_size = None (one bucket) without overlap_grad_reduce
        assert len(set(r["buckets"])) == 1
        assert (r["buckets"][0] > 1) if overlap_grad_reduce else (r["buckets"][0] == 1)
    waves = [int(w) for r in ranks for step in r["waves"] for w in step]
    assert len(set(waves)) >= 4, "the plan must exercise different wave counts"
    for r in ranks:  # the segmented steps subdivide (with layer inputs), the others do not
        for step, (segments, inputs) in enumerate(zip(r["segments"], r["inputs"])):
            mode = prompts[step % len(prompts)]
            assert set(segments) == {3 if mode in ("segments", "inputs") else 1}, (step, segments)
            assert set(inputs) == {int(mode == "inputs")}, (step, inputs)
    for mode, flag in (("retain", 1), ("recompute", 0)):  # each mode with several wave counts
        counts = {int(w) for r in ranks for ws, fs in zip(r["waves"], r["retain"])
                  for w, f in zip(ws, fs) if f == flag and w > 1}
        assert len(counts) >= 2, f"{mode}: wave counts {counts}"
    assert r0["err_ac"] == r1["err_ac"], "reduced grads are the same on both ranks"
    for step, (ac, loss) in enumerate(zip(r0["err_ac"], r0["loss_err"])):
        assert ac <= GRAD_RTOL, f"step {step}: joint replay vs naive grad rel error {ac:.2e}"
        assert loss <= LOSS_RTOL, f"step {step}: group loss rel error {loss:.2e}"
    # step 0: B and C are the same computation at the same parameters as A
    assert r0["err_cb"][0] == 0.0 and r0["err_ab"][0] == r0["err_ac_tensor"][0]
    print("per-step A-vs-C grad error, whole gradient:", [f"{e:.1e}" for e in r0["err_ac"]])
    print("per-step A-vs-C grad error, worst tensor:", [f"{e:.1e}" for e in r0["err_ac_tensor"]])
    for key in ("param", "exp_avg", "exp_avg_sq"):
        for r in ranks:
            got = r[key]
            assert got["ratio"] <= 1.0, f"{key}: A-vs-B error exceeds its derived bound: {got}"
            assert got["vacuous"] <= MAX_VACUOUS * got["total"], f"{key}: bound vacuous {got}"
            assert got["norm_ratio"] <= MAX_BOUND_NORM, f"{key}: bound too loose {got}"
    assert torch.equal(r0["params_a"], r1["params_a"]), "A's ranks must hold identical params"
    assert torch.equal(r0["params_b"], r1["params_b"]), "B's ranks must hold identical params"
    assert not torch.equal(r0["init"], r0["params_a"]), "the optimizer must change params"
