"""Saved activations: joint replay holds the prompt once plus one wave; naive holds all G
full sequences (docs/design.md section 2, cost table).

Measured with ``SavedTensorProbe`` (peak bytes of tensors autograd saves for backward,
parameters excluded) around one training step of the same group on the same model:
joint replay (G=8, W=2, no checkpointing) vs naive training with all G prompt+response
sequences in ONE microbatch through stock MCore ``get_forward_backward_func()``.
With P = 4S, the naive step saves about G * (P + S) = 320 token-activations, joint replay
about P + W * S = 48 (the prompt recompute plus the last wave), so <= 1/3 has a wide margin
for the per-token logits and attention terms.
"""

import pytest
import torch
from helpers.sp import LossSpec, build_model, joint_step, make_group, naive_step

from scalerlt_mcore.shared_prefix import SavedTensorProbe

G, P, S, HIDDEN, HEADS, R, W = 8, 32, 8, 32, 4, 2, 2



@pytest.fixture
def model(mcore_single):
    return build_model(R=R, hidden=HIDDEN, heads=HEADS)


def _peak(model, step) -> int:
    model.zero_grad(set_to_none=True)
    with SavedTensorProbe(model) as probe:
        step()
    assert probe.current_bytes == 0  # every saved tensor was released by the backward
    return probe.peak_bytes


def _naive(model, group):
    return _peak(model, lambda: naive_step(model, [group], LossSpec(), per_mb=group.group_size))


def _joint(model, group):
    return _peak(model, lambda: joint_step(model, [group], LossSpec(), W))


def test_joint_replay_saves_at_most_a_third_of_naive(model):
    group = make_group(G, P, S, R, seed=0, dtype=torch.float32)
    naive, joint = _naive(model, group), _joint(model, group)
    ratio = joint / naive
    print(f"\n[saved-tensor peak] G={G} P={P} S={S} hidden={HIDDEN} R={R} W={W}: "
          f"naive {naive} B, joint replay {joint} B, ratio {ratio:.4f}")
    assert ratio <= 1 / 3, f"joint replay peak {joint} B is {ratio:.3f} of naive {naive} B"


def test_probe_is_deterministic(model):
    group = make_group(G, P, S, R, seed=0, dtype=torch.float32)
    assert _naive(model, group) == _naive(model, group)
    assert _joint(model, group) == _joint(model, group)


def test_joint_replay_peak_does_not_grow_with_group_size(model):
    """Naive's peak grows with G; joint replay's is the prompt plus one wave, whatever G
    (up to per-token loss scalars)."""
    small = make_group(G // 2, P, S, R, seed=1, dtype=torch.float32)
    big = make_group(G, P, S, R, seed=1, dtype=torch.float32)
    naive_small, naive_big = _naive(model, small), _naive(model, big)
    joint_small, joint_big = _joint(model, small), _joint(model, big)
    print(f"\n[saved-tensor peak] G={G // 2}: naive {naive_small} B, joint {joint_small} B; "
          f"G={G}: naive {naive_big} B, joint {joint_big} B")
    assert naive_big > 1.8 * naive_small
    # Allowance: one fp64 scalar per token of the group (per-token weights/masks of the
    # loss), no activations.
    assert abs(joint_big - joint_small) <= G * (P + S) * 8
