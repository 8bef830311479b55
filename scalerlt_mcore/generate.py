"""Sample from a trained checkpoint: ``python -m scalerlt_mcore.generate --load DIR --prompt P``.

The model, tokenizer and task come from the run config stored in the checkpoint (``--config``
replaces it); the tokenizer must be the one the checkpoint was trained with. Greedy by default;
``--loop`` picks the readout (1..R, or ``all`` for every loop's), ``--task-prompts N`` draws N
held-out prompts of the run's task and scores the completions with its reward.

    python -m scalerlt_mcore.generate --load ckpt --prompt "abca>" --loop all
    python -m scalerlt_mcore.generate --load ckpt --task-prompts 8 --temperature 1 --num-samples 4

Errors a user causes (flags, a missing or mismatched checkpoint, a bad config) print one line,
``error: ...``, and exit with status 2.
"""

import argparse
import dataclasses
import sys

from scalerlt_mcore.app.checkpoint import check_tokenizer, load_model_weights, read_meta
from scalerlt_mcore.app.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    read_yaml,
    sampling_from,
    task_from,
    tokenizer_from,
)
from scalerlt_mcore.app.pretrained import run_vocab_size
from scalerlt_mcore.app.runtime import (
    build_model,
    init_distributed,
    model_config,
    shutdown_distributed,
)
from scalerlt_mcore.app.train import USER_ERRORS, exit_with_error, quiet_library_warnings


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are ``ConfigError`` (one line from ``cli``)."""

    def error(self, message):
        raise ConfigError(f"{message} (see python -m scalerlt_mcore.generate --help)")


def parse(argv) -> argparse.Namespace:
    p = _Parser(prog="python -m scalerlt_mcore.generate", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (as --save wrote it)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--task-prompts", type=int, default=0,
                   help="also this many held-out prompts of the run's task, with rewards")
    p.add_argument("--config", help="run config YAML to use instead of the checkpoint's")
    p.add_argument("--loop", default="last", help="readout: 1..R, 'last' or 'all'")
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the run's rl_max_response_length")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.prompt and not args.task_prompts:
        p.error("give --prompt TEXT and/or --task-prompts N")
    return args


def run_config(args) -> RunConfig:
    """The checkpoint's run config (or ``--config``'s), for one process (``one_process``)."""
    if args.config:
        return one_process(apply_overrides(RunConfig(), read_yaml(args.config),
                                           f"in {args.config}"))
    meta = read_meta(args.load)
    if "config" not in meta:
        raise ConfigError(f"checkpoint {args.load} stores no run config; pass --config")
    return one_process(apply_overrides(RunConfig(), meta["config"],
                                       f"in the config of {args.load}"))


def one_process(cfg: RunConfig) -> RunConfig:
    """``cfg`` at tensor-parallel size 1, its vocabulary the size the run padded it to: these
    commands run one process, and a checkpoint holds every tensor with its global shape, so a
    run's at any tensor-parallel size loads there."""
    m = cfg.model
    if m.tensor_model_parallel_size != 1:
        cfg.model = dataclasses.replace(m, vocab_size=run_vocab_size(cfg),
                                        tensor_model_parallel_size=1)
    return cfg


def loops(choice: str, num_loops: int) -> list[int]:
    """0-based readout indices of ``--loop``."""
    if choice == "all":
        return list(range(num_loops))
    if choice == "last":
        return [num_loops - 1]
    if not choice.isdigit() or not 1 <= int(choice) <= num_loops:
        raise ConfigError(f"--loop must be 1..{num_loops}, 'last' or 'all', got {choice!r}")
    return [int(choice) - 1]


def load_model(cfg, load: str):
    """The trained model on this process (one rank): the weights of checkpoint ``load`` (saved
    with this run's tokenizer; its optimizer state is a training run's, at its parallel
    layout, not read)."""
    device = init_distributed(cfg)
    check_tokenizer(load, tokenizer_from(cfg).identity())
    model = build_model(cfg, model_config(cfg, device), run_vocab_size(cfg), device)
    load_model_weights(load, model)
    return model.eval()


def sample(model, cfg, args, prompts: list, loop: int):
    """Completions [prompt][sample] (text) of ``prompts`` from readout ``loop``."""
    import torch

    from scalerlt_mcore.rl.rollout import generate

    tok = tokenizer_from(cfg)
    ids = [[tok.bos_id] + tok.encode(p) for p in prompts]
    device = next(model.parameters()).device
    # a pretrained vocabulary may extend past the tokenizer's: never sample those ids
    sampling = sampling_from(cfg, loop, temperature=args.temperature, top_p=args.top_p,
                             generator=torch.Generator(device=device).manual_seed(args.seed),
                             banned=(tok.pad_id, tok.bos_id), vocab_size=tok.vocab_size)
    out = generate(model, ids, args.num_samples,
                   args.max_new_tokens or cfg.rl.rl_max_response_length, eos_id=tok.eos_id,
                   pad_id=tok.pad_id, sampling=sampling)
    return [[tok.decode(r.tolist()) for r in out.responses[n]] for n in range(len(prompts))]


def held_out_problems(task, n: int, seed: int) -> list:
    """``n`` problems of the task's evaluation split: prompts no training step draws."""
    return task.sample(10**9 + seed, n, split="eval") if n else []


def check_prompts(cfg, prompts: list) -> None:
    """Refuse a prompt the run's tokenizer cannot encode, naming it."""
    tok = tokenizer_from(cfg)
    for prompt in prompts:
        try:
            tok.encode(prompt)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"--prompt {prompt!r}: the checkpoint's tokenizer cannot encode "
                              f"it ({e})") from None


def main(argv=None) -> None:
    """Parse, load and sample; every error propagates (see ``cli``)."""
    quiet_library_warnings()
    args = parse(sys.argv[1:] if argv is None else argv)
    cfg = run_config(args)
    task = task_from(cfg)
    problems = held_out_problems(task, args.task_prompts, args.seed)
    prompts = args.prompt + [p.prompt for p in problems]
    check_prompts(cfg, args.prompt)
    readouts = loops(args.loop, cfg.model.looped_num_loops)
    try:
        model = load_model(cfg, args.load)
        for loop in readouts:
            for n, samples in enumerate(sample(model, cfg, args, prompts, loop)):
                for text in samples:
                    print(_line(loop, prompts[n], text, task, problems, n - len(args.prompt)))
    finally:
        shutdown_distributed()


def _line(loop: int, prompt: str, text: str, task, problems: list, k: int) -> str:
    line = f"loop {loop + 1} | {prompt!r} -> {text!r}"
    if k >= 0:
        line += f" | reward {task.reward(problems[k], text):.2f} (answer {problems[k].answer!r})"
    return line


def cli(argv=None) -> None:
    """``main`` for the command line: a user's error prints ``error: ...`` (one line) and
    exits with status 2."""
    try:
        main(argv)
    except USER_ERRORS as e:
        exit_with_error(e)


if __name__ == "__main__":
    cli()
