"""GPU benchmark (one CUDA GPU): workloads A and B at a larger hidden size in bf16.

Runs naive (one microbatch of G, and G microbatches of one) / packed tree mask / joint replay
(cascade, checkpointed waves, concat) on the same model and data, after checking in fp32 (TF32
off) that every schedule's loss and gradients equal naive training's (loss within 1e-5, the
gradient within 1e-5 of its largest entry over the whole gradient). Reports response
tokens/s, peak ``torch.cuda.max_memory_allocated`` per schedule (absolute and above the memory
held before the step), saved-tensor bytes, FLOPs and the naive/joint, naive_mb1/joint and
tree/joint ratios, against the GPU targets (``GPU_TARGETS``). Uses the Transformer Engine layer
spec when TE is importable (else MCore's local spec with PyTorch SDPA, and says so); the cascade
prefix attention runs on the fused kernel ``looped_cascade_kernel='auto'`` picks (recorded). Run
by ``make gpu-check``; not in CI.

``--budget-s``: the timed repetitions shrink (to one at least) so that the workloads finish
within it; a workload that cannot start in time is recorded as skipped. ``--decode``: the
rollout decode micro-benchmark too (workload A's model in bf16, prompts prefilled per row and
once: response tokens/s and the time per decoding step, eager and on CUDA with the decode step
captured as a CUDA graph; and the host syncs of a joint-replay training step at 2 and 8
waves).

``python -m benchmarks.gpu [--hidden 1024] [--out benchmarks/results/gpu.json]`` writes the
JSON and the tables beside it (``gpu.md``) after every workload, and on a failure with the
error (a disagreeing schedule: its errors, exit status 2); ``--dry-run`` runs a tiny version on
CPU to exercise the code path without a GPU.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
import warnings
from functools import partial

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# (workload, figure, minimum): naive / joint replay on one GPU; wall = tokens/s of joint over
# naive, memory = peak torch.cuda.max_memory_allocated above the step's base.
GPU_TARGETS = (("A", "wall", 2.5), ("A", "memory", 3.0), ("B", "wall", 4.0), ("B", "memory", 5.0))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per schedule")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up rounds")
    p.add_argument("--only", default="A,B", help="comma-separated workload names")
    p.add_argument("--spec", choices=("auto", "te", "local"), default="auto",
                   help="layer spec: auto = Transformer Engine when importable")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="fp32 agreement tolerance (loss; gradient over its whole max)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="time for the whole benchmark (default: none)")
    p.add_argument("--decode", action="store_true",
                   help="also the rollout decode micro-benchmark (tokens/s)")
    p.add_argument("--out", default=os.path.join(RESULTS, "gpu.json"))
    p.add_argument("--dry-run", action="store_true",
                   help="tiny workloads on CPU (no GPU needed): checks the script runs")
    return p.parse_args(argv)


def workloads(args) -> list:
    from .run import HEADLINE

    keep = set(args.only.split(","))
    out = []
    for wl in HEADLINE:
        if wl.name not in keep:
            continue
        if args.dry_run:
            wl = dataclasses.replace(wl, group_size=4, prompt_length=32, response_length=8,
                                     wave_size=2, hidden=64, heads=4)
        else:
            wl = dataclasses.replace(wl, hidden=args.hidden, heads=args.heads)
        out.append(dataclasses.replace(wl, repetitions=args.reps))
    return out


def choose_spec(choice: str):
    """(layer spec, final-norm backend, description)."""
    from scalerlt_mcore.model import get_looped_gpt_layer_local_spec
    from scalerlt_mcore.model.specs import HAVE_TE, get_looped_gpt_layer_te_spec

    if choice == "te" or (choice == "auto" and HAVE_TE):
        return get_looped_gpt_layer_te_spec(), "te", "Transformer Engine layer spec"
    why = "requested" if choice == "local" else "Transformer Engine is not importable"
    return get_looped_gpt_layer_local_spec(), "local", f"local layer spec + PyTorch SDPA ({why})"


def _build(wl, spec, backend, device):
    from scalerlt_mcore.model import LoopedGPTModel

    from .workloads import build_config

    config = build_config(wl, use_cpu_initialization=device.type == "cpu")
    from scalerlt_mcore.model import get_looped_gpt_block_spec

    block = get_looped_gpt_block_spec(config, use_transformer_engine=backend == "te",
                                      layer_spec=spec)
    model = LoopedGPTModel(config, block, wl.vocab, wl.prompt_length + wl.response_length)
    return model.to(device).train()


def cascade_kernels(head_dim: int, device) -> dict:
    """dtype -> the kernel ``looped_cascade_kernel='auto'`` runs the cascade on here."""
    from scalerlt_mcore.model.attention import resolve_cascade_kernel

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.empty(1, 1, 1, head_dim, dtype=dtype, device=device)
        kernel = resolve_cascade_kernel("auto", q)
        out[str(dtype).replace("torch.", "")] = getattr(kernel, "name", kernel)
    return out


def _memory(steps: dict, model, device) -> dict:
    """name -> (peak bytes, peak bytes above what was allocated when the step began, with no
    gradients held)."""
    out = {}
    for name, step in steps.items():
        if device.type != "cuda":
            out[name] = (None, None)
            continue
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out[name] = (peak, peak - base)
    return out


def timed_rounds(steps: dict, wl, warmup: int, sync, budget_s=None) -> dict:
    """name -> seconds of each timed round robin: the warm-up and one timed round, then as
    many more (up to ``wl.repetitions`` in all) as fit in ``budget_s`` seconds."""
    from .measure import time_round_robin

    start = time.perf_counter()
    time_round_robin(steps, 0, warmup=warmup, sync=sync)
    probe = time.perf_counter()
    times = time_round_robin(steps, 1, warmup=0, sync=sync)
    round_s = time.perf_counter() - probe  # with the collections between the steps
    reps = wl.repetitions
    if budget_s is not None:
        left = budget_s - (time.perf_counter() - start)
        reps = max(1, min(reps, 1 + int(left / max(round_s, 1e-9))))
    more = time_round_robin(steps, reps - 1, warmup=0, sync=sync)
    return {name: times[name] + more[name] for name in steps}


def run_workload(wl, spec, backend, device, tolerance, warmup=2, log=print,
                 budget_s=None) -> dict:
    from .measure import check_agreement, count_flops, peak_saved_bytes
    from .report import workload_result
    from .schedules import step_functions
    from .workloads import attach_old_logprobs, build_model, make_group, objective

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = _build(wl, spec, backend, device)  # fp32 for the agreement check
    group = attach_old_logprobs(model, make_group(wl, 0, device), 0)
    steps = step_functions(model, group, objective(), wl.wave_size)
    agreement = check_agreement(steps, model, tolerance=tolerance,
                                loss_scale=float(group.advantages.abs().mean()))
    model.to(torch.bfloat16)
    if backend == "local":
        flops = {n: count_flops(s) for n, s in steps.items()}
    else:  # TE kernels are invisible to FlopCounterMode: count a local-spec twin (same math)
        twin = build_model(wl, use_cpu_initialization=device.type == "cpu")
        twin = twin.to(device=device, dtype=torch.bfloat16)
        flops = {n: count_flops(s) for n, s in
                 step_functions(twin, group, objective(), wl.wave_size).items()}
        del twin
    saved = {n: peak_saved_bytes(s, model) for n, s in steps.items()}
    memory = _memory(steps, model, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    left = None if budget_s is None else budget_s - (time.perf_counter() - t0)
    times = timed_rounds(steps, wl, warmup, sync, left)
    result = workload_result(wl, flops, saved, times, agreement)
    result["timed_repetitions"] = len(next(iter(times.values())))
    for name, (peak, above) in memory.items():
        result["schedules"][name].update(peak_memory_bytes=peak, peak_memory_above_base_bytes=above)
    for key, num in (("naive_over_joint", "naive"), ("naive_mb1_over_joint", "naive_mb1"),
                     ("tree_over_joint", "tree")):
        above = [memory[n][1] for n in (num, result["joint_variant"])]
        result[key]["memory"] = None if None in above else above[0] / above[1]
    result["profile"] = profile_steps(steps, ("naive", result["joint_variant"]), device, sync)
    result["bench_seconds"] = time.perf_counter() - t0
    log(f"[{wl.name}] {result['bench_seconds']:.0f}s naive/joint "
        + " ".join(f"{k} {_f(v)}" for k, v in result["naive_over_joint"].items()))
    return result


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_steps(steps: dict, names: tuple, device, sync, top: int = 8) -> dict:
    """name -> where one step's time goes (torch.profiler, after a warm-up step): wall, the
    device's busy time (kernel time summed), kernel launches, host syncs, and the ops with the
    most host and device self time. A wall far above the busy time means the step is bound by
    host work, not by the GPU."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    sync = sync or (lambda: None)
    out = {}
    for name in dict.fromkeys(names):
        steps[name]()
        sync()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            steps[name]()
            sync()
            wall = time.perf_counter() - start
        events = prof.key_averages()

        def dev(e):
            return getattr(e, "self_device_time_total", None) or getattr(
                e, "self_cuda_time_total", 0)

        def rows(key, events=events):
            return [[e.key, e.count, round(key(e) / 1e3, 3)]
                    for e in sorted(events, key=key, reverse=True)[:top] if key(e) > 0]

        out[name] = {"wall_s": wall, "device_busy_s": sum(dev(e) for e in events) / 1e6,
                     "kernel_launches": sum(e.count for e in events if e.key in LAUNCHES),
                     "host_syncs": sum(e.count for e in events if e.key in SYNCS),
                     "top_host_ms": rows(lambda e: e.self_cpu_time_total),
                     "top_device_ms": rows(dev)}
    return out


def profile_table(results: dict) -> str:
    """One line per profiled step, then each step's busiest ops."""
    lines = ["| workload | schedule | wall ms (profiled) | device busy ms | kernel launches "
             "| host syncs |", "|---|---|---|---|---|---|"]
    tops = []
    for wl, r in measured(results).items():
        for name, p in r.get("profile", {}).items():
            lines.append(f"| {wl} | {name} | {1e3 * p['wall_s']:.1f} "
                         f"| {1e3 * p['device_busy_s']:.1f} | {p['kernel_launches']} "
                         f"| {p['host_syncs']} |")
            for kind in ("top_host_ms", "top_device_ms"):
                ops = "; ".join(f"{k} x{c} {ms:.2f}" for k, c, ms in p[kind])
                tops.append(f"- {wl} {name} {kind.split('_')[1]}: {ops or 'n/a'}")
    return "\n".join(lines + [""] + tops)


def _f(x):
    return "n/a" if x is None else f"{x:.2f}"


def _ms(seconds):
    return None if seconds is None else 1e3 * seconds


def _mib(b):
    return "n/a" if b is None else f"{b / 2**20:.0f}"


def measured(results: dict) -> dict:
    """The workloads that ran to the end (not skipped, no error)."""
    return {n: r for n, r in results.items() if "schedules" in r}


def table(results: dict) -> str:
    lines = ["| workload | schedule | resp. tokens/s | wall ms | peak mem MiB | above base MiB "
             "| saved MiB | GFLOP |", "|---|---|---|---|---|---|---|---|"]
    others = {n: r for n, r in results.items() if "schedules" not in r}
    results = measured(results)
    for name, r in results.items():
        for sched, s in r["schedules"].items():
            gflop = "n/a" if s["flops"] is None else f"{s['flops'] / 1e9:.0f}"
            lines.append(f"| {name} | {sched} | {s['tokens_per_s']:.0f} | {1e3 * s['wall_s']:.1f} "
                         f"| {_mib(s['peak_memory_bytes'])} "
                         f"| {_mib(s['peak_memory_above_base_bytes'])} "
                         f"| {_mib(s['saved_bytes'])} | {gflop} |")
    lines += ["", "| workload | ratio | flops | saved bytes | memory | wall |",
              "|---|---|---|---|---|---|"]
    for name, r in results.items():
        for key in ("naive_over_joint", "naive_mb1_over_joint", "tree_over_joint"):
            x = r[key]
            lines.append(f"| {name} | {key} | {_f(x['flops'])} | {_f(x['saved_bytes'])} "
                         f"| {_f(x['memory'])} | {_f(x['wall'])} |")
    for name, r in others.items():
        lines.append(f"\n{name}: {r.get('error') or r.get('skipped')}")
    return "\n".join(lines)


def targets(results: dict) -> list:
    """[{workload, figure, measured, target, ok}] of ``GPU_TARGETS`` (naive over joint)."""
    rows = []
    results = measured(results)
    for name, figure, minimum in GPU_TARGETS:
        if name in results:
            value = results[name]["naive_over_joint"][figure]
            rows.append({"workload": name, "figure": f"naive/joint {figure}", "target": minimum,
                         "measured": value, "ok": value is not None and value >= minimum})
    return rows


def targets_table(rows: list) -> str:
    lines = ["| workload | figure | target | measured | met |", "|---|---|---|---|---|"]
    for t in rows:
        met = "n/a" if t["measured"] is None else ("yes" if t["ok"] else "NO")
        lines.append(f"| {t['workload']} | {t['figure']} | >= {t['target']} "
                     f"| {_f(t['measured'])} | {met} |")
    return "\n".join(lines)


def write_markdown(path: str, results: dict, meta: dict, decode=None) -> str:
    status = f"**{meta['status']}**" + (f": {meta['error']}" if meta.get("error") else "")
    text = (f"# GPU benchmark: naive vs packed tree mask vs joint replay\n\n"
            f"{meta['device']}, torch {meta['torch']}, {meta['dtype']}; {meta['layer_spec']}; "
            "cascade kernel " + ", ".join(f"{k} {v}" for k, v in meta["cascade_kernel"].items())
            + f"; whole run {meta['bench_seconds']:.0f} s; {status}."
            f"\n\n" + "\n".join(f"- {n}" for n in meta["notes"]) + "\n\n## Figures\n\n"
            + table(results) + "\n\n## Targets\n\n" + targets_table(meta["targets"]) + "\n"
            + "\n## Where one step's time goes\n\n" + profile_table(results) + "\n"
            + (f"\n## Rollout decode\n\n{decode_table(decode)}\n" if decode else ""))
    with open(path, "w") as f:
        f.write(text)
    return text


# ---- the rollout decode micro-benchmark ------------------------------------------------------

def decode_benchmark(wl, spec, backend, device, prompts: int = 2, new_tokens: int = 64,
                     reps: int = 3) -> dict:
    """Rollouts from ``wl``'s model (bf16 on CUDA, fp32 on CPU) of ``prompts`` random prompts
    of ``wl.prompt_length`` tokens, G = ``wl.group_size`` samples each, ``new_tokens`` tokens
    (no stop token), per row and prompt once (``decode.decode_modes``: the device's
    ``prompt_kv`` and the other one): median wall time, response tokens/s, and the time per
    decoding step (the difference to a one-token rollout, over the other steps)."""
    from scalerlt_mcore.rl.rollout import Sampling, generate

    from .decode import decode_modes

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _build(wl, spec, backend, device).to(dtype).eval()
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, wl.vocab, (wl.prompt_length,), generator=gen).tolist()
            for _ in range(prompts)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    modes = decode_modes(device)

    def wall(mode: str, tokens: int, graph=False) -> list:
        out = []
        for _ in range(1 + reps):  # the first is a warm-up
            sampler = torch.Generator(device=device).manual_seed(2)
            sync()
            start = time.perf_counter()
            generate(model, rows, wl.group_size, tokens, eos_id=-1, pad_id=0, cuda_graph=graph,
                     sampling=Sampling(banned=(0,), generator=sampler, vocab_size=wl.vocab),
                     **modes[mode])
            sync()
            out.append(time.perf_counter() - start)
        return out[1:]

    from .measure import median

    result = {"prompts": prompts, "group_size": wl.group_size, "prompt_length": wl.prompt_length,
              "new_tokens": new_tokens, "dtype": str(dtype).replace("torch.", ""),
              "hidden": wl.hidden, "heads": wl.heads, "num_loops": wl.num_loops,
              "modes": list(modes)}
    samples = prompts * wl.group_size
    for mode in modes:
        full, first = wall(mode, new_tokens), wall(mode, 1)
        step = (median(full) - median(first)) / max(new_tokens - 1, 1)
        result[mode] = {"wall_s": median(full), "wall_all_s": full, "one_token_s": median(first),
                        "tokens_per_s": samples * new_tokens / median(full),
                        "decode_step_s": step,
                        "decode_tokens_per_s": samples / step if step > 0 else None}
        if device.type == "cuda":  # decode steps replayed from graphs kept across rollouts
            result[mode].update(graphed_decode(partial(wall, mode, new_tokens),
                                               samples * new_tokens))
    from .decode import train_step_syncs

    result["train_step_host_syncs"] = {str(w): train_step_syncs(w, device) for w in (2, 8)}
    return result


def graphed_decode(wall, tokens: int) -> dict:
    """Rollouts through one ``DecodeGraphs`` (as ``--rl-decode-cuda-graph`` keeps them):
    ``wall(graphs)`` times its warm-up (which captures) and then rollouts that replay; the
    capture's seconds are reported apart from the replays' tokens/s."""
    from scalerlt_mcore.model.decode_graph import DecodeGraphs

    from .measure import median

    graphs = DecodeGraphs()
    graphed = median(wall(graphs))
    return {"graphed_wall_s": graphed, "graphed_tokens_per_s": tokens / graphed,
            "graph_captures": graphs.captures,
            "graph_capture_s": graphs.capture_s / max(graphs.captures, 1)}


def decode_table(d: dict) -> str:
    lines = [f"{d['prompts']} prompts x {d['group_size']} samples, prompt {d['prompt_length']}, "
             f"{d['new_tokens']} new tokens, {d['dtype']}, hidden {d['hidden']}, "
             f"{d['num_loops']} loops", "",
             "| rollout | wall ms | response tokens/s | decode step ms | decode tokens/s "
             "| CUDA-graph response tokens/s | graph captures | capture ms |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in d["modes"]:
        m = d[mode]
        lines.append(f"| {mode} | {1e3 * m['wall_s']:.1f} | {m['tokens_per_s']:.0f} "
                     f"| {1e3 * m['decode_step_s']:.2f} | {_f(m['decode_tokens_per_s'])} "
                     f"| {_f(m.get('graphed_tokens_per_s'))} | {m.get('graph_captures', 'n/a')} "
                     f"| {_f(_ms(m.get('graph_capture_s')))} |")
    return "\n".join(lines)


# ---- the run ---------------------------------------------------------------------------------

def write_outputs(path: str, results: dict, meta: dict, decode=None) -> None:
    """gpu.json and gpu.md as they stand (after every workload, and on a failure)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta["targets"] = targets(results)
    doc = {"meta": meta, **results}
    if decode is not None:
        doc["decode"] = decode
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    write_markdown(os.path.splitext(path)[0] + ".md", results, meta, decode)


def _workload_budget(args, clock_start: float, remaining: int):
    """Seconds for the next workload: an equal share of what is left of ``--budget-s`` (a
    fifth kept for the decode micro-benchmark when it runs); None without a budget."""
    if args.budget_s is None:
        return None
    left = args.budget_s - (time.perf_counter() - clock_start)
    if args.decode:
        left *= 0.8
    return left / max(remaining, 1)


MIN_WORKLOAD_S = 20.0
"""A workload with less time than this left is skipped (model, agreement, FLOPs and memory
before the first timed round)."""


def run_all(args, wls, device, meta: dict, t0: float, results: dict) -> tuple:
    """(exit status, decode figures): every workload into ``results``, the outputs written
    after each."""
    from scalerlt_mcore.testing import model_parallel_context

    from .measure import AgreementError

    decode, status = None, 0
    with model_parallel_context(seed=0):
        spec, backend, spec_note = choose_spec(args.spec)
        meta["layer_spec"] = spec_note
        print(f"layer spec: {spec_note}", flush=True)
        for i, wl in enumerate(wls):
            budget = _workload_budget(args, t0, len(wls) - i)
            if budget is not None and budget < MIN_WORKLOAD_S and not args.dry_run:
                results[wl.name] = {"skipped": f"time budget: {budget:.0f} s left for it"}
                write_outputs(args.out, results, meta)
                continue
            try:
                results[wl.name] = run_workload(wl, spec, backend, device, args.tolerance,
                                                args.warmup, budget_s=budget)
            except AgreementError as err:
                print(f"FAILED [{wl.name}]: schedules disagree with naive training: {err}",
                      file=sys.stderr, flush=True)
                results[wl.name] = {"error": f"schedules disagree with naive training: {err}",
                                    "agreement": err.errors}
                status = 2
            except Exception as err:  # the TE path is untested here: fall back to local
                if backend != "te" or args.spec == "te":
                    raise
                spec, backend, _ = choose_spec("local")
                meta["layer_spec"] = f"local layer spec + PyTorch SDPA (TE spec failed: {err!r})"
                print(f"layer spec: {meta['layer_spec']}", flush=True)
                results[wl.name] = run_workload(wl, spec, backend, device, args.tolerance,
                                                args.warmup, budget_s=budget)
            meta["bench_seconds"] = time.perf_counter() - t0
            write_outputs(args.out, results, meta)
        if args.decode:
            decode = decode_benchmark(wls[0], spec, backend, device,
                                      new_tokens=8 if args.dry_run else 64,
                                      reps=1 if args.dry_run else 3)
    return status, decode


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks.gpu needs a CUDA GPU (use --dry-run to exercise it on CPU)",
              file=sys.stderr)
        return 1
    for category in (UserWarning, DeprecationWarning, FutureWarning):  # MCore's import notes
        warnings.filterwarnings("ignore", category=category)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        torch.set_num_threads(1)  # tiny ops: one thread is faster on a shared CPU
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 agreement check is exact
        torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    wls = workloads(args)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
            "torch": torch.__version__, "dtype": "bfloat16 (agreement checked in float32)",
            "layer_spec": "", "bench_seconds": 0.0, "status": "running", "error": None,
            "budget_s": args.budget_s, "cascade_kernel": {},
            "notes": ["tokens/s counts trained response tokens (G * S per step)",
                      "memory ratios use the peak above the memory held when the step began",
                      "FLOPs: FlopCounterMode (PyTorch's SDPA convention: full score square; "
                      "flops_causal counts the causal triangle of is_causal calls); "
                      "with TE, counted on a local-spec twin of the same model",
                      "agreement: fp32, loss within the tolerance, gradient within it relative "
                      "to its largest entry over the whole gradient"]}
    results, decode, status = {}, None, 1
    try:
        meta["cascade_kernel"] = cascade_kernels(wls[0].hidden // wls[0].heads, device)
        status, decode = run_all(args, wls, device, meta, t0, results)
        meta["status"] = "complete" if status == 0 else "failed"
        if status:
            meta["error"] = "; ".join(r["error"] for r in results.values() if "error" in r)
    except BaseException as err:  # the outputs say what happened, then the error propagates
        meta.update(status="failed", error=f"{type(err).__name__}: {err}",
                    traceback=traceback.format_exc()[-6000:])
        raise
    finally:
        meta["bench_seconds"] = time.perf_counter() - t0
        write_outputs(args.out, results, meta, decode)
    print(table(results))
    if decode is not None:
        print("\n" + decode_table(decode))
    print("\n" + targets_table(meta["targets"]))
    print(f"\nwhole GPU benchmark: {meta['bench_seconds']:.0f} s ({meta['status']}); results in "
          f"{args.out}, {os.path.splitext(args.out)[0]}.md")
    return status


if __name__ == "__main__":
    sys.exit(main())
