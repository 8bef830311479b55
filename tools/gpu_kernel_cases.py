"""The CUDA prefix attention kernels case by case, each against an fp64 matmul reference
written here: stage 1 of ``make gpu-check`` (``tools/gpu_check.py`` runs this file in
subprocesses).

A case is one of {flash, efficient} x {bf16, fp16} x {one K/V group per head, GQA, one group}
x {Bp = 1, Bp = B} x {prefix leaves in the queries' dtype, fp32}: the cascade prefix
attention (``scalerlt_mcore.model.attention.cascade_prefix_attention``) forward and backward
on that kernel, the output and the gradients w.r.t. q, k, v and the prefix K/V compared with
softmax attention over the concatenated keys computed in fp64 from the same (rounded) inputs,
relative to the reference's max, within 4 unit roundoffs of the dtype (2^-6 bf16, 2^-9
fp16). A ``chain`` case, {bf16, fp16} x {one K/V group per head, GQA, one group}, is a decode
step of tree decoding (``scalerlt_mcore.model.kernels.chain_prefix_attention``: the rows' own
K/V and two prefix segments, each part on the memory-efficient op with its mask, merged by the
parts' log-sum-exps), its output held to the same bound. Stock PyTorch SDPA over the
concatenated keys in the case's dtype is measured beside it for the record. One JSON line per
case on stdout; a case that raises ends the process (a CUDA error can poison the context for
every case after it: the caller reruns those alone).

``--device cpu`` (the dry run): the same cases with the CPU fused kernel in the case's dtype
against the same reference (checks the reference and the bounds), and the case's CUDA kernel
on ``meta`` (shapes, dtypes, the ops' calling convention).

    python tools/gpu_kernel_cases.py --list
    python tools/gpu_kernel_cases.py --device cuda --cases flash-bf16-gqa-bp1-pq,...
"""

import argparse
import itertools
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HEADS = 8  # query heads
LAYOUTS = {"mha": HEADS, "gqa": 2, "mqa": 1}  # K/V groups: one per head, GQA, one group
BOUNDS = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}  # 4 unit roundoffs
NAMES = ("out", "dq", "dk", "dv", "dprefix_k", "dprefix_v")


@dataclass(frozen=True)
class Sizes:
    """The attention's sizes: suffix S, batch B, prefix length P, head dim hn."""

    S: int = 48
    B: int = 4
    P: int = 200
    hn: int = 64


FULL, SMALL = Sizes(), Sizes(S=12, B=2, P=24, hn=16)  # SMALL: the dry run's (CPU time)


@dataclass(frozen=True)
class Case:
    """One kernel case."""

    kernel: str
    """``flash`` or ``efficient`` (``looped_cascade_kernel``)."""
    dtype: torch.dtype
    """The queries' (the model's) dtype."""
    layout: str
    """K/V groups: ``mha`` one per head, ``gqa`` 2 for 8 heads, ``mqa`` one."""
    shared_prefix: bool
    """Bp = 1 (one prompt shared by the batch), else Bp = B."""
    prefix_fp32: bool
    """Prefix K/V leaves in fp32 (the adjoint leaves of a half-precision model)."""

    @property
    def id(self) -> str:
        dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
        return (f"{self.kernel}-{dt}-{self.layout}-bp{'1' if self.shared_prefix else 'B'}-"
                f"{'p32' if self.prefix_fp32 else 'pq'}")

    @property
    def groups(self) -> int:
        return LAYOUTS[self.layout]

    @property
    def prefix_dtype(self) -> torch.dtype:
        return torch.float32 if self.prefix_fp32 else self.dtype


@dataclass(frozen=True)
class ChainCase:
    """One decode step against two prefix segments (``chain_prefix_attention``)."""

    dtype: torch.dtype
    layout: str

    @property
    def id(self) -> str:
        return f"chain-{'bf16' if self.dtype == torch.bfloat16 else 'fp16'}-{self.layout}"

    @property
    def groups(self) -> int:
        return LAYOUTS[self.layout]


CASES = tuple(Case(*c) for c in itertools.product(
    ("flash", "efficient"), (torch.bfloat16, torch.float16), tuple(LAYOUTS), (True, False),
    (False, True))) + tuple(ChainCase(*c) for c in itertools.product(
        (torch.bfloat16, torch.float16), tuple(LAYOUTS)))
BY_ID = {c.id: c for c in CASES}


# ---- the reference ---------------------------------------------------------------------------

def reference_attention(q, k, v, pk, pv, scale: float):
    """Softmax attention of q [S, B, np, hn] over the prefix pk/pv [P, Bp, ng, hn] (all
    visible) and its own k/v [S, B, ng, hn] (causal), as dense matmuls: out [B, np, S, hn].
    Head h reads K/V group h // (np / ng)."""
    S, B, heads, _ = q.shape
    rep = heads // k.shape[2]
    keys = torch.cat([pk.expand(-1, B, -1, -1), k], 0).repeat_interleave(rep, 2)  # [P+S,B,np,hn]
    vals = torch.cat([pv.expand(-1, B, -1, -1), v], 0).repeat_interleave(rep, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, keys) * scale  # [B, np, S, P+S]
    allowed = torch.ones(S, keys.shape[0], dtype=torch.bool, device=q.device)
    allowed = allowed.tril(diagonal=keys.shape[0] - S)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->bhsd", probs, vals)  # [B, np, S, hn]


def stock_sdpa(q, k, v, pk, pv, scale: float):
    """PyTorch SDPA over the concatenated keys (explicit mask), in the inputs' dtype."""
    S, B, heads, _ = q.shape
    rep = heads // k.shape[2]
    keys = torch.cat([pk.expand(-1, B, -1, -1).to(k.dtype), k], 0).repeat_interleave(rep, 2)
    vals = torch.cat([pv.expand(-1, B, -1, -1).to(v.dtype), v], 0).repeat_interleave(rep, 2)
    allowed = torch.ones(S, keys.shape[0], dtype=torch.bool, device=q.device)
    allowed = allowed.tril(diagonal=keys.shape[0] - S)
    bhsd = [t.permute(1, 2, 0, 3) for t in (q, keys, vals)]  # [B, np, T, hn]
    return torch.nn.functional.scaled_dot_product_attention(*bhsd, attn_mask=allowed,
                                                            scale=scale)


def reference_chain(q, k, v, allowed, prefixes):
    """Softmax attention of q [s, B, np, hn] over each row's segment keys (segment j: pk/pv
    [P_j, N_j, ng, hn], row b reading row b // (B / N_j), ``seen`` [N_j, P_j]) and its own k/v
    [T, B, ng, hn] under ``allowed`` [B, s, T], as dense matmuls: out [B, np, s, hn]."""
    s, B, heads, hn = q.shape
    rep = heads // k.shape[2]
    keys, vals, seen = [], [], []
    for pk, pv, mask in prefixes:
        per = B // pk.shape[1]
        keys.append(pk.repeat_interleave(per, 1))
        vals.append(pv.repeat_interleave(per, 1))
        seen.append(mask.repeat_interleave(per, 0)[:, None].expand(B, s, -1))
    keys = torch.cat([*keys, k]).repeat_interleave(rep, 2)  # [K, B, np, hn]
    vals = torch.cat([*vals, v]).repeat_interleave(rep, 2)
    seen = torch.cat([*seen, allowed], 2)[:, None]  # [B, 1, s, K]
    scores = torch.einsum("sbhd,kbhd->bhsk", q, keys) * hn ** -0.5
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("bhsk,kbhd->bhsd", probs, vals), (keys, vals, seen)


def chain_inputs(case: ChainCase, z: Sizes, device: str, seed: int = 0) -> tuple:
    """A decode step (one query per row) of B = 2 * z.B rows: q, own k/v (z.S cached slots,
    uneven), the mask, and two segments: one prompt of z.P keys, then z.B rows of z.S keys."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    B, ng, hn = 2 * z.B, case.groups, z.hn

    def rnd(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(device, case.dtype)

    def seen(n, P):
        lengths = torch.randint(1, P + 1, (n,), generator=gen)
        return (torch.arange(P)[None] < lengths[:, None]).to(device)  # [n, P]

    prefixes = [(rnd(P, n, ng, hn), rnd(P, n, ng, hn), seen(n, P))
                for P, n in ((z.P, 1), (z.S, z.B))]
    return (rnd(1, B, HEADS, hn), rnd(z.S, B, ng, hn), rnd(z.S, B, ng, hn),
            seen(B, z.S)[:, None], prefixes)


def run_chain_case(case: ChainCase, device: str, z: Sizes = FULL) -> dict:
    """The chain case's result (as ``run_case``'s): its output against the fp64 reference."""
    from scalerlt_mcore.model.kernels import chain_prefix_attention

    start = time.perf_counter()
    q, k, v, allowed, prefixes = chain_inputs(case, z, device)
    wide = [(pk.double(), pv.double(), m) for pk, pv, m in prefixes]
    ref, (keys, vals, seen) = reference_chain(q.double(), k.double(), v.double(), allowed, wide)
    with torch.no_grad():
        got = chain_prefix_attention(q, k, v, allowed, prefixes, z.hn ** -0.5)
        stock = torch.nn.functional.scaled_dot_product_attention(
            *(t.to(case.dtype).permute(1, 2, 0, 3) for t in (q, keys, vals)), attn_mask=seen)
        problems = [] if (got.shape, got.dtype) == (ref.shape, case.dtype) else [
            f"out: {tuple(got.shape)} {got.dtype}, expected {tuple(ref.shape)} {case.dtype}"]
        if device != "cuda":  # the CUDA path (the memory-efficient op) on meta
            on_meta = chain_prefix_attention(
                q.to("meta"), k.to("meta"), v.to("meta"), allowed.to("meta"),
                [tuple(t.to("meta") for t in p) for p in prefixes], z.hn ** -0.5)
            if (on_meta.shape, on_meta.dtype) != (ref.shape, case.dtype):
                problems.append(f"on meta: out {tuple(on_meta.shape)} {on_meta.dtype}")
    errors, bound = rel_errors([got], [ref]), BOUNDS[case.dtype]
    worst = errors["out"]
    if device == "cuda":
        torch.cuda.synchronize()
    return {"case": case.id, "device": device,
            "kernel": "efficient" if device == "cuda" else "cpu_flash", "sizes": z.__dict__,
            "ok": worst <= bound and not problems, "bound": bound, "worst": worst,
            "margin": bound / worst if worst > 0 else float("inf"), "errors": errors,
            "stock_sdpa_errors": rel_errors([stock], [ref]), "problems": problems,
            "seconds": time.perf_counter() - start}


# ---- one case --------------------------------------------------------------------------------

def shapes(case: Case, z: Sizes) -> list:
    """Shapes of q, k, v, pk, pv and of the output [B, np, S, hn]."""
    ng, bp = case.groups, 1 if case.shared_prefix else z.B
    return [(z.S, z.B, HEADS, z.hn), (z.S, z.B, ng, z.hn), (z.S, z.B, ng, z.hn),
            (z.P, bp, ng, z.hn), (z.P, bp, ng, z.hn), (z.B, HEADS, z.S, z.hn)]


def inputs(case: Case, z: Sizes, device: str, seed: int = 0) -> list:
    """q, k, v, pk, pv in their dtypes (prefix leaves in ``case.prefix_dtype``), and the
    output cotangent [B, np, S, hn] in the queries' dtype."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtypes = [case.dtype] * 3 + [case.prefix_dtype] * 2 + [case.dtype]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device=device, dtype=d)
            for s, d in zip(shapes(case, z), dtypes)]


def value_and_grads(fn, xs: list, cotangent) -> list:
    """[out, dq, dk, dv, dpk, dpv] of ``fn`` at leaves ``xs`` (each keeps its dtype)."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*leaves, leaves[0].shape[-1] ** -0.5)
    return [out, *torch.autograd.grad(out, leaves, cotangent.to(out.dtype))]


def rel_errors(got: list, ref: list) -> dict:
    """name -> max |got - ref| / max |ref| (inf where got is not finite)."""
    out = {}
    for name, g, r in zip(NAMES, got, ref):
        g, r = g.detach().double(), r.detach().double()
        err = (g - r).abs().max() / r.abs().max()
        out[name] = float(err) if bool(torch.isfinite(g).all()) else float("inf")
    return out


def check_dtypes(case: Case, z: Sizes, got: list) -> list:
    """What is wrong with the dtypes and shapes of [out, dq, dk, dv, dpk, dpv]."""
    want = [case.dtype] * 4 + [case.prefix_dtype] * 2
    *grads, out = shapes(case, z)
    return [f"{n}: {tuple(g.shape)} {g.dtype}, expected {s} {d}"
            for n, g, d, s in zip(NAMES, got, want, [out, *grads])
            if g.dtype != d or tuple(g.shape) != s]


def cascade(kernel: str):
    from scalerlt_mcore.model.attention import cascade_prefix_attention

    return lambda q, k, v, pk, pv, scale: cascade_prefix_attention(q, k, v, pk, pv, scale,
                                                                   kernel=kernel)


def run_case(case: Case, device: str, z: Sizes = FULL) -> dict:
    """The case's result: errors, bound, margin (bound / worst error), ok."""
    start = time.perf_counter()
    xs = inputs(case, z, device)
    *args, cot = xs
    ref = value_and_grads(reference_attention, [x.double() for x in args], cot.double())
    kernel = case.kernel if device == "cuda" else "cpu_flash"
    got = value_and_grads(cascade(kernel), args, cot)
    stock = value_and_grads(stock_sdpa, args, cot)
    problems = check_dtypes(case, z, got)
    if device != "cuda":  # the case's own CUDA kernel on meta: shapes, dtypes, calling convention
        problems += [f"on meta: {p}" for p in check_dtypes(
            case, z, value_and_grads(cascade(case.kernel), [x.to("meta") for x in args],
                                  cot.to("meta")))]
    errors = rel_errors(got, ref)
    worst = max(errors.values())
    bound = BOUNDS[case.dtype]
    if device == "cuda":
        torch.cuda.synchronize()
    return {"case": case.id, "device": device, "kernel": kernel, "sizes": z.__dict__,
            "ok": worst <= bound and not problems, "bound": bound, "worst": worst,
            "margin": bound / worst if worst > 0 else float("inf"), "errors": errors,
            "stock_sdpa_errors": rel_errors(stock, ref), "problems": problems,
            "seconds": time.perf_counter() - start}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/gpu_kernel_cases.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--cases", default="", help="comma-separated case ids (default: all)")
    p.add_argument("--small", action="store_true", help="the dry run's smaller sizes")
    p.add_argument("--list", action="store_true", help="print the case ids and exit")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(BY_ID))
        return 0
    ids = [c for c in args.cases.split(",") if c] or list(BY_ID)
    unknown = [c for c in ids if c not in BY_ID]
    if unknown:
        p.error(f"unknown case ids {unknown} (see --list)")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_kernel_cases: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 1
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp64 reference is unaffected anyway
    for cid in ids:
        try:
            case = BY_ID[cid]
            run = run_chain_case if isinstance(case, ChainCase) else run_case
            result = run(case, args.device, SMALL if args.small else FULL)
        except Exception as err:  # noqa: BLE001 - the case's failure is its result
            print(json.dumps({"case": cid, "ok": False, "raised": f"{type(err).__name__}: {err}",
                              "traceback": traceback.format_exc()[-4000:]}), flush=True)
            return 1
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
