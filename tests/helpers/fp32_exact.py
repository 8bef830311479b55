"""fp32 results bounded against the exact gradient of the same weights.

Two fp32 evaluations of a loss that sums terms of both signs (advantages) differ by the sum of
their own roundings, and how large those are depends on the CPU's kernels (summation order):
stock naive training's fp32 loss lands 1.4e-6 from the exact one on one machine, well inside
1e-6 on another. So an fp32 run is compared with the exact (fp64) run of the same fp32 weights
and inputs, the loss relative to its value and the gradient over the whole gradient (max |error|
/ max |reference| over all tensors: a cancelling layernorm- or loop-weight gradient is tiny next
to its own terms, so per tensor its fp32 rounding is not bounded by 1e-6), as the DDP, TP and
CUDA tests bound fp32.
"""

import dataclasses

import torch


def fp64_twin(model32: torch.nn.Module, model64: torch.nn.Module) -> torch.nn.Module:
    """``model64`` (the same architecture in fp64) holding ``model32``'s weights exactly."""
    with torch.no_grad():
        pairs = list(zip(model64.named_parameters(), model32.named_parameters()))
        for (n64, p64), (n32, p32) in pairs:
            assert n64 == n32 and p64.dtype == torch.float64, (n64, n32)
            p64.copy_(p32)
    return model64


def fp64_group(group):
    """The same group with every floating-point tensor in fp64 (values unchanged)."""
    cast = {f.name: getattr(group, f.name).double() for f in dataclasses.fields(group)
            if torch.is_tensor(getattr(group, f.name))
            and getattr(group, f.name).is_floating_point()}
    return dataclasses.replace(group, **cast)


def whole_gradient_error(got: dict, exact: dict) -> float:
    """max |got - exact| over every tensor / max |exact| over every tensor."""
    assert set(got) == set(exact)
    diff = max(float((got[n].double() - exact[n]).abs().max()) for n in exact)
    return diff / max(float(exact[n].abs().max()) for n in exact)
