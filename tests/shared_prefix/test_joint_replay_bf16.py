"""bf16: joint replay adds no error beyond bf16 rounding.

The same weights (bf16-representable, so both models hold exactly the same numbers) in an
fp32 model and a bf16 model. Reference: naive fp32 training through stock MCore. Compared:
joint replay in bf16 and naive training in bf16, each against that fp32 reference.

Tolerance. bf16 keeps 8 significand bits: unit roundoff u = 2^-8 ~ 3.9e-3. A gradient here
passes through D = prelude + R * (L_core + coda) <= 1 + 3 * (2 + 1) = 10 layer applications
forward and again backward, each with ~5 rounded outputs (norm, QKV, attention, projection,
MLP), and is accumulated in a bf16 ``.grad`` once per wave / microbatch. Independent rounding
errors add like a random walk: relative error ~ u * sqrt(2 * 10 * 5) = 10 u ~ 4e-2 relative to
the tensor's max |.|, so every tensor must be within 5e-2. That this bound is met by naive
bf16 too is checked, so it is a property of bf16, not slack for the schedule.

Joint replay against naive bf16. The per-wave prefix adjoints arrive in fp32 (fp32 leaves; on
the CPU flash kernel the prefix part's attention backward runs in fp32; concat sums the
per-sequence K/V grads in fp32; test below), so the schedule adds no rounding of its own
beyond what a bf16 model does anyway. Two comparisons:
- the global relative L2 error must be no more than L2_FACTOR = 1.1x naive bf16's with the
  same gradient accumulation (one microbatch per wave: both add W-response partial gradients
  into the bf16 ``.grad``, as MCore's gradient accumulation would);
- the worst tensor error and the L2 error must be no more than SCHEDULE_FACTOR = 1.5x those
  of naive bf16 with the case's microbatch (all G responses in one for the first two cases,
  one rounding of ``.grad`` where joint replay has one per wave).
The worst-tensor ratio is not held to 1.1x: it is decided by one heavily cancelling tensor
(the prelude's input-LayerNorm weight: gradient max 2.5e-4 vs 0.14 for the output layer), and
two independent rounding errors of it differ by 2x by chance. Measured over 8 seeds x these 3
cases, joint / naive (same accumulation): L2 0.89-1.09 (median 1.01), worst tensor 0.71-1.99;
joint / naive (case's microbatch): L2 0.91-1.15, worst 0.35-1.30. With bf16 adjoints (before):
L2 up to 1.18 against the same accumulation, worst up to 1.64 against the case's microbatch;
even one wave (W = G, no adjoints at all) reached L2 1.29 and worst 1.47 against the latter.
At this file's seed (1234): L2 vs the same accumulation 0.98, 1.08, 1.00; vs the case's
microbatch L2 1.08, 1.14, 1.00 and worst 1.30, 0.84, 0.90.
"""

import pytest
import torch
from helpers.replay_bf16 import (
    BF16_TOL,
    CASES,
    L2_FACTOR,
    SCHEDULE_FACTOR,
    P,
    S,
    _l2_rel,
    _twin_models,
)
from helpers.sp import (
    LossSpec,
    grads,
    joint_step,
    make_group,
    naive_step,
    rel_errors,
)

from scalerlt_mcore.model.kernels import cascade_prefix_attention
from scalerlt_mcore.rl.objective import rl_forward_step
from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func


@pytest.mark.parametrize("case", CASES, ids=["R3-arch-cascade-W2", "R3-arch-concat-W3-ckpt",
                                             "R2-plain-cascade-W1-ckpt"])
def test_bf16_joint_replay_within_bf16_rounding(mcore_single, case):
    R, arch, attn, G, W, ck, spec, per_mb = case
    fp32, bf16 = _twin_models(R=R, arch=arch, attn=attn)
    group = make_group(G, P, S, R, seed=3, dtype=torch.float32, kl=spec.kl_coef > 0)

    ref_losses, _ = naive_step(fp32, [group], spec, per_mb=G)
    ref = grads(fp32)
    naive_losses, _ = naive_step(bf16, [group], spec, per_mb=per_mb)
    naive = grads(bf16)
    bf16.zero_grad(set_to_none=True)
    naive_step(bf16, [group], spec, per_mb=W)  # the same accumulation as the waves
    naive_waves = grads(bf16)
    bf16.zero_grad(set_to_none=True)
    out = joint_step(bf16, [group], spec, W, checkpoint_waves=ck)
    joint = grads(bf16)
    assert all(g.dtype == torch.bfloat16 for g in joint.values())

    e_joint, e_naive = rel_errors(joint, ref), rel_errors(naive, ref)
    worst_joint, worst_naive = max(e_joint.values()), max(e_naive.values())
    l2_joint, l2_naive = _l2_rel(joint, ref), _l2_rel(naive, ref)
    l2_naive_waves = _l2_rel(naive_waves, ref)
    print(f"\n[bf16 vs fp32] max rel-to-max: joint {worst_joint:.3e}, naive {worst_naive:.3e}; "
          f"global L2: joint {l2_joint:.3e}, naive {l2_naive:.3e}, naive with microbatch = "
          f"wave {l2_naive_waves:.3e}")

    loss_ref = float(ref_losses[0])
    assert abs(float(out[0]["loss"]) - loss_ref) <= BF16_TOL * abs(loss_ref)
    assert abs(float(naive_losses[0]) - loss_ref) <= BF16_TOL * abs(loss_ref)
    assert worst_naive <= BF16_TOL, e_naive  # the bound holds for bf16 itself
    bad = {n: e for n, e in e_joint.items() if e > BF16_TOL}
    assert not bad, f"bf16 joint replay grads beyond {BF16_TOL}: {bad}"
    assert worst_joint <= SCHEDULE_FACTOR * worst_naive
    assert l2_joint <= SCHEDULE_FACTOR * l2_naive
    assert l2_joint <= L2_FACTOR * l2_naive_waves


# ---- the per-wave prefix adjoints arrive in fp32 ----------------------------------------------


@pytest.mark.parametrize("attn", ["cascade", "concat"])
def test_per_wave_prefix_adjoints_arrive_in_fp32(mcore_single, attn):
    """bf16 model, two non-final waves: the prefix K/V the waves attend to are fp32 leaves, and
    each wave's gradient arrives in them in fp32, not rounded to bf16 (cascade: the prefix
    part's attention backward runs in fp32; concat: per-sequence bf16 grads summed in fp32).
    The boundary's adjoint is not covered: it comes out of the readout norm's bf16 backward."""
    _, bf16 = _twin_models(R=2, arch=True, attn=attn)
    group = make_group(6, P, S, 2, seed=3, dtype=torch.float32)
    arrived, hooked = [], set()
    wave_step = rl_forward_step(LossSpec().objective())

    def forward_step(data_iterator, model):
        for t in model.state.keys + model.state.values:
            if t.is_leaf and id(t) not in hooked:  # the leaves the non-final waves share
                hooked.add(id(t))
                t.register_hook(arrived.append)
        return wave_step(data_iterator, model)

    get_shared_prefix_forward_backward_func(2)(
        forward_step_func=forward_step, data_iterator=iter([group]), model=bf16,
        num_microbatches=1, seq_length=0, micro_batch_size=1)
    depths = bf16.config.looped_num_depths
    assert len(arrived) == 2 * 2 * depths  # 2 waves x (K, V) x depths
    assert all(g.dtype == torch.float32 for g in arrived)
    # The coda after loop 1 feeds only loop 1's readout, weighted 0 ("final"): zero adjoints.
    nonzero = [g for g in arrived if g.any()]
    assert len(nonzero) == len(arrived) - 2 * 2, len(nonzero)
    rounded = [bool((g == g.to(torch.bfloat16).float()).all()) for g in nonzero]
    assert not any(rounded), f"{sum(rounded)} of {len(nonzero)} adjoints bf16-rounded"


def test_cascade_prefix_grads_with_fp32_prefix(mcore_single):
    """CPU flash cascade with bf16 queries and an fp32 prefix (bf16-representable values):
    the prefix grads are fp32; against an exact fp64 attention over the same inputs dV is
    fp32-accurate (measured 2.7e-5; the bf16 kernel's is 5e-3); dK is limited by the bf16
    merged output the backward reads (rowsum(dO * O)): measured 2.0e-3 (bf16 kernel 3.4e-3)."""
    gen = torch.Generator().manual_seed(0)
    S_, B, heads, groups, hn, P_ = 6, 4, 4, 2, 8, 10
    q, k, v, pk, pv = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in (
        (S_, B, heads, hn), (S_, B, groups, hn), (S_, B, groups, hn), (P_, 1, groups, hn),
        (P_, 1, groups, hn)))
    dout = torch.randn(B, heads, S_, hn, generator=gen).to(torch.bfloat16)
    scale = hn**-0.5
    exact = _exact_prefix_grads(q, k, v, pk, pv, dout, scale)
    errors = {}
    for dtype in (torch.bfloat16, torch.float32):
        wide = [t.detach().to(dtype).requires_grad_() for t in (pk, pv)]
        out = cascade_prefix_attention(q, k, v, *wide, scale, kernel="cpu_flash")
        (out.float() * dout.float()).sum().backward()
        assert all(t.grad.dtype == dtype for t in wide)
        errors[dtype] = [float((t.grad.double() - e).abs().max() / e.abs().max())
                         for t, e in zip(wide, exact)]
    (dk16, dv16), (dk32, dv32) = errors[torch.bfloat16], errors[torch.float32]
    assert dv32 <= 2e-4 < dv16, errors
    assert dk32 < dk16, errors
    # The matmul path (the reference) takes the wider prefix too; it computes in bf16.
    wide = [t.detach().float().requires_grad_() for t in (pk, pv)]
    out = cascade_prefix_attention(q, k, v, *wide, scale, kernel="matmul")
    (out.float() * dout.float()).sum().backward()
    assert all(t.grad.dtype == torch.float32 and t.grad.any() for t in wide)


def _exact_prefix_grads(q, k, v, pk, pv, dout, scale) -> list:
    """fp64 softmax attention of each suffix query over the whole prefix and its own causal
    keys (plain PyTorch); returns the grads of pk and pv for the upstream gradient dout."""
    q, k, v, pk, pv = (t.double().requires_grad_() for t in (q, k, v, pk, pv))
    S_, B, heads, hn = q.shape
    P_, rep = pk.shape[0], heads // k.shape[2]
    keys = torch.cat([pk.expand(P_, B, -1, -1), k]).repeat_interleave(rep, 2)  # [P+S, B, np, hn]
    vals = torch.cat([pv.expand(P_, B, -1, -1), v]).repeat_interleave(rep, 2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, keys) * scale  # [B, np, S, P+S]
    allowed = torch.ones(S_, P_ + S_, dtype=torch.bool).tril(diagonal=P_)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = torch.einsum("bnst,tbnd->bnsd", probs, vals)  # [B, np, S, hn]
    (out * dout.double()).sum().backward()
    return [pk.grad, pv.grad]
