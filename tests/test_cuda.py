"""On one CUDA GPU (run by ``make gpu-check``; skipped elsewhere): the fused cascade kernels,
joint replay against stock-MCore naive training, and the main job.

- Cascade prefix attention on the CUDA kernels against the matmul reference computed in fp64
  from the same inputs (values and the gradients w.r.t. q, k, v and the prefix K/V): fp32
  (memory-efficient kernel) within 1e-5 of the reference's max; bf16 (flash and
  memory-efficient) within 2^-6 = 4 bf16 unit roundoffs of it, with stock PyTorch SDPA over
  the concatenated keys in bf16 printed beside it for the record.
- Joint replay vs naive training through stock MCore ``get_forward_backward_func()`` on the
  GPU: fp32 (TF32 off) loss and gradients within 1e-5, the gradient error bounded over the
  whole gradient (as the DDP test: per-tensor errors of cancelling layernorm-weight gradients
  move with the attention kernel's summation order); bf16 within 2x naive bf16's error against
  the same fp32 reference (as tests/shared_prefix/test_joint_replay_bf16.py on CPU).
- The main job: 2 steps (warm-up + GRPO) of configs/gpu_check.yaml in bf16, with a checkpoint.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.sp import LossSpec, build_model, grads, joint_step, make_group, naive_step

from scalerlt_mcore.model import kernels

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = torch.device("cuda")
ROOT = Path(__file__).resolve().parents[1]
BF16_BOUND = 2.0**-6


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 matmuls in full precision (TF32 would round inputs to 10 significand bits)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).abs().max() / ref.abs().max())


# ---- the cascade kernels ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, "flash"), (torch.float16, "flash"),
                                             (torch.float32, "efficient"),
                                             (torch.float64, "matmul")])
def test_auto_kernel_on_cuda(dtype, expected):
    q = torch.empty(4, 2, 8, 64, dtype=dtype, device=DEVICE)
    kernel = kernels.resolve_cascade_kernel("auto", q)
    assert getattr(kernel, "name", kernel) == expected


def _attention_inputs(prefix_batch: int, seed: int = 0) -> list:
    """fp64: q [48, 4, 8, 64], k/v [48, 4, 2, 64] (GQA), prefix K/V [200, Bp, 2, 64]."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    S, B, P = 48, 4, 200
    shapes = [(S, B, 8, 64), (S, B, 2, 64), (S, B, 2, 64), (P, prefix_batch, 2, 64),
              (P, prefix_batch, 2, 64)]
    return [torch.randn(s, generator=gen, dtype=torch.float64, device=DEVICE) for s in shapes]


def _value_and_grads(fn, inputs64, dtype, cotangent64) -> list:
    xs = [x.to(dtype).requires_grad_() for x in inputs64]
    out = fn(*xs, 0.125)
    return [out, *torch.autograd.grad(out, xs, cotangent64.to(dtype))]


NAMES = ("out", "dq", "dk", "dv", "dprefix_k", "dprefix_v")


@pytest.mark.parametrize("prefix_batch", [1, 4])
@pytest.mark.parametrize("kernel, dtype", [("efficient", torch.float32),
                                           ("flash", torch.bfloat16),
                                           ("efficient", torch.bfloat16)])
def test_cascade_cuda_kernels_match_the_matmul_reference(kernel, dtype, prefix_batch):
    inputs = _attention_inputs(prefix_batch)
    cot = torch.randn(4, 8, 48, 64, generator=torch.Generator(device=DEVICE).manual_seed(1),
                      dtype=torch.float64, device=DEVICE)

    def cascade(name):
        return lambda *a: kernels.cascade_prefix_attention(*a, kernel=name)

    ref = _value_and_grads(cascade("matmul"), inputs, torch.float64, cot)
    got = _value_and_grads(cascade(kernel), inputs, dtype, cot)
    stock = _value_and_grads(kernels.concat_prefix_attention, inputs, dtype, cot)
    errors = {n: _rel(g, r) for n, g, r in zip(NAMES, got, ref, strict=True)}
    stock_errors = {n: _rel(s, r) for n, s, r in zip(NAMES, stock, ref, strict=True)}
    print(f"\n[{kernel} {dtype}] rel err vs fp64 matmul: "
          + ", ".join(f"{n} {e:.2e} (stock SDPA {stock_errors[n]:.2e})" for n, e in errors.items()))
    bound = 1e-5 if dtype == torch.float32 else BF16_BOUND
    assert all(g.dtype == dtype for g in got)
    assert max(errors.values()) <= bound, errors


# ---- joint replay vs stock-MCore naive training ---------------------------------------------


def _global_rel(got: dict, ref: dict) -> float:
    """max |got - ref| / max |ref| over the whole gradient."""
    diff = max(float((got[n].double() - r.double()).abs().max()) for n, r in ref.items())
    return diff / max(float(r.double().abs().max()) for r in ref.values())


def test_joint_replay_matches_stock_mcore_naive_fp32(mcore_single):
    torch.manual_seed(0)
    model = build_model(R=3, arch=True, hidden=64, heads=4).to(DEVICE)
    groups = [make_group(8, 24, 8, 3, seed=s, dtype=torch.float32, kl=True, group_id=s,
                         device=DEVICE) for s in (1, 2)]
    for g in groups:  # one sign: the group loss is not a cancelling sum
        g.advantages = g.advantages.abs()
    spec = LossSpec(normalization="seq_mean", kl_coef=0.1, loop_weights="progressive")
    ref_losses, _ = naive_step(model, groups, spec, per_mb=4)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, groups, spec, wave_size=3)
    got = grads(model)
    assert all(g.device.type == DEVICE.type for g in got.values())
    loss_err = max(abs(float(o["loss"]) - float(r)) / abs(float(r))
                   for o, r in zip(out, ref_losses, strict=True))
    grad_err = _global_rel(got, ref)
    print(f"\n[cuda fp32] joint vs naive: loss rel err {loss_err:.2e}, grad rel err {grad_err:.2e}")
    assert loss_err <= 1e-5 and grad_err <= 1e-5


def _twin_models(**arch):
    """fp32 and bf16 models on the GPU holding the same (bf16-representable) weights."""
    fp32 = build_model(**arch)
    with torch.no_grad():
        for p in fp32.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    bf16 = build_model(**arch)
    bf16.load_state_dict(fp32.state_dict())
    return fp32.to(DEVICE), bf16.to(device=DEVICE, dtype=torch.bfloat16)


def _l2_rel(got: dict, ref: dict) -> float:
    num = sum(float(((got[n].double() - r.double()) ** 2).sum()) for n, r in ref.items())
    return math.sqrt(num / sum(float((r.double() ** 2).sum()) for r in ref.values()))


def test_joint_replay_bf16_within_2x_naive_bf16_error(mcore_single):
    torch.manual_seed(0)
    fp32, bf16 = _twin_models(R=3, arch=True, hidden=64, heads=4)
    group = make_group(8, 10, 6, 3, seed=3, dtype=torch.float32, device=DEVICE)
    spec = LossSpec()
    naive_step(fp32, [group], spec, per_mb=8)
    ref = grads(fp32)
    naive_step(bf16, [group], spec, per_mb=8)
    naive = grads(bf16)
    bf16.zero_grad(set_to_none=True)
    joint_step(bf16, [group], spec, 2)
    joint = grads(bf16)
    worst = {name: max(_rel(g[n], r) for n, r in ref.items())
             for name, g in (("joint", joint), ("naive", naive))}
    l2 = {name: _l2_rel(g, ref) for name, g in (("joint", joint), ("naive", naive))}
    print(f"\n[cuda bf16 vs fp32] max rel-to-max: {worst}; global L2: {l2}")
    assert worst["joint"] <= 2 * worst["naive"] and l2["joint"] <= 2 * l2["naive"]


# ---- the main job -------------------------------------------------------------------------


@pytest.mark.timeout(200)  # the subprocess's own 180 s, then its report
def test_main_job_two_steps_on_cuda(tmp_path):
    cmd = [sys.executable, "-m", "scalerlt_mcore.train", "--config",
           str(ROOT / "configs" / "gpu_check.yaml"), "--run-dir", str(tmp_path / "run"),
           "--save", str(tmp_path / "ckpt"), "--distributed-timeout-minutes", "2",
           "--rl-decode-cuda-graph", "true"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    assert "device: cuda (nccl)" in run.stdout
    assert "final mean reward" in run.stdout
    records = [json.loads(line)
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds == ["eval", "sft", "train", "eval"], kinds
    train = records[2]
    print(f"\n[main job, cuda bf16] {train}")
    for key in ("loss", "kl", "grad_norm", "rollout_logprob_max_diff"):
        assert math.isfinite(train[key]), key
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000002"
