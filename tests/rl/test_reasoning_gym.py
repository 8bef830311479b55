"""reasoning-gym tasks and weighted task mixes (``rl_task reasoning_gym:<dataset>``, ``mix``):
problems from the run's seed, rewards from the dataset's ``score_answer``, answers checked
against the question by hand, and the errors that name what is wrong."""

import random
import re
from collections import Counter

import pytest

from scalerlt_mcore.app.config import ConfigError, parse_args, validate
from scalerlt_mcore.rl.task_registry import get_task

CHAIN = ("reasoning_gym:chain_sum", {"min_terms": 2, "max_terms": 3, "max_digits": 1})
SPELL = ("reasoning_gym:spell_backward", {"min_word_len": 3, "max_word_len": 5})


def test_chain_sum_answers_are_the_arithmetic_in_the_question():
    task = get_task(CHAIN[0], **CHAIN[1])
    assert task.name == "reasoning_gym:chain_sum"
    for p in task.sample(seed=3, n=40):
        expr = re.fullmatch(r"State the final answer to the following arithmetic problem: "
                            r"([\d +-]+) =", p.prompt)[1]
        assert p.answer == str(eval(expr))  # digits, + and - only (matched above)
        assert task.reward(p, p.answer) == 1.0
        assert task.reward(p, str(int(p.answer) + 1)) == 0.0


def test_spell_backward_answers_and_the_datasets_partial_credit():
    task = get_task(SPELL[0], **SPELL[1])
    for p in task.sample(seed=4, n=40):
        word = p.prompt.rsplit(": ", 1)[1]
        assert p.answer == word[::-1] and 3 <= len(word) <= 5
        assert task.reward(p, p.answer) == 1.0
        # the dataset's own score: the answer inside a longer text earns a fraction, counted
        # with partial credit only (else exact match: 0)
        assert 0.0 < task.reward(p, p.answer + "!!", partial_credit=True) < 1.0
        assert task.reward(p, p.answer + "!!") == 0.0


def test_problems_come_from_the_seed_alone():
    task = get_task(*CHAIN[:1], **CHAIN[1])
    random.seed(0)
    first = task.sample(seed=11, n=20)
    random.seed(1)
    again = get_task(*CHAIN[:1], **CHAIN[1]).sample(seed=11, n=20)
    assert [(p.prompt, p.answer) for p in again] == [(p.prompt, p.answer) for p in first]
    assert task.sample(seed=12, n=20) != first


def test_mix_draws_by_weight_and_scores_each_problem_with_its_task():
    mix = get_task("mix", tasks=[{"task": SPELL[0], "weight": 3, "options": SPELL[1]},
                                 {"task": "reverse", "options": {"max_len": 3}}])
    problems = mix.sample(seed=0, n=400)
    kinds = Counter("Spell" in p.prompt for p in problems)
    assert 0.68 < kinds[True] / 400 < 0.82  # weight 3 : 1 -> 0.75
    for p in problems[:40]:
        assert mix.reward(p, p.answer) == 1.0
        if p.prompt.endswith(">"):  # reverse: exact match, partial credit on request
            assert mix.reward(p, "zz" + p.answer, partial_credit=True) < 1.0
    assert mix.sample(seed=0, n=400) == problems


@pytest.mark.parametrize("name, options, message", [
    ("reasoning_gym:no_such_dataset", {}, "unknown reasoning-gym dataset 'no_such_dataset'"),
    ("reasoning_gym:chain_sum", {"min_terms": 5, "max_terms": 2}, "rejects options"),
    ("reasoning_gym:chain_sum", {"colour": 1}, "rejects options"),
    ("reasoning_gym:chain_sum", {"seed": 3}, "set neither seed nor size"),
    ("mix", {"tasks": []}, "needs options"),
    ("mix", {"tasks": [{"task": "reverse", "weight": 0}]}, "weight must be a number > 0"),
    ("mix", {"tasks": [{"task": "reverse", "share": 1}]}, "unknown key 'share'"),
    ("mix", {"tasks": [{"task": "mix"}]}, "a mix cannot contain a mix"),
    ("mix", {"datasets": []}, "takes only the option 'tasks'"),
])
def test_bad_task_options_are_named(name, options, message):
    with pytest.raises(ValueError, match=message):
        get_task(name, **options)


def _rg_flags(*extra: str) -> list:
    return ["--rl-task", CHAIN[0], "--rl-task-options", "{max_terms: 2, max_digits: 1}",
            "--max-position-embeddings", "96", "--rl-max-response-length", "4", *extra]


def test_validate_checks_the_task_against_the_tokenizer():
    with pytest.raises(ConfigError, match=r"rl_task reasoning_gym:chain_sum with tokenizer_type "
                       r"CharTokenizer: character 'S'"):
        validate(parse_args(_rg_flags("--tokenizer-type", "CharTokenizer")), world_size=1)
    validate(parse_args(_rg_flags("--tokenizer-type", "ByteLevelTokenizer")), world_size=1)
    # measured lengths: every prompt is 67 bytes ("...problem: 4 - 1 ="): 1 + 67 + 4 positions
    with pytest.raises(ConfigError, match=r"max_position_embeddings \(64\) must be >= bos \+ "
                       r"longest prompt \+ rl_max_response_length \(72\)"):
        validate(parse_args(_rg_flags("--tokenizer-type", "ByteLevelTokenizer",
                                      "--max-position-embeddings", "64")), world_size=1)
    with pytest.raises(ConfigError, match=r"rl_max_response_length \(1\) is shorter than the "
                       r"task's longest answer \(2\)"):
        validate(parse_args(_rg_flags("--tokenizer-type", "ByteLevelTokenizer",
                                      "--rl-max-response-length", "1")), world_size=1)


def test_an_option_error_names_its_key_once():
    """The task raises a ``FieldError`` of ``rl_task_options``: the app says it as it is, with
    no second name in front."""
    with pytest.raises(ConfigError) as e:
        validate(parse_args(_rg_flags("--rl-task-options", "{seed: 3}")), world_size=1)
    assert ("rl_task_options of a reasoning-gym task set neither seed nor size (problems are "
            "drawn from the run's --seed)") in str(e.value)
    assert "rl_task / rl_task_options" not in str(e.value)
