"""RL building blocks with no model or process-group dependencies.

- ``tokenizer``: ``CharTokenizer``, a character vocabulary for the built-in tasks.
- ``tasks``: tasks with verifiable rewards (``get_task``), shipped with the package.
- ``advantages``: group advantages (GRPO, Dr. GRPO), the PPO clipped objective, k3 KL.
"""

from scalerlt_mcore.rl.advantages import group_advantages, kl_k3, ppo_clipped_objective
from scalerlt_mcore.rl.tasks import TASKS, Problem, Task, get_task
from scalerlt_mcore.rl.tokenizer import CharTokenizer

__all__ = [
    "TASKS",
    "CharTokenizer",
    "Problem",
    "Task",
    "get_task",
    "group_advantages",
    "kl_k3",
    "ppo_clipped_objective",
]
