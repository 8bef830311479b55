"""Prefix trees at tensor parallelism 2 (2 gloo ranks): joint replay over a depth-3 and a
depth-2 tree (per-token masks, uneven branching) equals naive stock-MCore training of their
root-to-leaf rows on the same sharded model (the loss in plain PyTorch: tests/helpers/sp.py),
per local gradient shard, fp64 <= 1e-12 relative per tensor; scored (forward_only) and trained
again with zero advantages and the KL reference the scored policy, the gradient is exactly 0
(scoring is the training forward, bit for bit, at TP=2 too)."""

import torch

from scalerlt_mcore.testing import run_distributed

TP, LOOPS = 2, 2


def _model():
    from helpers.sp import build_model

    model = build_model(R=LOOPS, arch=True, hidden=16, heads=4, num_query_groups=2,
                        tensor_model_parallel_size=TP)
    return model.double()


def _worker(rank: int, world_size: int) -> dict:
    from helpers.sp import VOCAB, LossSpec, grads, joint_step, naive_step, rel_errors
    from helpers.tree import DEPTH2, DEPTH3, tree_group

    torch.manual_seed(0)
    model = _model()
    assert model.embedding.word_embeddings.weight.shape[0] == VOCAB // TP  # sharded
    groups = [tree_group(DEPTH3, LOOPS, seed=31, kl=True, group_id=1),
              tree_group(DEPTH2, LOOPS, seed=32, kl=True, group_id=2)]
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="uniform")
    naive_losses, _ = naive_step(model, groups, spec, 2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, groups, spec, 2)
    loss_errs = [abs(float(o["loss"]) - float(n)) / abs(float(n))
                 for o, n in zip(out, naive_losses)]
    report = {"grad": max(rel_errors(grads(model), ref).values()), "loss": max(loss_errs)}
    for g in groups:  # scored as they train: zero advantages, KL to ref = policy -> no gradient
        scored = joint_step(model, [g], LossSpec(), 2, forward_only=True)[0]["logprobs"]
        g.old_logprobs, g.ref_logprobs = scored, scored.clone()
        g.advantages = torch.zeros_like(g.advantages)
    model.zero_grad(set_to_none=True)
    joint_step(model, groups, spec, 2)
    report["still"] = max(float(p.grad.abs().max()) for p in model.parameters()
                          if p.grad is not None)
    return report


def test_tree_at_tp2_matches_naive():
    reports = run_distributed(_worker, TP, tensor_model_parallel_size=TP, timeout=600)
    for rank, r in enumerate(reports):
        assert r["grad"] <= 1e-12 and r["loss"] <= 1e-12 and r["still"] == 0, (rank, r)
    print(f"\n[tree TP=2] max relative grad error {max(r['grad'] for r in reports):.3e}")
