"""Exit gate (Ouro/LoopLM) and loop credit from it (RLTT ``exit_pdf``, ``learned``).

- The exit distribution against the product formula written here; it sums to one.
- The gate is MCore-built, in the state dict, absent when off.
- With truncated backprop to one loop the gate gets no gradient: the run config refuses it.
- Joint replay with ``exit_pdf`` / ``learned`` credit and the gate's entropy-regularised term
  matches NAIVE training through stock MCore with a loss written here in plain PyTorch:
  fp64 <= 1e-12, fp32 <= 1e-6 relative per tensor. With the gate's own term in fp32 the naive
  reference itself lies about 1e-6 from the fp64 result of the same weights (measured 0.7e-6
  to 1.8e-6 on these tiny models), so there the fp32 check is that joint replay's distance
  from the fp64 result is within twice the stock fp32 reference's (fp64: 1e-12 as elsewhere).
"""


import pytest
import torch
from helpers.exit_gate import _gated, _joint, _naive
from helpers.fp32_exact import fp64_group, fp64_twin, whole_gradient_error
from helpers.sp import (
    LossSpec,
    build_model,
    grads,
    make_group,
    rel_errors,
    rel_errors_with_zeros,
)

from scalerlt_mcore.app.config import ConfigError, parse_args, validate
from scalerlt_mcore.model.block import exit_log_distribution

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
DTYPES = {"f64": torch.float64, "f32": torch.float32}


def test_exit_distribution_is_the_product_formula():
    g = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lam = torch.sigmoid(g)
    want = []
    for r in range(4):
        survive = torch.ones_like(lam[0])
        for j in range(r):
            survive = survive * (1 - lam[j])
        want.append(survive if r == 3 else lam[r] * survive)
    got = exit_log_distribution(g).exp()
    assert torch.allclose(got, torch.stack(want), rtol=0, atol=1e-15)
    assert torch.allclose(got.sum(0), torch.ones(3, 5, dtype=torch.float64), atol=1e-15)


def test_gate_is_built_only_when_on(mcore_single):
    plain = build_model(R=2)
    gated = _gated(R=2, arch=False, learned=True)
    names = {n for n, _ in gated.named_parameters()} - {n for n, _ in plain.named_parameters()}
    assert names == {"decoder.exit_gate.linear.weight", "decoder.exit_gate.linear.bias",
                     "decoder.loop_weights.logits"}
    assert plain.decoder.exit_gate is None and plain.decoder.loop_weights is None
    assert "decoder.exit_gate.linear.weight" in gated.state_dict()  # saved in checkpoints
    assert gated.decoder.exit_gate.linear.weight.shape == (1, 16)
    tokens = torch.randint(0, 48, (2, 5), generator=torch.Generator().manual_seed(1))
    out = gated(tokens, labels=tokens)
    assert out.exit_logprobs.shape == (2, 2, 5)
    assert plain(tokens, labels=tokens).exit_logprobs is None


# ---- the reference loss, in plain PyTorch --------------------------------------------------


# dtype, G, W, R, arch, checkpoint, credit, gate coef, entropy coef, attn, k (backprop loops)
GRID = [
    ("f64", 5, 2, 3, True, False, "exit_pdf", 0.5, 0.1, "cascade", 0),
    ("f64", 4, 3, 2, False, True, "exit_pdf", 0.0, 0.0, "concat", 0),
    ("f64", 6, 4, 3, True, True, "learned", 0.3, 0.05, "cascade", 0),
    ("f32", 5, 2, 3, True, False, "exit_pdf", 0.0, 0.0, "cascade", 0),
    ("f32", 3, 1, 2, True, True, "learned", 0.0, 0.0, "concat", 0),
    ("f64", 5, 2, 4, True, False, "exit_pdf", 0.5, 0.1, "cascade", 2),
]


@pytest.mark.parametrize("row", GRID, ids=["-".join(map(str, r)) for r in GRID])
def test_joint_replay_matches_naive(mcore_single, row):
    dt, G, W, R, arch, ck, scheme, gate_coef, beta, attn, k = row
    dtype = DTYPES[dt]
    def build(dt):
        return _gated(R=R, arch=arch, attn=attn, learned=scheme == "learned",
                      looped_backprop_loops=k).to(dt)

    model = build(dtype)
    group = make_group(G, 8, 4, R, seed=60 + G, dtype=dtype, kl=True)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05)
    if dtype == torch.float32:  # the exact run of the same weights (tests/helpers/fp32_exact.py)
        exact_model = fp64_twin(model, build(torch.float64))
        naive_loss = _naive(exact_model, [fp64_group(group)], spec, scheme, gate_coef, beta,
                            per_mb=2)
        ref = grads(exact_model)
    else:
        naive_loss = _naive(model, [group], spec, scheme, gate_coef, beta, per_mb=2)
        ref = grads(model)
        model.zero_grad(set_to_none=True)
    out = _joint(model, [group], spec, scheme, gate_coef, beta, W, ck)
    tol = TOL[dtype]
    assert abs(float(out[0]["loss"]) - naive_loss) <= tol * abs(naive_loss)
    # exit_pdf credit is detached (learned credit ignores the gate): without the gate's own
    # term the gate gets no gradient
    zero = ({"decoder.exit_gate.linear.weight", "decoder.exit_gate.linear.bias"}
            if gate_coef == 0 else set())
    errs = rel_errors_with_zeros(grads(model), ref, zero)  # zeros checked on both sides
    if dtype == torch.float32:
        assert whole_gradient_error(grads(model), ref) <= tol, errs
    else:
        assert max(errs.values()) <= tol, {n: e for n, e in errs.items() if e > tol}
    assert 1.0 <= float(out[0]["exit_loop"] / out[0]["tokens"]) <= R


def test_two_groups_in_one_step(mcore_single):
    R = 3
    model = _gated(R=R).double()
    groups = [make_group(5, 9, 4, R, seed=1, group_id=3), make_group(4, 6, 6, R, seed=2)]
    spec = LossSpec(normalization="token_mean")
    _naive(model, groups, spec, "exit_pdf", 0.5, 0.1, per_mb=3)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    _joint(model, groups, spec, "exit_pdf", 0.5, 0.1, 2, True)
    assert max(rel_errors(grads(model), ref).values()) <= 1e-12


def test_exit_pdf_without_a_gate_is_refused(mcore_single):
    model = build_model(R=2).double()
    group = make_group(3, 6, 3, 2, seed=4)
    with pytest.raises(ValueError, match=r"loop weights 'exit_pdf' need the model's exit gate"):
        _joint(model, [group], LossSpec(), "exit_pdf", 0.0, 0.0, 2, False)


def test_fp32_gate_term_error_is_the_references_own(mcore_single):
    """fp32 with the gate's term: joint replay and the stock fp32 reference against the fp64
    naive result of the same weights; joint replay may not add error of its own."""
    R, G, W = 3, 5, 2
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05)
    m32 = _gated(R=R).float()
    m64 = _gated(R=R).double()
    m64.load_state_dict({k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                         for k, v in m32.state_dict().items()})
    g64 = make_group(G, 8, 4, R, seed=65, dtype=torch.float64, kl=True)
    g32 = make_group(G, 8, 4, R, seed=65, dtype=torch.float64, kl=True)
    for name in ("loss_mask", "advantages", "old_logprobs", "ref_logprobs"):
        setattr(g32, name, getattr(g32, name).float())
    _naive(m64, [g64], spec, "exit_pdf", 1.0, 0.2, per_mb=2)
    truth = grads(m64)
    _naive(m32, [g32], spec, "exit_pdf", 1.0, 0.2, per_mb=2)
    naive = max(rel_errors(grads(m32), truth).values())
    m32.zero_grad(set_to_none=True)
    _joint(m32, [g32], spec, "exit_pdf", 1.0, 0.2, W, False)
    joint = max(rel_errors(grads(m32), truth).values())
    print(f"\n[exit gate fp32] max relative grad error vs fp64: naive {naive:.2e}, "
          f"joint {joint:.2e}")
    assert naive < 1e-5  # the same weights: only fp32 roundoff separates them
    assert joint <= 2 * naive  # measured 2.31e-6 vs 1.47e-6


@pytest.mark.parametrize("k", [1, 2])
def test_gate_gets_gradient_unless_one_loop_trains(mcore_single, k):
    """Why the run configuration refuses looped_backprop_loops 1 with the gate: the gates of the
    loops run without a graph are detached and the last loop's gate is unused (it takes the
    remaining exit mass), so even the gate's own term leaves it without gradient; k = 2 trains
    it."""
    R = 3
    model = _gated(R=R, looped_backprop_loops=k).double()
    _joint(model, [make_group(4, 6, 3, R, seed=9, kl=True)], LossSpec(kl_coef=0.05),
           "exit_pdf", 0.5, 0.1, 2, False)
    gate = [p.grad for p in model.decoder.exit_gate.parameters()]
    assert all(g is None or not g.any() for g in gate) == (k == 1)


@pytest.mark.parametrize("k", ["0", "1", "2"])
def test_run_config_refuses_the_gate_with_one_backprop_loop(k):
    cfg = parse_args(["--looped-exit-gate", "true", "--rl-exit-gate-coef", "0.1",
                      "--looped-injection", "linear_concat", "--looped-backprop-loops", k])
    if k != "1":
        validate(cfg, world_size=1)
        return
    with pytest.raises(ConfigError, match=r"looped_exit_gate needs looped_backprop_loops 0 or "
                                          r">= 2: with 1 the gate gets no gradient"):
        validate(cfg, world_size=1)
