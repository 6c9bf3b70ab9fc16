"""Task sets as data: Harbor task folders (and a plain SWE-style form) read into ``Task``, each
run's folder prepared and its tests run in the run's sandbox (``Workspace``), and ``turnrl
check-tasks`` (``check_tasks``)."""

from turnrl.tasks.check import TaskCheck, check_task, check_tasks
from turnrl.tasks.dockerfile import Dockerfile, TaskError
from turnrl.tasks.harness import place, reward
from turnrl.tasks.task import Task, load_task, load_tasks, rows
from turnrl.tasks.workspace import Verdict, Workspace, read_reward

__all__ = [
    "Dockerfile",
    "Task",
    "TaskCheck",
    "TaskError",
    "Verdict",
    "Workspace",
    "check_task",
    "check_tasks",
    "load_task",
    "load_tasks",
    "place",
    "read_reward",
    "reward",
    "rows",
]
