"""What is measured per schedule: FLOPs of one step, peak saved-tensor bytes, wall time,
agreement with naive, and the cost model of docs/design.md section 2."""

import statistics
import time

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

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


def _cpu_forward(q, k, v) -> int:
    b, h, s_q, d = q
    return 2 * 2 * b * h * d * s_q * k[2]  # QK^T and PV over the full score square


def _cpu_backward(grad_out, q, k, v) -> int:
    return 2 * _cpu_forward(q, k, v)  # four products of the forward's two's size


class _SdpaFormulas:
    """FlopCounterMode formulas for the SDPA kernels that count the full score square: the
    CPU kernel, which PyTorch's counter lacks (it would count that attention as zero), and the
    CUDA flash / memory-efficient / cuDNN ops, whose PyTorch formulas ignore ``is_causal``.
    Each total follows PyTorch's convention (the full square, causal or not); the share a
    causal call skips is tallied on the side (``causal_saving``)."""

    DENSE = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_forward,
             aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_backward,
             aten._scaled_dot_product_flash_attention: sdpa_flop_count,
             aten._scaled_dot_product_flash_attention_backward: sdpa_backward_flop_count,
             aten._scaled_dot_product_efficient_attention: sdpa_flop_count,
             aten._scaled_dot_product_efficient_attention_backward: sdpa_backward_flop_count,
             aten._scaled_dot_product_cudnn_attention: sdpa_flop_count,
             aten._scaled_dot_product_cudnn_attention_backward: sdpa_backward_flop_count}

    def __init__(self):
        self.causal_saving = 0
        self.mapping = {op: self._formula(op, dense) for op, dense in self.DENSE.items()}

    def _formula(self, op, dense):
        """``op``'s formula: ``dense`` of its tensors' shapes, which leads with the query's
        (the backward's with grad_out's); ``is_causal`` is read where ``op``'s schema puts it."""
        names = [a.name for a in op.default._schema.arguments]
        q_at, causal_at = names.index("query"), names.index("is_causal")

        def count(*args, out_shape=None, **kwargs) -> int:
            flops = dense(*args[: q_at + 3])
            causal = causal_at < len(args) and args[causal_at]  # dispatch drops a False default
            s_q, s_k = args[q_at][2], args[q_at + 1][2]
            # every count is a multiple of the score square s_q * s_k
            self.causal_saving += flops - flops * _attention_pairs(s_q, s_k, causal) // (s_q * s_k)
            return flops

        return count


def count_flops(step) -> dict:
    """FLOPs of one call of ``step`` (a full forward + backward): ``dense`` in PyTorch's
    FlopCounterMode convention (SDPA counts the full score square), ``causal`` counting only
    the (query, key) pairs a causal kernel computes."""
    sdpa = _SdpaFormulas()
    with FlopCounterMode(display=False, custom_mapping=sdpa.mapping) as counter:
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
