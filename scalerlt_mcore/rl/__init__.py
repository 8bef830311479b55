"""RL building blocks (the library's top floor): the objective, advantages, rollouts, tasks
and the tokenizer glue. No process groups, no optimizer: the app wires them.

- ``objective``: ``RLObjective`` (PPO clip, k3 KL, per-loop credit, group normalisation) and
  ``rl_forward_step``, the per-wave ``forward_step_func`` of the shared-prefix schedule.
- ``loop_credit``: the registry of loop-credit schemes (RL loss, warm-up loss, checks).
- ``sft``: the supervised warm-up's batch and loss.
- ``batch``: ``RLGroup`` (a shared-prefix group with the RL loss's tensors), a rollout batch
  as groups, old log-probs from the rollout, drift.
- ``stats``: the metrics of an RL step.
- ``advantages``: group advantages (GRPO, Dr. GRPO), the PPO clipped objective, k3 KL.
- ``rollout``: batched sampling from the looped model with the depth-indexed KV cache.
- ``tasks``: tasks with verifiable rewards, shipped with the package; ``task_registry``: any task
  by name (``get_task``, ``TASKS``, ``mix``), reasoning-gym datasets (``reasoning_gym``) included.
- ``tokenizer``: ``CharTokenizer``, a character vocabulary for the built-in tasks.
"""

from scalerlt_mcore.rl.advantages import group_advantages, kl_k3, ppo_clipped_objective
from scalerlt_mcore.rl.batch import RLGroup
from scalerlt_mcore.rl.loop_credit import LOOP_CREDIT, loop_weights
from scalerlt_mcore.rl.objective import RLObjective, rl_forward_step
from scalerlt_mcore.rl.task_registry import TASKS, get_task
from scalerlt_mcore.rl.tasks import Problem, Task
from scalerlt_mcore.rl.tokenizer import CharTokenizer

__all__ = [
    "LOOP_CREDIT",
    "TASKS",
    "CharTokenizer",
    "Problem",
    "RLGroup",
    "RLObjective",
    "Task",
    "get_task",
    "group_advantages",
    "kl_k3",
    "loop_weights",
    "ppo_clipped_objective",
    "rl_forward_step",
]
