"""The flags of tree rollouts: ``--rl-rollout tree`` and ``--rl-tree-branches``, checked with
one line naming the flag."""

import pytest

from scalerlt_mcore.app.config import ConfigError, parse_args, validate
from scalerlt_mcore.app.config.rl import parse_tree_branches, tree_turns

MULTITURN = ["--rl-task", "multiturn", "--rl-task-options",
             "{task: reverse, options: {min_len: 2, max_len: 3, alphabet: ab}}"]
TREE = ["--rl-rollout", "tree", "--rl-tree-branches", "2,2", "--grpo-group-size", "4",
        "--global-batch-size", "8", "--micro-batch-size", "4", "--max-position-embeddings", "32",
        *MULTITURN]


def test_branches_parse():
    assert parse_tree_branches("4,4") == (4, 4)
    assert parse_tree_branches("3") == (3,)
    assert parse_tree_branches("2, 1,3") == (2, 1, 3)


def test_a_two_level_multiturn_tree_validates():
    cfg = parse_args(TREE)
    validate(cfg, world_size=1)
    assert cfg.rl.rl_rollout == "tree" and tree_turns(cfg.rl) == 2
    assert tree_turns(parse_args([]).rl) == 1  # the demo: one-level groups


@pytest.mark.parametrize("argv, message", [
    (["--rl-tree-branches", "4,x"], r"rl_tree_branches must be comma-separated integers >= 1 "
     r"\(the branch factor per depth below the root, e.g. 4,4\), got '4,x'"),
    (["--rl-tree-branches", "4,0"], "rl_tree_branches must be comma-separated integers >= 1"),
    (["--rl-tree-branches", "-2"], "rl_tree_branches must be comma-separated integers >= 1"),
    (["--rl-tree-branches", ""], "rl_tree_branches must be comma-separated integers >= 1"),
    (["--rl-tree-branches", "2,4"], r"rl_tree_branches 2,4 gives 8 leaves per prompt: "
     r"grpo_group_size must equal it, got 4"),
    (["--rl-task", "reverse", "--rl-task-options", "{}"],
     r"rl_tree_branches 2,2 has 2 turns: rl_task reverse has no environment reply"),
    (["--max-position-embeddings", "16"], r"max_position_embeddings \(16\) must be >= bos \+ "
     r"longest prompt \+ 2 x rl_max_response_length \+ 1 x longest reply \(5\) = 22"),
    (["--rl-rollout", "trees"], "rl_rollout must be one of"),
])
def test_bad_tree_flags_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(TREE + argv), world_size=1)


def test_branches_of_a_single_turn_tree_need_no_reply():
    validate(parse_args(TREE + ["--rl-tree-branches", "4", "--rl-task", "reverse",
                                "--rl-task-options", "{}"]), world_size=1)
