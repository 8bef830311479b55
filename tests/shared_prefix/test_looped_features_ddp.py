"""Looped-training features under MCore DDP (overlapped reduction, several buckets) and the
distributed optimizer, on 2 gloo ranks: the exit gate with ``exit_pdf`` credit and the gate's
entropy-regularised term, truncated backprop (k = 1) and a loop count drawn per step
(``uniform:2,3``, the same on both ranks).

Per rank two replicas of one model: A trained by joint replay, C a naive step through stock
MCore ``get_forward_backward_func()`` (reference loss in plain PyTorch,
tests/helpers/exit_gate.py) at A's parameters. Every step the fully reduced gradients of A and C
agree to 1e-6 of the whole gradient's largest entry (as
tests/shared_prefix/test_joint_replay_ddp.py), A's ranks hold identical parameters, and the
optimizer moves them.
"""

import torch

from scalerlt_mcore.testing import run_distributed

WORLD, VOCAB, MAX_SEQ, LOOPS, STEPS = 2, 48, 24, 3, 4
GATE_COEF, BETA = 0.5, 0.1
GRAD_RTOL = 1e-6


def _build():
    """test_joint_replay_ddp's model and optimizer (overlapped reduction, several buckets),
    with the exit gate and truncated backprop (k = 1), and no weight decay (plain Adam)."""
    from helpers.ddp import _build as build_ddp

    return build_ddp(True, seed=3, vocab=VOCAB, max_seq=MAX_SEQ, weight_decay=0.0,
                     looped_exit_gate=True, looped_backprop_loops=1)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _train(rank, world_size):
    from helpers.ddp import _global_rel_error, _num_buckets, _reduced_grads
    from helpers.exit_gate import _joint, _naive
    from helpers.sp import LossSpec, make_group

    from scalerlt_mcore.model.config import sample_num_loops

    (model_a, opt_a), (model_c, _) = _build(), _build()
    init = _flat(model_a)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05)
    out = {"err": [], "loops": [], "buckets": _num_buckets(model_a)}
    for step in range(STEPS):
        loops = sample_num_loops("uniform:2,3", LOOPS, seed=11, step=step)
        for m in (model_a, model_c):
            m.zero_grad_buffer()
        opt_a.zero_grad()
        with torch.no_grad():
            for d, s in zip(model_c.parameters(), model_a.parameters()):
                d.copy_(s)
        sizes = [(3 + step + rank) % 5 + 1, 2 + rank]
        groups = [make_group(G, 6 + n, 4, loops, seed=100 * step + 10 * rank + n,
                             dtype=torch.float32, kl=True, group_id=n)
                  for n, G in enumerate(sizes)]
        _joint(model_a, groups, spec, "exit_pdf", GATE_COEF, BETA, 2, False, num_loops=loops)
        _naive(model_c, groups, spec, "exit_pdf", GATE_COEF, BETA, per_mb=2, num_loops=loops)
        grads_a, grads_c = (_reduced_grads(m, rank, world_size) for m in (model_a, model_c))
        out["err"].append(_global_rel_error(grads_a, grads_c))
        out["loops"].append(loops)
        ok, _, _ = opt_a.step()
        assert ok
    out.update(init=init, params=_flat(model_a),
               config_loops=model_a.module.config.looped_num_loops)
    return out


def test_looped_features_under_ddp_and_distributed_optimizer():
    r0, r1 = run_distributed(_train, WORLD, timeout=900)  # 80 s alone; the host is shared
    assert r0["buckets"] > 1
    assert r0["loops"] == r1["loops"] and len(set(r0["loops"])) == 2
    assert r0["config_loops"] == LOOPS  # the step's count was passed, the config untouched
    for r in (r0, r1):
        assert max(r["err"]) <= GRAD_RTOL, r["err"]
    print("\n[features under DDP] per-step A-vs-C grad error, whole gradient:",
          [f"{e:.1e}" for e in r0["err"]], "loops", r0["loops"])
    assert torch.equal(r0["params"], r1["params"])
    assert not torch.equal(r0["init"], r0["params"])
