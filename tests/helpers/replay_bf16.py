"""The bf16 cases of joint replay against naive fp32 training, and their bounds (bf16
rounding, a schedule factor against naive bf16, an L2 factor)."""

import torch

from helpers.sp import LossSpec, build_model

BF16_TOL = 5e-2
SCHEDULE_FACTOR = 1.5
L2_FACTOR = 1.1
P, S = 10, 6


def _l2_rel(got: dict, ref: dict) -> float:
    num = sum(((got[n].double() - r.double()) ** 2).sum() for n, r in ref.items())
    den = sum((r.double() ** 2).sum() for r in ref.values())
    return float((num / den).sqrt())


def _twin_models(**arch):
    """fp32 and bf16 models holding exactly the same (bf16-representable) weights."""
    fp32 = build_model(hidden=32, heads=4, **arch)
    with torch.no_grad():
        for p in fp32.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    bf16 = build_model(hidden=32, heads=4, **arch)
    bf16.load_state_dict(fp32.state_dict())
    bf16.to(torch.bfloat16)
    for (n, a), b in zip(fp32.named_parameters(), bf16.parameters()):
        assert b.dtype == torch.bfloat16 and torch.equal(a, b.float()), n
    return fp32, bf16


CASES = [
    # R, arch, attention, G, W, checkpoint, spec, naive responses per microbatch (bf16)
    (3, True, "cascade", 8, 2, False, LossSpec(normalization="token_mean"), 8),
    (3, True, "concat", 8, 3, True,
     LossSpec(normalization="seq_mean", kl_coef=0.1, loop_weights="uniform"), 8),
    (2, False, "cascade", 5, 1, True,
     LossSpec(normalization="constant", kl_coef=0.1, loop_weights="progressive"), 1),
]
