"""Tokenizer, tasks and advantage / loss functions of ``scalerlt_mcore.rl``."""

import os
import random
import subprocess
import sys

import pytest
import torch

from scalerlt_mcore.rl import (
    CharTokenizer,
    Problem,
    get_task,
    group_advantages,
    kl_k3,
    ppo_clipped_objective,
    tasks,
)
from scalerlt_mcore.rl.objective import RLObjective
from scalerlt_mcore.rl.task_registry import TASKS
from scalerlt_mcore.rl.tasks import split_of

# ----------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    text = "17+25%7= abc>cba|z:,-"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size == 3 + len(tok.alphabet)


def test_tokenizer_decode_stops_at_eos_and_drops_pad():
    tok = CharTokenizer()
    ids = [tok.pad_id, tok.bos_id] + tok.encode("42") + [tok.eos_id] + tok.encode("99")
    assert tok.decode(ids) == "42"
    assert tok.decode(torch.tensor(tok.encode("7") + [tok.pad_id] * 3)) == "7"


def test_tokenizer_errors_name_the_character():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="'A'"):
        tok.encode("aAb")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


# ----------------------------------------------------------------------- tasks


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_deterministic_from_seed_not_global_rng(name):
    task = get_task(name)
    random.seed(0)
    torch.manual_seed(0)
    first = task.sample(seed=5, n=20)
    random.seed(99)
    assert task.sample(seed=5, n=20) == first
    assert task.sample(seed=6, n=20) != first
    assert task.supervised_pairs(5, 3) == [(p.prompt, p.answer) for p in first[:3]]


LONG_PROMPT_TASKS = {"kv_retrieval"}  # prompts of hundreds of characters on purpose


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_problems_fit_tokenizer_and_limits(name):
    task, tok = get_task(name), CharTokenizer()
    limit = task.max_prompt_chars if name in LONG_PROMPT_TASKS else 12
    for p in task.sample(seed=1, n=200):
        tok.encode(p.prompt + p.answer)
        assert len(p.prompt) <= min(task.max_prompt_chars, limit)
        assert 1 <= len(p.answer) <= task.max_answer_chars
        assert task.reward(p, p.answer) == 1.0


@pytest.mark.parametrize("name, options", [
    ("modular_arithmetic", {}), ("reverse", {}), ("sort", {}),
    ("reverse", {"min_len": 2, "max_len": 3, "alphabet": "abcd"}),  # the demo's task
    ("reverse", {"min_len": 2, "max_len": 3, "alphabet": "ab"}),  # the e2e tests' (12 prompts)
    ("kv_retrieval", {"num_pairs": 4, "key_len": 2, "value_len": 1}),  # the long-prompt task
])
def test_evaluation_prompts_are_disjoint_from_training_prompts(name, options):
    """Over many draws, no prompt drawn for training (RL or warm-up) is ever drawn for
    evaluation: the split is a property of the prompt text."""
    task = get_task(name, **options)
    train = {p.prompt for seed in range(300) for p in task.sample(seed, 16)}
    train |= {prompt for seed in range(300) for prompt, _ in task.supervised_pairs(seed, 16)}
    evals = {p.prompt for seed in range(300) for p in task.sample(seed, 16, split="eval")}
    assert train and evals and not train & evals, sorted(train & evals)[:5]
    assert {split_of(p) for p in train} == {"train"} and {split_of(p) for p in evals} == {"eval"}
    if options.get("alphabet") in ("ab", "abcd"):  # small spaces: every prompt is drawn
        n = sum(len(options["alphabet"]) ** k for k in range(2, 4))
        assert len(train) + len(evals) == n, (len(train), len(evals), n)


def test_generate_task_prompts_are_held_out():
    """``python -m scalerlt_mcore.generate --task-prompts N`` scores held-out prompts, as its
    help says: every one is of the evaluation split (it drew training prompts before)."""
    from scalerlt_mcore.generate import held_out_problems

    task = get_task("reverse", min_len=2, max_len=3, alphabet="abcd")
    problems = held_out_problems(task, 32, seed=0)
    assert len(problems) == 32 and {split_of(p.prompt) for p in problems} == {"eval"}
    assert held_out_problems(task, 0, seed=0) == []


def test_split_errors():
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'eval'\), got 'test'"):
        get_task("reverse").sample(0, 1, split="test")
    lone = get_task("reverse", min_len=1, max_len=1, alphabet="a")  # one prompt: 'a>'
    other = "train" if split_of("a>") == "eval" else "eval"
    with pytest.raises(ValueError, match=f"task 'reverse' drew no {other} prompt"):
        lone.sample(0, 1, split=other)


def test_modular_arithmetic_answers_and_options():
    task = get_task("modular_arithmetic", modulus=11, min_operand=3, max_operand=9, ops="*")
    for p in task.sample(seed=0, n=50):
        a, rest = p.prompt.split("*")
        b = rest.split("%")[0]
        assert p.prompt.endswith("%11=") and 3 <= int(a) <= 9 and 3 <= int(b) <= 9
        assert p.answer == str(int(a) * int(b) % 11)
    assert get_task("modular_arithmetic").max_prompt_chars == len("20+20%7=")


def test_reverse_and_sort_answers():
    rev = get_task("reverse", min_len=2, max_len=3)
    for p in rev.sample(seed=0, n=30):
        assert p.prompt.endswith(">") and p.answer == p.prompt[:-1][::-1]
        assert 2 <= len(p.answer) <= 3
    srt = get_task("sort", alphabet="ba9")
    for p in srt.sample(seed=0, n=30):
        assert p.prompt.endswith("|") and p.answer == "".join(sorted(p.prompt[:-1]))


def _parse_kv(prompt: str) -> tuple:
    """(dict of the context's pairs, the list of keys in order, the queried key)."""
    context, query = prompt.split("|")
    pairs = [pair.split(":") for pair in context.split(",")]
    assert query.endswith("=")
    return dict(pairs), [k for k, _ in pairs], query[:-1]


def test_kv_retrieval_default_is_a_512_token_prompt_with_a_retrievable_answer():
    task, tok = get_task("kv_retrieval"), CharTokenizer()
    problems = task.sample(seed=3, n=50)
    for p in problems:
        assert len(tok.encode(p.prompt, bos=True)) == 512 == 1 + task.max_prompt_chars
        table, keys, query = _parse_kv(p.prompt)
        assert len(keys) == len(table) == 42  # distinct keys
        assert all(len(k) == 6 and k.isalpha() for k in keys)
        assert all(len(v) == 4 and v.isdigit() for v in table.values())
        assert p.answer == table[query]
        assert task.reward(p, p.answer) == 1.0 and task.reward(p, p.answer[:-1]) == 0.0
    # the queried pair sits anywhere in the context
    positions = {_parse_kv(p.prompt)[1].index(_parse_kv(p.prompt)[2]) for p in problems}
    assert len(positions) > 20


def test_kv_retrieval_options_and_errors():
    task = get_task("kv_retrieval", num_pairs=5, key_len=2, value_len=3)
    for p in task.sample(seed=0, n=30):
        table, keys, query = _parse_kv(p.prompt)
        assert len(keys) == len(table) == 5 and len(p.answer) == 3 == task.max_answer_chars
        assert len(p.prompt) == task.max_prompt_chars == 5 * 7 + 3
    with pytest.raises(ValueError, match="num_pairs must be >= 1"):
        get_task("kv_retrieval", num_pairs=0)
    with pytest.raises(ValueError, match="too few distinct keys"):
        get_task("kv_retrieval", num_pairs=14, key_len=1)
    with pytest.raises(ValueError, match="value_len must be >= 1"):
        get_task("kv_retrieval", value_len=0)


def test_kv_retrieval_draw_does_not_depend_on_the_hash_seed():
    """Problems derive from the seed alone: the same in every process (ranks, resumed runs),
    whatever PYTHONHASHSEED randomises (set and dict order of strings). The subprocesses load
    tasks.py alone (standard library only)."""
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('t', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            "print([(p.prompt, p.answer) for p in "
            "m.KeyValueRetrieval(num_pairs=30, key_len=2).sample(seed=4, n=3)])")
    outs = {subprocess.run([sys.executable, "-c", code, tasks.__file__], capture_output=True,
                           text=True, env={**os.environ, "PYTHONHASHSEED": str(h)},
                           check=True).stdout.strip() for h in (1, 2, 3)}
    here = get_task("kv_retrieval", num_pairs=30, key_len=2).sample(seed=4, n=3)
    assert outs == {repr([(p.prompt, p.answer) for p in here])}


def test_kv_retrieval_training_and_evaluation_prompts_differ():
    """Training draws (one seed per step) and evaluation draws (another seed) share no prompt:
    the context of N random pairs makes the prompt space large."""
    task = get_task("kv_retrieval", num_pairs=8, key_len=3, value_len=2)
    train = {p.prompt for seed in range(50) for p in task.sample(seed, 8)}
    evals = {p.prompt for p in task.sample(10**6, 64)}
    assert len(train) == 400 and len(evals) == 64
    assert not train & evals


def test_reward_exact_wrong_and_partial():
    task = get_task("reverse")
    p = Problem("abcd>", "dcba")
    assert task.reward(p, "dcba") == 1.0
    assert task.reward(p, "dcbx") == 0.0
    assert task.reward(p, "dcbx", partial_credit=True) == 0.75
    assert task.reward(p, "dcbaa", partial_credit=True) == 0.8
    assert task.reward(p, "dc", partial_credit=True) == 0.5
    assert task.reward(p, "", partial_credit=True) == 0.0
    assert task.reward(p, "dcba", partial_credit=True) == 1.0


def test_get_task_errors():
    with pytest.raises(ValueError,
                       match="known tasks: kv_retrieval, modular_arithmetic, reverse, sort"):
        get_task("revers")
    with pytest.raises(ValueError, match="no option 'modulos'"):
        get_task("modular_arithmetic", modulos=7)
    with pytest.raises(ValueError, match="'modulus' expects int"):
        get_task("modular_arithmetic", modulus="7")
    with pytest.raises(ValueError, match="min_len <= max_len"):
        get_task("sort", min_len=5, max_len=2)


# ----------------------------------------------------------------------- advantages


def test_group_advantages_known_values():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    torch.testing.assert_close(group_advantages(r, "none"), r)
    centred = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 1.0, 3.0]])
    torch.testing.assert_close(group_advantages(r, "dr_grpo"), centred)
    std = torch.tensor([[0.5], [5.0**0.5]])  # population std (unbiased=False)
    torch.testing.assert_close(group_advantages(r, "grpo", eps=0.0), centred / std)
    torch.testing.assert_close(group_advantages(r), centred / (std + 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_group_advantages_zero_variance_group_is_zero(dtype):
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=dtype)
    adv = group_advantages(r, "grpo")
    assert adv.dtype == dtype and torch.isfinite(adv).all()
    assert (adv[:2] == 0).all() and adv[2, 1] > 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_group_advantages_reject_non_finite_naming_group(bad):
    r = torch.zeros(3, 4)
    r[2, 1] = bad
    with pytest.raises(ValueError, match="reward is NaN/inf in group 2: step rejected"):
        group_advantages(r, "dr_grpo")


def test_group_advantages_unknown_mode():
    with pytest.raises(ValueError, match="unknown advantage mode 'gpro'"):
        group_advantages(torch.zeros(1, 2), "gpro")


# ----------------------------------------------------------------------- PPO and KL


def test_ppo_objective_known_values_and_clipping_both_sides():
    ratio = torch.tensor([[1.0, 1.5, 0.5, 1.5, 0.5, 1.1]])
    adv = torch.tensor([[2.0, 1.0, -1.0, -1.0, 1.0, 3.0]])
    logp_old = torch.full_like(ratio, -1.3)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    loss, clipped = ppo_clipped_objective(ratio.log() + logp_old, logp_old, adv, mask,
                                          clip_low=0.2, clip_high=0.3)
    # A>0 above 1+high: clipped at 1.3; A<0 below 1-low: clipped at 0.8;
    # A<0 above / A>0 below the range: the unclipped (pessimistic) term wins.
    expected = torch.tensor([[-2.0, -1.3, 0.8, 1.5, -0.5, 0.0]])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(clipped, torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 0.0]]))


def test_ppo_objective_per_sequence_advantage_and_gradient():
    logp_old = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64))
    logp_new = logp_old.clone().requires_grad_()
    loss, clipped = ppo_clipped_objective(logp_new, logp_old, torch.tensor([2.0]),
                                          torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -2.0]], dtype=torch.float64))
    loss.sum().backward()  # at ratio 1 the gradient is -A per token
    torch.testing.assert_close(logp_new.grad, torch.full((1, 2), -2.0, dtype=torch.float64))
    assert clipped.sum() == 0


def test_entropy_term_known_values_and_direction():
    """Megatron-LM's GRPO entropy term: the loss of a token gains -w * (-p log p) (p its
    probability); a gradient step lowers a token with p > 1/e and raises one with p < 1/e. With
    zero advantage the loss is the term alone, weighted by loop credit and token weights."""
    p = torch.tensor([[[0.9, 0.2, 0.5]]], dtype=torch.float64)  # [R=1, B=1, T=3]
    lp = p.log().requires_grad_()
    weights = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)  # the third token is off
    obj = RLObjective(entropy_weight=0.1)
    loss, _ = obj.loss(lp, lp.detach(), torch.zeros(1, dtype=torch.float64), weights)
    h = -(p * p.log())[0, 0]
    torch.testing.assert_close(loss, -0.1 * 0.5 * (h[0] + h[1]))
    loss.backward()
    assert lp.grad[0, 0, 0] > 0 and lp.grad[0, 0, 1] < 0 and lp.grad[0, 0, 2] == 0
    with pytest.raises(ValueError, match="entropy_weight must be >= 0, got -1"):
        RLObjective(entropy_weight=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kl_k3_non_negative_and_zero_when_equal(dtype):
    g = torch.Generator().manual_seed(0)
    new = torch.randn(4, 16, generator=g).to(dtype)
    ref = (new + 1e-3 * torch.randn(4, 16, generator=g)).to(dtype)
    assert (kl_k3(new, ref) >= 0).all() and kl_k3(new, ref).dtype == dtype
    assert (kl_k3(new, new) == 0).all()
    d = torch.tensor([0.5], dtype=torch.float64)
    torch.testing.assert_close(kl_k3(torch.zeros(1, dtype=torch.float64), d), d.exp() - d - 1)


# ----------------------------------------------------------------------- loop credit


def test_loop_credit_registry_is_the_one_source(monkeypatch):
    """The RL loss, the warm-up loss, the checks and the flag's choices all read
    ``LOOP_CREDIT``: a scheme added there (here: the first readout only) is accepted by the
    objective and weights both losses; a model-part scheme's needs are the checks'."""
    from scalerlt_mcore.app.config import KEYS, choices
    from scalerlt_mcore.rl import loop_credit
    from scalerlt_mcore.rl.sft import sft_loss

    assert choices(KEYS["rl_loop_weights"][1]) == tuple(loop_credit.LOOP_CREDIT)
    first = loop_credit.LoopCredit(fixed=lambda R, device: torch.eye(
        R, dtype=torch.float64, device=device)[0])
    monkeypatch.setitem(loop_credit.LOOP_CREDIT, "first", first)
    R, B, T = 3, 2, 4
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(R, B, T, generator=gen, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    nll, _ = sft_loss("first", mask, logprobs)
    assert nll.item() == pytest.approx(-logprobs[0].mean().item(), abs=1e-15)
    objective = RLObjective(loop_weights="first")
    old, adv = logprobs.clone(), torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = objective.loss(logprobs, old, adv, mask / mask.sum())
    # ratio 1, unclipped: -A per token, weighted by the first loop only
    assert loss.item() == pytest.approx(-(adv[:, None] * mask).sum().item() / mask.sum().item())
    model = type("Model", (), {"looped_exit_gate": False, "looped_learned_loop_weights": True,
                               "looped_num_loops": R})()
    [error] = objective.model_errors(model, max_loops=R)
    assert (error.field, str(error)) == ("loop_weights", (
        "loop_weights must be learned with looped_learned_loop_weights (otherwise its "
        "parameters get no gradient)"))
    assert list(map(str, RLObjective(loop_weights="learned").model_errors(
        model, max_loops=R + 1))) == [
        f"loop_weights learned: looped_learned_loop_weights holds looped_num_loops = {R} "
        f"per-loop weights, but looped_num_loops_sampling draws up to {R + 1} loops"]
    with pytest.raises(ValueError, match="loop_weights must be one of .*'first'"):
        RLObjective(loop_weights="last")
