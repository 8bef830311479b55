"""A reward for ``--rl-task jsonl:examples/data/reverse_abc.jsonl`` (each row: ``prompt``,
``answer`` and ``letters``, the answer's letters in order), used as
``--rl-reward examples/reverse_reward.py:reward``.

The contract of ``--rl-reward``: ``function(response_text: str, row: dict) -> float``, the
decoded response (eos and what follows removed) and the row with every column.
"""


def reward(response_text: str, row: dict) -> float:
    """1.0 for the reversed string; 0.25 for its letters in another order (the row's
    ``letters`` column); else 0.0."""
    if response_text == row["answer"]:
        return 1.0
    return 0.25 if "".join(sorted(response_text)) == row["letters"] else 0.0
