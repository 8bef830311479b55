"""Device discipline without a GPU: ``meta`` tensors stand in for an accelerator.

On torch's CPU build an op mixing a ``meta`` and a ``cpu`` tensor raises ("Tensor on device
cpu is not on the expected device meta!"), indexing and autograd work, and the CUDA fused
attention ops run their meta kernels (shapes, dtypes, calling convention). So every
pure-tensor piece of the GPU path runs here on ``meta`` inputs: a tensor built on the host
where it should follow its inputs fails the test. Data-dependent calls (``.item()``) do not
run on ``meta``; the static check in test_static_devices.py covers those functions.

Covered: the RL objective's loss (its loop weights were built on the CPU), the warm-up loss,
group construction (``SharedPrefixGroup.from_rollout``) and the schedule's up-front device
check, the trainer's group, drift and warm-up-batch helpers, the cascade and concat prefix
attention on every kernel (the CUDA flash and memory-efficient ops and their backward ops),
the looped model's wave forward + RL loss + backward with the CUDA flash kernel, and the
rollout sampling helpers (which must reject a generator of another device).
"""

import math

import pytest
import torch
from helpers.sp import build_model, make_group

from scalerlt_mcore.model import kernels
from scalerlt_mcore.rl import batch as rl_batch
from scalerlt_mcore.rl import rollout, sft
from scalerlt_mcore.rl.batch import RLGroup
from scalerlt_mcore.rl.objective import LOOP_WEIGHTS, RLObjective, rl_forward_step
from scalerlt_mcore.shared_prefix import (
    SharedPrefixGroup,
    WaveModel,
    get_shared_prefix_forward_backward_func,
)

META = torch.device("meta")


def _meta(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).to(META)


# ---- the objective ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", LOOP_WEIGHTS)
def test_objective_loss_on_meta(scheme):
    """The loss of [R, B, T] log-probs on the device (the loop weights follow them; exit_pdf
    with the gate's own term, from exit log-probs on the device; learned from weights there)."""
    R, B, T = 3, 2, 5
    gated = scheme == "exit_pdf"
    objective = RLObjective(loop_weights=scheme, kl_coef=0.1, exit_gate_coef=0.1 * gated)
    model_outputs = {"exit_pdf": {"exit_logprobs": _meta(R, B, T).requires_grad_()},
                     "learned": {"learned": _meta(R).requires_grad_()}}.get(scheme, {})
    logprobs = _meta(R, B, T).requires_grad_()
    loss, stats = objective.loss(logprobs, _meta(R, B, T), _meta(B, dtype=torch.float64),
                                 _meta(B, T, dtype=torch.float64), ref=_meta(R, B, T),
                                 **model_outputs)
    assert loss.device == META and loss.shape == () and loss.dtype == torch.float32
    assert all(v.device == META for v in stats.values())
    loss.backward()
    assert logprobs.grad.device == META and logprobs.grad.shape == (R, B, T)


def test_warm_up_loss_on_meta():
    logprobs = _meta(2, 3, 6).requires_grad_()
    nll, stats = sft.sft_loss("progressive", _meta(3, 6), logprobs)
    assert nll.device == META and stats["nll"].device == META
    nll.backward()
    assert logprobs.grad.device == META


# ---- groups ---------------------------------------------------------------------------------


def test_from_rollout_builds_tokens_labels_mask():
    """Values on the CPU against the layout written out here: prompt, response, padding;
    labels shifted by one; mask on the positions that predict a response token."""
    responses = torch.tensor([[5, 6, 7, 9], [8, 9, 9, 9]])  # [G, S'] (9 = pad)
    g = RLGroup.from_rollout([1, 2], responses, torch.tensor([3, 1]), pad_id=9, group_id=4,
                             advantages=torch.tensor([0.5, -0.5]))
    assert g.tokens.tolist() == [[1, 2, 5, 6, 7], [1, 2, 8, 9, 9]]
    assert g.labels.tolist() == [[2, 5, 6, 7, 9], [2, 8, 9, 9, 9]]
    assert g.loss_mask.tolist() == [[0, 1, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert g.loss_mask.dtype == torch.float32 and g.prompt_length == 2 and g.group_id == 4
    assert g.advantages.tolist() == [0.5, -0.5] and g.old_logprobs is None


@pytest.mark.parametrize("lengths, match", [
    ([3, 0], r"response lengths must lie in \[1, 4\]"),
    ([3, 5], r"response lengths must lie in \[1, 4\]"),
    ([3], r"lengths must be \[G\] = \[2\]"),
])
def test_from_rollout_rejects_bad_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        SharedPrefixGroup.from_rollout([1], torch.zeros(2, 4, dtype=torch.long), lengths, 0)


def test_from_rollout_on_meta_and_check_device():
    g = make_group(4, 6, 3, 2, seed=0, kl=True, device="meta")
    for name in ("tokens", "labels", "loss_mask", "advantages", "old_logprobs", "ref_logprobs"):
        assert getattr(g, name).device == META, name
    assert g.tokens.shape == (4, 9) and g.loss_mask.dtype == torch.float64
    g.check_device("meta")
    with pytest.raises(ValueError, match=r"group 0: tokens is on meta, the model on cpu"):
        g.check_device("cpu")
    g.tokens = torch.zeros(g.tokens.shape, dtype=torch.long)  # the next field is named
    with pytest.raises(ValueError, match=r"group 0: labels is on meta, the model on cpu"):
        g.check_device("cpu")


def test_schedule_rejects_a_group_off_the_model_device(mcore_single):
    """Up front, before any compute: the error names the group, the field and both devices."""
    model = build_model(R=2)
    group = make_group(4, 6, 3, 2, seed=0, dtype=torch.float32, group_id=7)
    group.old_logprobs = group.old_logprobs.to(META)
    schedule = get_shared_prefix_forward_backward_func(2)
    with pytest.raises(ValueError, match=r"group 7: old_logprobs is on meta, the model on cpu"):
        schedule(forward_step_func=rl_forward_step(RLObjective()), data_iterator=iter([group]),
                 model=model, num_microbatches=1, seq_length=0, micro_batch_size=1)
    assert all(p.grad is None for p in model.parameters())


# ---- the trainer's helpers ------------------------------------------------------------------


def test_trainer_groups_drift_and_warm_up_batch_on_meta():
    responses = torch.tensor([[[5, 6, 0], [7, 0, 0]]])  # host rollout [N=1, G=2, S=3]
    lengths, advantages = torch.tensor([[2, 1]]), torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    (g,) = rl_batch.build_groups([[1, 2, 3]], responses, lengths, 0, step=2, device="meta",
                                   advantages=advantages)
    g.check_device("meta")
    assert g.group_id == 200_000 and g.tokens.shape == (2, 5)
    g.old_logprobs = _meta(2, 2, 5)
    rollout = rl_batch.rollout_old_logprobs(g, torch.zeros(1, 2, 3))  # the rollout's: host
    drift = rl_batch.trained_drift(g, rollout)
    assert drift.device == META and drift.shape == ()
    batch = sft.sft_batch([[1, 2], [1]], [[3, 4], [5]], pad_id=0, device="meta")
    assert {k: (t.device, tuple(t.shape)) for k, t in batch.items()} == {
        "tokens": (META, (2, 4)), "labels": (META, (2, 4)), "mask": (META, (2, 4))}


def test_rollout_drift_values():
    """max |train - rollout| over the sampled tokens only (padding ignored)."""
    g = RLGroup.from_rollout([1, 2], torch.tensor([[5, 6], [7, 0]]), [2, 1], 0)
    g.old_logprobs = torch.zeros(2, 2, 4)
    g.old_logprobs[-1, :, 1:3] = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]])  # -9: padding
    rollout_lp = torch.tensor([[-1.25, -2.0], [-0.5, 0.0]])
    layout = rl_batch.rollout_old_logprobs(g, rollout_lp[None])  # [1, G, T]
    assert rl_batch.trained_drift(g, layout).item() == 0.25


# ---- attention ------------------------------------------------------------------------------


def _attention_inputs(dtype, S=5, B=3, P=6, prefix_batch=1, hn=64):
    shapes = [(S, B, 4, hn), (S, B, 2, hn), (S, B, 2, hn), (P, prefix_batch, 2, hn),
              (P, prefix_batch, 2, hn)]
    return [torch.empty(s, dtype=dtype, device=META, requires_grad=True) for s in shapes]


class _Recording(kernels.LseKernel):
    """Wraps a kernel and records the shapes/dtypes its forward and backward see."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.name, self.device_types = inner.name, inner.device_types

    def unsupported(self, q):
        return self.inner.unsupported(q)

    def forward(self, q, k, v, causal, scale):
        out, lse, state = self.inner.forward(q, k, v, causal, scale)
        self.calls.append(("forward", causal, tuple(q.shape), tuple(k.shape), tuple(lse.shape),
                           lse.dtype, out.dtype))
        return out, lse, state

    def backward(self, dout, q, k, v, out, lse, causal, scale, state):
        grads = self.inner.backward(dout, q, k, v, out, lse, causal, scale, state)
        self.calls.append(("backward", causal, tuple(lse.shape), *(tuple(g.shape) for g in grads)))
        return grads


@pytest.mark.parametrize("name, dtype", [
    ("flash", torch.bfloat16), ("flash", torch.float16), ("efficient", torch.float32),
    ("efficient", torch.bfloat16), ("cpu_flash", torch.float32),
])
@pytest.mark.parametrize("prefix_batch", [1, 3])
def test_cascade_fused_kernels_run_on_meta(name, dtype, prefix_batch):
    """The real ops (CUDA flash / memory-efficient, CPU flash) through the cascade Function:
    forward and backward on meta, each part called with its layout; the merged log-sum-exp
    is fp32 and unpadded, gradients come back in the inputs' shapes and dtype."""
    q, k, v, pk, pv = inputs = _attention_inputs(dtype, prefix_batch=prefix_batch)
    kernel = _Recording(kernels.LSE_KERNELS[name])
    out = kernels.cascade_prefix_attention(*inputs, 0.125, kernel=kernel)
    assert out.shape == (3, 4, 5, 64) and out.dtype == dtype and out.device == META
    out.backward(torch.empty_like(out))
    for t in inputs:
        assert t.grad.shape == t.shape and t.grad.dtype == dtype and t.grad.device == META
    M = 3 // prefix_batch * 2 * 5  # queries per KV group in the prefix product
    lse_dtype = torch.float32
    assert kernel.calls == [
        ("forward", False, (prefix_batch, 2, M, 64), (prefix_batch, 2, 6, 64),
         (prefix_batch, 2, M), lse_dtype, dtype),
        ("forward", True, (3, 4, 5, 64), (3, 4, 5, 64), (3, 4, 5), lse_dtype, dtype),
        ("backward", True, (3, 4, 5), (3, 4, 5, 64), (3, 4, 5, 64), (3, 4, 5, 64)),
        ("backward", False, (prefix_batch, 2, M), (prefix_batch, 2, M, 64),
         (prefix_batch, 2, 6, 64), (prefix_batch, 2, 6, 64)),
    ]


def test_efficient_op_pads_its_log_sum_exp_and_the_kernel_strips_it():
    q = torch.empty(1, 2, 40, 64, device=META)
    kv = torch.empty(1, 2, 70, 64, device=META)
    raw = kernels.aten._scaled_dot_product_efficient_attention(q, kv, kv, None, True, 0.0,
                                                                 False, scale=0.125)
    assert raw[1].shape == (1, 2, 64)  # 40 queries padded to 64
    out, lse, _ = kernels.LSE_KERNELS["efficient"].forward(q, kv, kv, False, 0.125)
    assert out.shape == (1, 2, 40, 64) and lse.shape == (1, 2, 40)


@pytest.mark.parametrize("kernel", ["flash", "efficient", "matmul"])
def test_fused_kernels_save_no_score_matrix_on_meta(kernel):
    dtype = torch.float32 if kernel == "efficient" else torch.bfloat16
    inputs = _attention_inputs(dtype, S=5, P=7)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        kernels.cascade_prefix_attention(*inputs, 0.125, kernel=kernel)
    has_scores = any(s[-2:] == (30, 7) for s in saved)  # [*, M, P]
    assert has_scores == (kernel == "matmul"), saved


def test_matmul_and_concat_attention_on_meta():
    inputs = _attention_inputs(torch.float32, prefix_batch=3)
    for fn in (kernels.concat_prefix_attention,
               lambda *a: kernels.cascade_prefix_attention(*a, kernel="matmul")):
        out = fn(*inputs, 0.125)
        assert out.shape == (3, 4, 5, 64) and out.device == META
        out.sum().backward()
    out, lse = kernels.merge_with_lse(_meta(2, 3, 4, dtype=torch.bfloat16), _meta(2, 3),
                                        _meta(2, 3, 4, dtype=torch.bfloat16), _meta(2, 3))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.device == META


def test_wave_forward_loss_and_backward_on_meta_with_cuda_flash(mcore_single, monkeypatch):
    """The joint-replay wave path on meta in bf16 with looped_cascade_kernel='flash': prompt
    state, the wave's per-loop log-probs (cascade attention on the CUDA flash ops), the RL
    loss, backward into the parameters and the prefix-state leaves."""
    model = build_model(R=2, arch=True, hidden=32, heads=4, looped_cascade_kernel="flash")
    model.to(device=META, dtype=torch.bfloat16)
    kernel = _Recording(kernels.LSE_KERNELS["flash"])
    monkeypatch.setitem(kernels.LSE_KERNELS, "flash", kernel)
    group = make_group(4, 6, 3, 2, seed=0, dtype=torch.float32, kl=True, device="meta")
    with torch.no_grad():
        state = model(group.tokens[:1, :6], return_prefix_state=True,
                      readout=False).prefix_state.detached_leaves()
    objective = RLObjective(loop_weights="progressive", kl_coef=0.1)
    output, loss_func = rl_forward_step(objective)(iter(group.waves(2)[:1]),
                                                   WaveModel(model, state))
    loss, stats = loss_func(output)
    assert output.shape == (2, 2, 9) and loss.device == META
    loss.backward()
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())
    assert all(t.grad is not None and t.grad.device == META for t in state.tensors())
    depths = model.config.looped_num_depths
    assert sum(c[0] == "forward" for c in kernel.calls) == 2 * depths  # prefix + own part
    assert sum(c[0] == "backward" for c in kernel.calls) == 2 * depths


def test_core_attention_takes_the_kernel_from_the_config(mcore_single):
    """looped_cascade_kernel reaches the attention: 'flash' refuses fp32 by name."""
    model = build_model(R=1, hidden=32, heads=4, looped_cascade_kernel="flash").to(META)
    tokens = torch.zeros(2, 4, dtype=torch.long, device=META)
    with torch.no_grad():
        state = model(tokens[:1], return_prefix_state=True, readout=False).prefix_state
        with pytest.raises(ValueError, match="'flash' cannot run .* not torch.float32"):
            model(tokens, prefix_state=state)


# ---- rollout sampling -----------------------------------------------------------------------


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)])
def test_sampling_helpers_on_meta(temperature, top_p):
    logits = _meta(4, 11)
    assert rollout.top_p_filter(logits, 0.9).device == META
    ids = rollout.sample_next(logits, temperature, top_p, None, banned=(0, 3))
    assert ids.shape == (4,) and ids.device == META and ids.dtype == torch.long


def test_sampling_rejects_a_generator_of_another_device():
    """A CPU generator with device logits: on CUDA torch raises deep inside multinomial; on
    meta it would pass silently. The helper names both devices."""
    with pytest.raises(ValueError, match="generator is on cpu, the logits on meta"):
        rollout.sample_next(_meta(4, 11), 1.0, 1.0, torch.Generator())
    cpu = torch.randn(4, 11)
    assert rollout.sample_next(cpu, 1.0, 1.0, torch.Generator().manual_seed(0)).shape == (4,)
    assert math.isfinite(float(rollout.top_p_filter(cpu, 0.5).max()))
