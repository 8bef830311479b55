"""The multi-turn task: the environment's reply (verdict and hint) and the final answer's
reward."""

import random

import pytest

from scalerlt_mcore.rl import CharTokenizer, Problem, get_task
from scalerlt_mcore.rl.task_registry import corrupt
from scalerlt_mcore.rl.tasks import correct_prefix, hint_reply, is_multiturn


def test_correct_prefix_stops_after_the_first_wrong_character():
    assert correct_prefix("cba", "cab") == "cb"
    assert correct_prefix("cba", "x") == "c"
    assert correct_prefix("cba", "") == "c"
    assert correct_prefix("cba", "cba") == "cba"
    assert correct_prefix("cba", "cbaa") == "cba"  # too long: the whole answer


def test_hint_reply_verdict_hint_and_marker():
    p = Problem("abc>", "cba")
    assert hint_reply(p, "cab") == "-cb>"
    assert hint_reply(p, "cba") == "+cba>"
    assert hint_reply(p, "cab", hint="none") == "->"
    assert hint_reply(Problem("3+4%7=", "0"), "5") == "-0="
    with pytest.raises(ValueError, match="hint must be one of"):
        hint_reply(p, "cab", hint="all")


def test_multiturn_task_replies_and_rewards_the_final_answer():
    task = get_task("multiturn", task="reverse", options={"min_len": 3, "max_len": 3,
                                                            "alphabet": "ab"})
    assert is_multiturn(task) and not is_multiturn(get_task("reverse"))
    problems = task.sample(0, 8)
    assert problems == get_task("reverse", min_len=3, max_len=3, alphabet="ab").sample(0, 8)
    p = problems[0]
    wrong = "".join("b" if c == "a" else "a" for c in p.answer)
    assert task.reply(p, wrong) == "-" + p.answer[0] + ">"
    assert task.reply(p, p.answer) == "+" + p.answer + ">"
    assert task.reward(p, p.answer) == 1.0 and task.reward(p, wrong) == 0.0
    assert task.reward(p, p.answer[:2] + wrong[2], partial_credit=True) == pytest.approx(2 / 3)
    assert task.max_reply_chars == 5 and task.max_prompt_chars == 4
    assert task.supervised_pairs(1, 3) == [(q.prompt, q.answer) for q in task.sample(1, 3)]
    tok = CharTokenizer()  # every reply encodes in the built-in vocabulary
    assert tok.decode(tok.encode(task.reply(p, wrong))) == task.reply(p, wrong)


def test_multiturn_of_arithmetic_with_verdict_only():
    task = get_task("multiturn", task="modular_arithmetic", options={"modulus": 5},
                    hint="none")
    p = task.sample(3, 1)[0]
    assert task.reply(p, p.answer) == "+=" and task.reply(p, "x") == "-="
    assert task.max_reply_chars == 2


@pytest.mark.parametrize("options, message", [
    ({"task": "multiturn"}, "option 'task' must name another task"),
    ({"task": "revers"}, "unknown task 'revers'"),
    ({"hint": "all"}, "option 'hint' must be one of"),
    ({"turns": 2}, "task 'multiturn' takes the options 'task', 'options' and 'hint'"),
    ({"options": {"max_len": "3"}}, "task option 'max_len' expects int"),
])
def test_multiturn_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        get_task("multiturn", **options)


def test_warm_up_episodes_hold_earlier_answers_and_end_right():
    task = get_task("multiturn", options={"min_len": 3, "max_len": 3, "alphabet": "ab"})
    episodes = task.supervised_episodes(5, 60, turns=3)
    assert episodes == task.supervised_episodes(5, 60, turns=3)  # seeded
    assert {len(earlier) for _, earlier in episodes} == {0, 1, 2}
    said = [a for p, earlier in episodes for a in earlier]
    assert any(a == p.answer for p, e in episodes for a in e) and len(said) > 20
    assert sum(a != p.answer for p, e in episodes for a in e) > len(said) / 2
    assert all(len(e) == 0 for _, e in task.supervised_episodes(5, 10, turns=1))
    p = Problem("aab>", "baa")
    assert {corrupt(p, random.Random(s)) for s in range(20)} <= {"aaa", "bba", "bab"}
    assert corrupt(Problem("aaa>", "aaa"), random.Random(0)) in {"", "a", "aa"}
