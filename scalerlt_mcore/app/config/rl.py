"""The RL section: task, sampling (its ``Sampling`` keys through ``SAMPLING_FLAGS``) and the
policy-gradient loss (its ``RLObjective`` keys through ``OBJECTIVE_FLAGS``) and their checks:
the library objects' own, what the loss needs of the model, and the task against the
lengths."""

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

from ...model.config import FieldError, parse_loop_sampling
from ...rl.advantages import AdvantageMode
from ...rl.loop_credit import LoopWeights
from ...rl.objective import Normalization, RLObjective
from ...rl.rollout import ExitMode, Sampling
from ...rl.tasks import is_multiturn, measure_lengths
from ...rl.tokenizer import CharTokenizer
from ...rl.user_task import DatasetTask
from .builders import objective_from, sampling_from, task_from, tokenizer_args, tokenizer_from
from .library import (
    LIBRARY_ERRORS,
    OBJECTIVE_FLAGS,
    SAMPLING_FLAGS,
    in_key_names,
    library_errors,
    positive,
)

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass
class RLArgs:
    """Task, sampling and the policy-gradient loss (``rl_loss_normalization``,
    ``grpo_clamp_eps_*``, ``grpo_kl_beta``, ``rl_loop_weights``: the fields of ``RLObjective``,
    with its defaults; Megatron-LM's ``grpo_*`` names where it has the flag)."""

    rl_task: str = "modular_arithmetic"
    """Task: a built-in name (``scalerlt_mcore.rl.task_registry.TASKS``), ``mix``,
    ``reasoning_gym:<dataset>``, rows of a file (``jsonl:PATH``, ``parquet:PATH``: columns
    ``prompt``, ``answer``, others passed to ``rl_reward``) or the user's
    ``module.path:factory`` (or ``file.py:factory``), called as ``factory(**rl_task_options)``
    and returning a ``scalerlt_mcore.rl.Task``."""
    rl_task_options: dict = field(default_factory=dict)
    """Options of the task, e.g. ``{modulus: 7}``; on the command line a YAML mapping,
    which replaces (does not merge with) the file's."""
    rl_reward: Optional[str] = None
    """Reward of a dataset task (``jsonl:PATH``, ``parquet:PATH``): ``module.path:function``
    (or ``file.py:function``), called as ``function(response_text, row) -> float`` with the
    decoded response and the row (every column); None: 1.0 for the exact answer, else 0.0."""
    grpo_group_size: int = 8
    """G: responses sampled per prompt."""
    grpo_prompts_per_step: Optional[int] = None
    """Prompts per RL step, summed over data-parallel ranks; None: ``global_batch_size /
    grpo_group_size`` (when set, ``global_batch_size`` must equal it x ``grpo_group_size``)."""
    rl_max_response_length: int = 4
    """Most tokens sampled per response (eos included); also the length of the ``constant``
    loss normalisation."""
    rl_temperature: float = Sampling.temperature
    """Sampling temperature T; the old, new and KL-reference log-probs of the update are those
    of the distribution sampled, log_softmax(logits / T) (top-p not applied)."""
    rl_top_p: float = Sampling.top_p
    """Nucleus-sampling threshold; 1 disables it."""
    rl_advantage: AdvantageMode = "grpo"
    """``grpo`` ((r - mean) / std per group), ``dr_grpo`` (r - mean) or ``none`` (r)."""
    grpo_iterations: int = 1
    """Passes (optimizer steps) over each rollout batch (PPO epochs)."""
    rl_rollout: Literal["prompt_once", "per_row", "tree"] = "prompt_once"
    """How rollouts hold the prompts: ``prompt_once`` (each prompt prefilled once, its G
    samples read that one copy of its K/V, Hydragen-style) or ``per_row`` (every sample its
    own row: the prompt prefilled and cached G times), the same samples up to rounding; or
    ``tree``, a prefix tree per prompt (``rl_tree_branches``): each turn's answers branch,
    a multi-turn task's environment replies between turns, every node's K/V is prefilled
    once, and the tree trains through the shared-prefix schedule as one GRPO group over its
    leaves."""
    rl_prompt_kv: Optional[Literal["shared", "copied"]] = None
    """How ``prompt_once`` rollouts read each prompt's K/V after prefilling it once:
    ``shared`` (one copy per prompt, read once per group by a two-part cascade attention:
    the GPU's choice, where a decode step is bound by memory reads) or ``copied`` (copied into
    each sample's cache once, then decoded as per row: one attention part per step, the CPU's
    choice, where a step is bound by host time per op); None: by device (``copied`` on CPU,
    ``shared`` elsewhere). The same samples up to rounding."""
    inference_max_requests: Optional[int] = None
    """Most samples a rank decodes at once (Megatron-LM's ``--inference-max-requests``),
    which bounds the rollout's K/V cache: whole groups together where it holds one or more,
    else each prompt's samples this many at a time (``prompt_once`` prefills the prompt once
    per call); a tree rollout's whole trees, so at least ``grpo_group_size``. The samples are
    drawn in turn from the step's generator (other draws than all at once, the same
    distribution). None: every sample of the rank's prompts at once."""
    rl_rollout_source: Literal["decode", "engine"] = "decode"
    """``decode`` (the trainer decodes its rollouts itself) or ``engine``: RL steps take their
    rollouts from a serving engine in another process through ``rl_engine_dir``
    (``python -m scalerlt_mcore.engine`` with the run's flags is one), the policy published
    there after every step; warm-up and evaluation still decode in-process."""
    rl_engine_dir: Optional[str] = None
    """The engine's directory: ``weights/`` (published versions), ``requests/``, ``records/``
    (``app/engine.py``)."""
    rl_max_policy_lag: int = 1
    """Engine rollouts: the most weight versions a record may lag the trainer's (0: every
    rollout decoded by the current policy, no overlap; 1: the engine decodes the next step's
    rollouts while the trainer trains)."""
    rl_stale_records: Literal["refuse", "drop"] = "refuse"
    """A record older than ``rl_max_policy_lag``: ``refuse`` (the step fails, naming it) or
    ``drop`` (its group is left out of the step; counted in ``engine_dropped_groups``)."""
    rl_publish_dir: Optional[str] = None
    """Publish the policy after the start and after every step to this directory, for a
    serving engine in another process: each a weight version (1, 2, ... above what the
    directory holds) in the model's Hugging Face format, written whole or not at all, LATEST
    the newest (``rl/publish.py``); data-parallel rank 0 writes. None: no publication."""
    rl_decode_cuda_graph: bool = False
    """Rollouts replay every decode step as a CUDA graph (``model/decode_graph.py``), kept
    across steps: captured once per rollout shape (prompts padded to a multiple of 64
    tokens; the two most recent shapes kept) and again only when the weights move to new
    storage. CUDA only, without tensor parallelism, not with ``rl_rollout: tree``; the kept
    static caches stay allocated through the training step (memory it does not have)."""
    rl_tree_branches: str = "4,4"
    """Branch factor per depth below the root of ``rl_rollout: tree``, comma-separated:
    ``4,4`` samples 4 first answers per prompt and 4 second answers after each (with the
    environment's reply between them: a multi-turn task such as ``multiturn``), 16 leaves,
    which must equal ``grpo_group_size``. A text: in YAML quote a single level (``"4"``)."""
    rl_rollout_exit: ExitMode = Sampling.exit_mode
    """How rollouts use the exit gate (needs looped_exit_gate): ``none`` (sample from the last
    loop's readout), ``mixture`` (from the exit-weighted mixture sum_r p(r) pi_r, Ouro/RLTT)
    or ``threshold`` (per token, from the first loop whose exit CDF reaches
    rl_exit_threshold: Ouro's early exit)."""
    rl_exit_threshold: float = Sampling.exit_threshold
    """Exit CDF threshold of ``rl_rollout_exit: threshold``, in (0, 1]."""
    rl_stop_check_interval: Optional[int] = Sampling.stop_check_interval
    """Rollouts ask whether every response has stopped every this many tokens (each ask
    makes the host wait for the device; tokens after a stop are padding either way); None:
    by device (8 on CUDA, 1 elsewhere)."""
    rl_old_logprobs: Literal["score", "rollout"] = "score"
    """Old (behaviour) log-probs of the update: ``score`` (a forward-only pass of the policy
    through the shared-prefix schedule after the rollout) or ``rollout`` (the rollout's own
    per-loop log-probs of the sampled tokens: no scoring pass; they differ from the training
    forward's by rounding, logged as rollout_logprob_max_diff). ``rollout`` needs
    ``grpo_iterations`` 1."""
    rl_inference_logprobs_is_correction: bool = RLObjective.inference_is_correction
    """Megatron-LM's importance-sampling correction between the rollout's log-probs and the
    scored old log-probs: each token's policy term weighted by exp(old - rollout) at its loop
    (needs rl_old_logprobs score); the mean weight is logged (is_weight)."""
    rl_importance_sampling_truncation_coef: Optional[float] = RLObjective.is_truncation_coef
    """With rl_inference_logprobs_is_correction: the weights truncated at this value (the
    fraction truncated is logged, is_truncated); None: not truncated."""
    rl_partial_credit: bool = False
    """Reward wrong answers with the fraction of correct positions."""
    rl_warmup_sft_steps: int = 0
    """Supervised steps on (prompt, answer) pairs before RL."""
    rl_warmup_sft_lr: Optional[float] = None
    """Constant learning rate of the supervised warm-up steps, which then leave the schedule
    alone (``lr``, ``lr_warmup_iters`` and the decay start with RL); None: the warm-up steps
    follow the schedule like RL steps."""
    rl_loss_normalization: Normalization = RLObjective.normalization
    """token_mean: / valid tokens of the group; seq_mean: mean over responses of per-response
    token means; constant: / (G * rl_max_response_length) (Dr. GRPO); step_token_mean: / valid
    tokens of the whole step, all groups and ranks (DAPO; needs calculate_per_token_loss)."""
    calculate_per_token_loss: bool = False
    """MCore's per-token loss (``TransformerConfig.calculate_per_token_loss``): each RL step's
    loss is its token sum over every group and data-parallel rank, divided by the step's
    trained tokens (finalize_model_grads), and so is the supervised warm-up's NLL; needs
    rl_loss_normalization step_token_mean."""
    grpo_clamp_eps_lower: float = RLObjective.clip_low
    """PPO ratio clip below: ratio >= 1 - grpo_clamp_eps_lower."""
    grpo_clamp_eps_upper: float = RLObjective.clip_high
    """PPO ratio clip above: ratio <= 1 + grpo_clamp_eps_upper."""
    grpo_kl_beta: float = RLObjective.kl_coef
    """Weight of the k3 KL to the reference policy (needs ref log-probs when > 0). The main
    job's reference is the policy at the start of RL (after the supervised warm-up), saved with
    checkpoints."""
    grpo_entropy_term_weight: float = RLObjective.entropy_weight
    """Weight of Megatron-LM's GRPO entropy term: minus grpo_entropy_term_weight * (-p log p)
    of every sampled token is added to its loss, p the token's probability under the current
    policy; it lowers tokens with p > 1/e and raises rarer ones, against the entropy collapse
    that leaves groups all right or all wrong (0: off)."""
    rl_loop_weights: LoopWeights = RLObjective.loop_weights
    """Per-loop credit over all-loop readouts (``loop_credit.LOOP_CREDIT``): final | uniform |
    progressive (fixed), exit_pdf (per token, the exit gate's p(r), detached: credit follows
    the gate but the policy loss does not move the gate, which a policy loss could otherwise
    push to whichever loop's surrogate is lowest; the gate learns from its own term,
    ``rl_exit_gate_coef``) | learned (RLTT: softmax of trainable per-loop logits, trained with
    the policy)."""
    rl_exit_gate_coef: float = RLObjective.exit_gate_coef
    """Weight of the exit gate's entropy-regularised expected loss (0: off); needs the gate."""
    rl_exit_entropy_coef: float = RLObjective.exit_entropy_coef
    """Entropy bonus (beta) of the exit distribution inside the gate's objective."""


def check_rl(cfg: "RunConfig") -> list[str]:
    """Sampling and the update, the loss's own checks (``RLObjective``), its needs of the
    model (loop credit, exit gate), the rollout tree and the task."""
    return (_check_sampling(cfg.rl) + library_errors(sampling_from, cfg, SAMPLING_FLAGS)
            + library_errors(objective_from, cfg, OBJECTIVE_FLAGS) + _check_loop_credit(cfg)
            + _check_tree(cfg.rl) + _check_task(cfg) + _check_decode_graph(cfg)
            + _check_per_token(cfg.rl) + _check_publish(cfg) + _check_engine(cfg.rl))


def _check_engine(rl: RLArgs) -> list[str]:
    """What engine rollouts need: their directory, one-level rollouts sampled from the last
    loop or at the exit gate's threshold (records hold one log-prob per token and its exit
    depth: the old log-probs are scored, each token at its own loop)."""
    if rl.rl_rollout_source != "engine":
        return ["rl_engine_dir is read only with rl_rollout_source engine"] if (
            rl.rl_engine_dir) else []
    errors = [] if rl.rl_engine_dir else ["rl_rollout_source engine needs rl_engine_dir"]
    for key, value, need in (("rl_rollout", rl.rl_rollout, ("prompt_once", "per_row")),
                             ("rl_rollout_exit", rl.rl_rollout_exit, ("none", "threshold")),
                             ("rl_old_logprobs", rl.rl_old_logprobs, ("score",))):
        if value not in need:
            errors.append(f"rl_rollout_source engine needs {key} {' or '.join(need)}, got "
                          f"{value!r}")
    if rl.rl_rollout_exit == "threshold" and rl.rl_loop_weights != "final":
        errors.append(f"rl_rollout_source engine with rl_rollout_exit threshold replays each "
                      f"token at its exit depth: it needs rl_loop_weights final, got "
                      f"{rl.rl_loop_weights!r}")
    if rl.rl_publish_dir:
        errors.append("rl_rollout_source engine publishes to rl_engine_dir/weights: leave "
                      "rl_publish_dir unset")
    if rl.rl_max_policy_lag < 0:
        errors.append(f"rl_max_policy_lag must be >= 0, got {rl.rl_max_policy_lag}")
    return errors


def _check_publish(cfg: "RunConfig") -> list[str]:
    """Publication writes the whole model from one rank: no model parallelism."""
    m = cfg.model
    publishes = cfg.rl.rl_publish_dir or cfg.rl.rl_rollout_source == "engine"
    if publishes and (m.tensor_model_parallel_size != 1
                                  or m.pipeline_model_parallel_size != 1):
        return [f"rl_publish_dir and engine rollouts publish the whole model from one rank: "
                f"they need "
                f"tensor_model_parallel_size and pipeline_model_parallel_size 1, got "
                f"{m.tensor_model_parallel_size} and {m.pipeline_model_parallel_size}"]
    return []


def _check_per_token(rl: RLArgs) -> list[str]:
    """The step-wide token mean is MCore's per-token loss: the key and the normalisation come
    together."""
    step_mean = rl.rl_loss_normalization == "step_token_mean"
    if step_mean and not rl.calculate_per_token_loss:
        return ["rl_loss_normalization step_token_mean needs calculate_per_token_loss true "
                "(MCore divides the step's token sum by its token count)"]
    if rl.calculate_per_token_loss and not step_mean:
        return [f"calculate_per_token_loss needs rl_loss_normalization step_token_mean (the "
                f"step-wide token mean), got {rl.rl_loss_normalization}"]
    return []


def _check_decode_graph(cfg: "RunConfig") -> list[str]:
    """What graphed decoding runs without (the device is checked by the trainer)."""
    if not cfg.rl.rl_decode_cuda_graph:
        return []
    if cfg.rl.rl_rollout == "tree":
        return ["rl_decode_cuda_graph decodes rl_rollout prompt_once or per_row; tree "
                "rollouts decode eagerly"]
    if cfg.model.tensor_model_parallel_size != 1:
        return [f"rl_decode_cuda_graph runs without tensor parallelism (the vocabulary gather "
                f"is not captured), got tensor_model_parallel_size "
                f"{cfg.model.tensor_model_parallel_size}"]
    return []


def parse_tree_branches(text: str) -> tuple:
    """``rl_tree_branches`` as the branch factor per depth, ``"4,4"`` -> (4, 4); anything but
    comma-separated integers >= 1 is a ValueError naming the key."""
    parts = str(text).split(",")
    if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"rl_tree_branches must be comma-separated integers >= 1 (the "
                         f"branch factor per depth below the root, e.g. 4,4), got {text!r}")
    return tuple(int(p) for p in parts)


def rollout_positions(rl: RLArgs, prompt: int, reply: int = 0, prompts: int = 1) -> int:
    """K/V positions a rank's rollout of ``prompts`` prompts (of ``prompt`` positions) holds
    at once at its longest, ``inference_max_requests`` samples at a time: per prompt,
    ``per_row`` G rows of prompt and response, ``prompt_once`` the prompt once and G
    responses, ``tree`` every node once (answers of ``rl_max_response_length``, ``reply``
    after each but the last turn's)."""
    S, G, rows = rl.rl_max_response_length, rl.grpo_group_size, rl.inference_max_requests
    if rows is not None and rows < G:  # one prompt's samples, ``rows`` at a time
        return rows * (prompt + S) if rl.rl_rollout == "per_row" else prompt + rows * S
    at_once = prompts if rows is None else min(prompts, rows // G)
    return at_once * _group_positions(rl, prompt, reply)


def _group_positions(rl: RLArgs, prompt: int, reply: int) -> int:
    """K/V positions of one prompt's whole group (``rollout_positions``)."""
    S, G = rl.rl_max_response_length, rl.grpo_group_size
    if rl.rl_rollout == "per_row":
        return G * (prompt + S)
    if rl.rl_rollout == "prompt_once":
        return prompt + G * S
    branches, nodes, width = parse_tree_branches(rl.rl_tree_branches), 0, 1
    for depth, b in enumerate(branches):
        width *= b
        nodes += width * (S + (reply if depth < len(branches) - 1 else 0))
    return prompt + nodes


def tree_turns(rl: RLArgs) -> int:
    """The model's answers on a root-to-leaf path: the tree's depth with ``rl_rollout:
    tree``, else 1."""
    return len(parse_tree_branches(rl.rl_tree_branches)) if rl.rl_rollout == "tree" else 1


def _check_tree(rl: RLArgs) -> list[str]:
    """The branch factors parse; a tree's leaves are the group."""
    try:
        branches = parse_tree_branches(rl.rl_tree_branches)
    except ValueError as e:
        return [str(e)]
    leaves = math.prod(branches)
    if rl.rl_rollout == "tree" and rl.grpo_group_size != leaves:
        return [f"rl_tree_branches {rl.rl_tree_branches} gives {leaves} leaves per prompt: "
                f"grpo_group_size must equal it, got {rl.grpo_group_size}"]
    rows = rl.inference_max_requests
    if rows is not None and rows < 1:
        return [f"inference_max_requests must be >= 1 or null, got {rows}"]
    if rows is not None and rl.rl_rollout == "tree" and rows < leaves:
        return [f"inference_max_requests {rows} holds no whole tree: rl_rollout tree decodes "
                f"whole trees of {leaves} leaves (rl_tree_branches {rl.rl_tree_branches})"]
    return []


def _check_sampling(rl: RLArgs) -> list[str]:
    """Rollout lengths, RL's temperature (``Sampling`` checks the rest), the updates per
    batch, the warm-up and the advantage."""
    errors = positive(rl, "rl_max_response_length", "grpo_iterations")
    errors += positive(rl, "rl_warmup_sft_steps", minimum=0)
    if rl.rl_warmup_sft_lr is not None and rl.rl_warmup_sft_lr <= 0:
        errors.append(f"rl_warmup_sft_lr must be > 0 or null, got {rl.rl_warmup_sft_lr}")
    if rl.rl_temperature <= 0:
        errors.append(f"rl_temperature must be > 0, got {rl.rl_temperature}")
    if rl.rl_old_logprobs == "rollout" and rl.grpo_iterations != 1:
        errors.append(f"rl_old_logprobs 'rollout' needs grpo_iterations 1, got "
                      f"{rl.grpo_iterations} (the rollout's log-probs replace the scoring pass "
                      f"of a single update)")
    if rl.rl_inference_logprobs_is_correction and rl.rl_old_logprobs != "score":
        errors.append("rl_inference_logprobs_is_correction needs rl_old_logprobs score (with "
                      "'rollout' the old log-probs are the rollout's: every weight is 1)")
    if rl.rl_reward is not None and rl.rl_partial_credit:
        errors.append("rl_partial_credit applies to the exact-match reward, not to rl_reward "
                      "(its function's value is the reward)")
    if rl.rl_advantage != "none" and rl.grpo_group_size == 1:
        errors.append(f"rl_advantage {rl.rl_advantage!r} needs grpo_group_size >= 2 "
                      "(a group of one has zero advantage)")
    return errors


def _check_loop_credit(cfg: "RunConfig") -> list[str]:
    """What the loss needs of the model and the model's parts of the loss
    (``RLObjective.model_errors``: loop credit, exit gate), and the rollout's exit gate."""
    m, errors = cfg.model, []
    try:
        high = parse_loop_sampling(m.looped_num_loops_sampling, m.looped_num_loops)[2]
    except ValueError:
        high = None  # reported by the model section's check
    try:
        errors += [in_key_names(e, OBJECTIVE_FLAGS)
                   for e in objective_from(cfg).model_errors(m, max_loops=high)]
    except LIBRARY_ERRORS:
        pass  # an invalid objective: reported by its own check
    if cfg.rl.rl_rollout_exit != "none" and not m.looped_exit_gate:
        errors.append(f"rl_rollout_exit {cfg.rl.rl_rollout_exit} needs looped_exit_gate true")
    return errors


def _check_task(cfg: "RunConfig") -> list[str]:
    """The task builds (with its reward), has evaluation prompts (every run evaluates), its
    text encodes, and its longest prompt and answer (stated by the task, else measured on a
    sample) fit the lengths."""
    try:
        task = task_from(cfg)
        task.sample(0, 1, split="eval")
    except FieldError as e:  # names its key (rl_task, rl_reward, rl_task_options)
        return [str(e)]
    except ValueError as e:
        return [f"rl_task / rl_task_options: {e}"]
    try:
        tok = tokenizer_from(cfg)
    except (ValueError, OSError):
        return []  # reported by the tokenizer section's check
    try:
        turns = tree_turns(cfg.rl)
    except ValueError:
        return []  # reported by the tree's check
    if turns > 1 and not is_multiturn(task):
        return [f"rl_tree_branches {cfg.rl.rl_tree_branches} has {turns} turns: rl_task "
                f"{cfg.rl.rl_task} has no environment reply between them (use a multi-turn "
                f"task, e.g. rl_task multiturn)"]
    try:
        prompt, answer = task_lengths(task, tok)
        reply = max_reply_tokens(task, tok) if turns > 1 else 0
    except ValueError as e:
        return [f"rl_task {cfg.rl.rl_task} with tokenizer_type "
                f"{tokenizer_args(cfg)[0]}: {e}"]
    errors = []
    if cfg.rl.rl_max_response_length < answer:
        errors.append(f"rl_max_response_length ({cfg.rl.rl_max_response_length}) is shorter "
                      f"than the task's longest answer ({answer})")
    needed = 1 + prompt + turns * cfg.rl.rl_max_response_length + (turns - 1) * reply
    if cfg.model.max_position_embeddings < needed and turns == 1:
        errors.append(f"max_position_embeddings ({cfg.model.max_position_embeddings}) must be "
                      f">= bos + longest prompt + rl_max_response_length ({needed})")
    elif cfg.model.max_position_embeddings < needed:
        errors.append(f"max_position_embeddings ({cfg.model.max_position_embeddings}) must be "
                      f">= bos + longest prompt + {turns} x rl_max_response_length + "
                      f"{turns - 1} x longest reply ({reply}) = {needed}: a root-to-leaf "
                      f"path of rl_tree_branches {cfg.rl.rl_tree_branches}")
    return errors


def max_reply_tokens(task, tok, n: int = 256, seed: int = 0) -> int:
    """Longest environment reply of a multi-turn task in tokens of ``tok``: the task's bound
    where it states one and ``tok`` has one token per character, else measured on ``n``
    sampled problems (the replies to a right and to an empty answer)."""
    bound = getattr(task, "max_reply_chars", None)
    if bound is not None and (isinstance(tok, CharTokenizer)
                              or tok.identity()["type"] == "ByteLevelTokenizer"):
        return bound
    return max(len(tok.encode(task.reply(p, answer)))
               for p in task.sample(seed, n) for answer in (p.answer, ""))


def task_lengths(task, tok) -> tuple[int, int]:
    """(longest prompt, longest answer) in tokens: the task's own bounds where it states them
    and the tokenizer has one token per character, else measured on 256 sampled problems."""
    if isinstance(task, DatasetTask):  # every row, not a sample of them
        measured = measure_lengths(task, tok.encode, problems=task.problems())
    else:
        measured = measure_lengths(task, tok.encode)  # also: every character encodes
    exact = task.max_prompt_chars is not None and (
        isinstance(tok, CharTokenizer) or tok.identity()["type"] == "ByteLevelTokenizer")
    return (task.max_prompt_chars, task.max_answer_chars) if exact else measured
