"""Task registry: every fine-tuning/evaluation task, listed explicitly.

Adding a task means writing one module and one line here; there is no
discovery by import side effects, so what exists is visible in this file.
"""

from __future__ import annotations

from .base import DataError, Example, Task
from .dialogsum import DialogSum
from .e2e_nlg import E2ENLG
from .sqlcontext import SQLContext

TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        DialogSum(),
        E2ENLG(),
        SQLContext(),
    )
}


def get_task(name: str) -> Task:
    """The registered task called *name*; ValueError lists the known names."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


__all__ = ["TASKS", "DataError", "Example", "Task", "get_task"]
