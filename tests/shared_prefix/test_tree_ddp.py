"""Prefix trees under MCore DDP (overlapped grad reduction, distributed optimizer) on 2 gloo
ranks: trees of different shapes on each rank and in consecutive steps. Every step has exactly
one sync-enabled backward, in which DDP's hooks launch every bucket's reduction (the
per-parameter hook counts of the first step repeat every step; the root replayed in prompt
segments too), and the reduced gradients
equal naive training's (stock MCore over the root-to-leaf rows, the loss in plain PyTorch:
tests/helpers/sp.py) at the same parameters."""

import torch
from helpers.ddp import LOOPS, _build, _global_rel_error, _reduced_grads

from scalerlt_mcore.shared_prefix.planner import GroupPlan
from scalerlt_mcore.testing import run_distributed

SHALLOW = [(None, 4), (0, 2), (1, 2), (1, 1), (0, 3)]
"""Depth 2: an internal node with two leaves, a leaf child of the root."""

WIDE = [(None, 3), (0, 1), (0, 2), (1, 2), (1, 1), (2, 3), (2, 1), (2, 2)]
"""Depth 2: two internal nodes, 2 and 3 leaves."""

DEEP = [(None, 3), (0, 2), (1, 2), (2, 1), (2, 2), (1, 1)]
"""Depth 3: a chain of internal nodes, leaves at depths 2 and 3."""

# Per step: the groups of rank 0 and of rank 1 (tree shapes, "flat": a one-level group).
# Step 0 records DDP's per-parameter hook counts; every later step must repeat them. Odd
# steps retain every node's graph, even ones recompute.
STEPS = (
    (("SHALLOW",), ("DEEP",)),
    (("DEEP", "flat"), ("WIDE",)),
    (("WIDE",), ("SHALLOW", "DEEP")),
)
GRAD_RTOL = 1e-6
"""fp32, over the whole reduced gradient (as tests/shared_prefix/test_joint_replay_ddp.py)."""


def _groups(step: int, rank: int) -> list:
    from helpers.sp import make_group
    from helpers.tree import tree_group

    shapes = {"SHALLOW": SHALLOW, "WIDE": WIDE, "DEEP": DEEP}
    out = []
    for k, name in enumerate(STEPS[step][rank]):
        seed, gid = 100 * step + 10 * rank + k, 10 * step + k
        if name == "flat":
            out.append(make_group(3, 5, 4, LOOPS, seed=seed, dtype=torch.float32, kl=True,
                                  group_id=gid))
        else:
            out.append(tree_group(shapes[name], LOOPS, seed=seed, dtype=torch.float32, kl=True,
                                  group_id=gid))
    return out


class _Counts:
    """Backward calls outside no_sync and the bucket reductions DDP's hooks launch in them."""

    def __init__(self, model):
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

        self.synced, self.launched, self.inside_no_sync, self.in_backward = 0, 0, False, False
        backward, launch = torch.autograd.backward, _ParamAndGradBucketGroup.start_grad_sync
        no_sync = model.no_sync

        def counted_backward(*args, **kwargs):
            self.synced += not self.inside_no_sync
            self.in_backward = True
            try:
                return backward(*args, **kwargs)
            finally:
                self.in_backward = False

        def counted_launch(group, *args, **kwargs):
            self.launched += self.in_backward
            return launch(group, *args, **kwargs)

        def counted_no_sync():
            import contextlib

            @contextlib.contextmanager
            def ctx():
                with no_sync():
                    self.inside_no_sync = True
                    try:
                        yield
                    finally:
                        self.inside_no_sync = False
            return ctx()

        torch.autograd.backward = counted_backward
        _ParamAndGradBucketGroup.start_grad_sync = counted_launch
        model.config.no_sync_func = counted_no_sync
        self._restore = lambda: (setattr(torch.autograd, "backward", backward),
                                 setattr(_ParamAndGradBucketGroup, "start_grad_sync", launch))

    def restore(self):
        self._restore()


PROMPTS = ({"prompt": "recompute"}, {"prompt": "retain"},
           {"chooser": lambda group, model, num_loops=None: GroupPlan(2, prompt_segments=2)})
"""Each step's plan: every node recomputed, retained, or the root replayed in 2 segments."""


def _worker(rank: int, world_size: int) -> dict:
    from helpers.sp import LossSpec, joint_step, naive_step

    spec = LossSpec(normalization="seq_mean", clip_high=0.28, kl_coef=0.05,
                    loop_weights="progressive")
    joint, opt = _build(True)
    naive, _ = _build(True)
    report = {"synced": [], "launched": [], "errors": [], "buckets": len(joint.bucket_groups)}
    for step in range(len(STEPS)):
        groups = _groups(step, rank)
        with torch.no_grad():
            for p, q in zip(naive.module.parameters(), joint.module.parameters()):
                p.copy_(q)
        for m in (joint, naive):
            m.zero_grad_buffer()
        opt.zero_grad()
        counts = _Counts(joint)
        try:
            joint_step(joint, groups, spec, 2, **PROMPTS[step % len(PROMPTS)])
        finally:
            counts.restore()
        naive_step(naive, groups, spec, 2)
        report["synced"].append(counts.synced)
        report["launched"].append(counts.launched)
        report["errors"].append(_global_rel_error(_reduced_grads(joint, rank, world_size),
                                                  _reduced_grads(naive, rank, world_size)))
        opt.step()
    return report


def test_trees_under_ddp_one_sync_backward_and_naive_gradients():
    reports = run_distributed(_worker, 2, timeout=600)
    for rank, r in enumerate(reports):
        assert r["synced"] == [1] * len(STEPS), (rank, r["synced"])
        # the first step records the hook counts (MCore launches nothing then); every later
        # step's one sync backward repeats them, so its hooks launch every bucket's reduction
        assert r["launched"] == [0] + [r["buckets"]] * (len(STEPS) - 1), (rank, r)
        assert r["buckets"] > 1
        assert max(r["errors"]) <= GRAD_RTOL, (rank, r["errors"])
    print(f"\n[tree DDP] max reduced-gradient error {max(max(r['errors']) for r in reports):.3e}")
