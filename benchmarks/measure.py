"""What is measured per schedule: FLOPs of one step, peak saved-tensor bytes, wall time,
agreement with naive, and the cost model of docs/design.md section 2."""

import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from scalerlt_mcore.app.runtime import gc_paused
from scalerlt_mcore.shared_prefix import SavedTensorProbe

aten = torch.ops.aten
TOLERANCE = 1e-5  # fp32: loss, and max |g - g_naive| over max |g_naive| over the whole gradient


class AgreementError(AssertionError):
    """A schedule's loss or gradients differ from naive training's; ``errors`` holds every
    schedule's measured errors (as ``check_agreement`` returns them)."""

    def __init__(self, message: str, errors: dict | None = None):
        super().__init__(message)
        self.errors = errors or {}


# ---- FLOPs ----------------------------------------------------------------------------------

def _attention_pairs(s_q: int, s_k: int, is_causal: bool) -> int:
    """(query, key) pairs an SDPA kernel computes; a causal kernel skips the keys after each
    query (PyTorch aligns the causal diagonal to the top-left corner: query i sees keys <= i)."""
    if not is_causal:
        return s_q * s_k
    full = max(0, s_q - s_k)  # queries that see every key
    tri = s_q - full  # queries i < s_k see i + 1 keys
    return tri * (tri + 1) // 2 + full * s_k


def _sdpa_flops(q, k, is_causal: bool, causal_aware: bool) -> int:
    b, h, s_q, d = q
    pairs = _attention_pairs(s_q, k[2], is_causal and causal_aware)
    return 2 * 2 * b * h * d * pairs  # QK^T and PV


class _SdpaFormulas:
    """FlopCounterMode formulas for the CPU SDPA kernel, which PyTorch's counter lacks (it
    would count that attention as zero). The total follows PyTorch's convention for its other
    SDPA kernels (the full score square, causal or not); the causal triangle the kernel
    actually computes is tallied on the side (``causal_saving``)."""

    def __init__(self):
        self.causal_saving = 0

    def _count(self, q, k, is_causal, products: int) -> int:
        dense = products * _sdpa_flops(q, k, is_causal, causal_aware=False)
        self.causal_saving += dense - products * _sdpa_flops(q, k, is_causal, causal_aware=True)
        return dense

    def forward(self, q, k, v, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kw):
        return self._count(q, k, is_causal, 1)

    def backward(self, grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *args,
                 out_shape=None, **kw):
        return self._count(q, k, is_causal, 2)  # four products of the forward's two's size


def count_flops(step) -> dict:
    """FLOPs of one call of ``step`` (a full forward + backward): ``dense`` in PyTorch's
    FlopCounterMode convention (SDPA counts the full score square), ``causal`` counting only
    the (query, key) pairs a causal kernel computes."""
    sdpa = _SdpaFormulas()
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: sdpa.forward,
               aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa.backward}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        step()
    total = int(counter.get_total_flops())
    return {"dense": total, "causal": total - sdpa.causal_saving}


# ---- memory ---------------------------------------------------------------------------------

def peak_saved_bytes(step, model) -> int:
    """Peak bytes autograd holds for backward during one step (parameters excluded; tensors
    recomputed by activation checkpointing in backward are not seen by the probe)."""
    with SavedTensorProbe(model) as probe:
        step()
    return int(probe.peak_bytes)


def prefix_state_bytes(wl, dtype_bytes: int = 4) -> int:
    """Bytes of the prefix adjoints joint replay keeps between waves (fp32 K/V of every depth
    plus the per-loop boundary); they are gradients, not saved tensors, so reported apart."""
    depths = wl.num_loops * wl.core_layers
    return dtype_bytes * (2 * depths * wl.prompt_length * wl.hidden + wl.num_loops * wl.hidden)


# ---- wall time ------------------------------------------------------------------------------

def time_round_robin(steps: dict, repetitions: int, warmup: int = 1, sync=None) -> dict:
    """name -> list of seconds; the schedules run interleaved, one step each per round. Python's
    garbage collection runs between the steps, not inside them (a collection before each step,
    automatic collection off while it runs), as Megatron-LM's ``--manual-gc`` with
    ``--manual-gc-interval 1`` runs a training loop."""
    sync = sync or (lambda: None)
    times = {name: [] for name in steps}
    for rnd in range(warmup + repetitions):
        for name, step in steps.items():
            with gc_paused():
                sync()
                start = time.perf_counter()
                step()
                sync()
                seconds = time.perf_counter() - start
            if rnd >= warmup:
                times[name].append(seconds)
    return times


def median(xs) -> float:
    return float(statistics.median(xs))


# ---- agreement ------------------------------------------------------------------------------

def grads_of(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def relative_error(x: torch.Tensor, ref: torch.Tensor, scale: float | None = None) -> float:
    """max |x - ref| / max(max |ref|, ``scale``)."""
    scale = ref.detach().abs().max().double().clamp_min(scale or torch.finfo(torch.float64).tiny)
    return float((x.detach().double() - ref.detach().double()).abs().max() / scale)


def whole_gradient_error(grads: dict, ref: dict) -> float:
    """max over tensors of max |g - ref| / max over tensors of max |ref|: the gradient's error
    relative to its largest entry. Per tensor, a small gradient that cancels (a norm weight's)
    carries an error set by the summation order of the kernels, not by the schedule."""
    diff = max(float((grads[n].double() - r.double()).abs().max()) for n, r in ref.items())
    return diff / max(max(float(r.double().abs().max()) for r in ref.values()),
                      torch.finfo(torch.float64).tiny)


def check_agreement(steps: dict, model, reference: str = "naive",
                    tolerance: float = TOLERANCE, loss_scale: float | None = None) -> dict:
    """Run every schedule once; return name -> {loss, grad, worst_tensor, worst_tensor_error}
    relative errors against the reference. Raise AgreementError, naming schedule and figure
    and holding every schedule's errors, if any exceeds ``tolerance`` (all schedules run).

    Gradients: over the whole gradient (``whole_gradient_error``); the tensor with the largest
    error relative to its own max is recorded beside it. Loss: relative to the larger of
    |reference loss| and ``loss_scale``, the size of the per-token terms the loss averages
    (for the PPO loss, mean |advantage|): their signs can cancel the mean to near 0 (seen: a
    loss of 6e-4 from terms of ~0.06), and rounding is relative to the terms, not to what is
    left of them."""
    loss_ref = steps[reference]()
    grads_ref = grads_of(model)
    if not grads_ref:
        raise AgreementError(f"{reference} produced no gradients")
    errors, failures = {}, []
    for name, step in steps.items():
        if name == reference:
            continue
        loss = step()
        grads = grads_of(model)
        missing = sorted(set(grads_ref) ^ set(grads))
        if missing:
            errors[name] = {"missing_or_extra_grads": missing}
            failures.append(f"{name}: gradients present/missing differ from {reference} "
                            f"for {missing}")
            continue
        per_tensor = {n: relative_error(grads[n], grads_ref[n]) for n in grads_ref}
        worst = max(per_tensor, key=per_tensor.get)
        errors[name] = {"loss": relative_error(loss, loss_ref, loss_scale),
                        "grad": whole_gradient_error(grads, grads_ref),
                        "worst_tensor": worst, "worst_tensor_error": per_tensor[worst]}
        if errors[name]["loss"] > tolerance or errors[name]["grad"] > tolerance:
            failures.append(f"{name} disagrees with {reference}: loss rel err "
                            f"{errors[name]['loss']:.3g}, whole-gradient rel err "
                            f"{errors[name]['grad']:.3g} (worst tensor '{worst}' "
                            f"{per_tensor[worst]:.3g}; tolerance {tolerance})")
    if failures:
        raise AgreementError("; ".join(failures), errors)
    return errors


# ---- the cost model of docs/design.md section 2 -------------------------------------------

def theory(wl) -> dict:
    """Work (token-layer forward = 1, backward = 2) and tokens whose activations are held at
    peak, per schedule; the work column is docs/design.md's cost table."""
    G, P, S, W = wl.group_size, wl.prompt_length, wl.response_length, wl.wave_size
    joint = 4 * P + 3 * G * S
    work = {"naive": 3 * G * (P + S), "naive_mb1": 3 * G * (P + S), "tree": 3 * P + 3 * G * S,
            "joint": joint, "joint_ckpt": joint + G * S, "joint_concat": joint,
            "joint_retain": joint - P}
    held = {"naive": G * (P + S), "naive_mb1": P + S, "tree": P + G * S, "joint": P + W * S,
            "joint_ckpt": P + W * S, "joint_concat": P + W * S, "joint_retain": P + W * S}
    return {"work": work, "held_tokens": held}
