"""Builds the task a ``task`` schema describes (``build_task(cfg.task)``) and checks what it
needs of the file system first (``check_task``).

``BUILDERS`` maps each schema class of ``rl/config/task.py`` to the function that builds its
task (a subclass of a registered schema gets its parent's builder unless it registers its
own). A new task: its schema there, its builder and its entry here.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

from rl.config.task import (AdditionTaskConfig, CalculatorTaskConfig, JsonlTaskConfig, RepeatCountTaskConfig,
                            RepeatLetterTaskConfig, TaskConfig)
from rl.tasks import Task
from rl.tasks.builtin import AdditionTask, CalculatorTask, RepeatCountTask, RepeatLetterTask
from rl.tasks.jsonl import JsonlTask, read_rows


def repeat_letter_task(cfg: RepeatLetterTaskConfig) -> RepeatLetterTask:
    return RepeatLetterTask(repeat=cfg.repeat, seed=cfg.seed)


def repeat_count_task(cfg: RepeatCountTaskConfig) -> RepeatCountTask:
    return RepeatCountTask(min_repeat=cfg.min_repeat, max_repeat=cfg.max_repeat, seed=cfg.seed)


def addition_task(cfg: AdditionTaskConfig) -> AdditionTask:
    return AdditionTask(max_value=cfg.max_value, seed=cfg.seed)


def calculator_task(cfg: CalculatorTaskConfig) -> CalculatorTask:
    return CalculatorTask(max_value=cfg.max_value, seed=cfg.seed, copy_credit=cfg.copy_credit,
                          copy_credit_fade=cfg.copy_credit_fade)


def jsonl_task(cfg: JsonlTaskConfig) -> JsonlTask:
    return JsonlTask(path=os.path.expanduser(cfg.path), reward=cfg.reward, seed=cfg.seed)


BUILDERS: dict[type, Callable[..., Task]] = {RepeatLetterTaskConfig: repeat_letter_task,
                                             RepeatCountTaskConfig: repeat_count_task,
                                             AdditionTaskConfig: addition_task,
                                             CalculatorTaskConfig: calculator_task,
                                             JsonlTaskConfig: jsonl_task}
"""Builder of each ``task`` schema class."""


def build_task(cfg: TaskConfig) -> Task:
    """The task ``cfg`` describes (a JSONL task reads its file here)."""
    builder = next((BUILDERS[t] for t in type(cfg).__mro__ if t in BUILDERS), None)
    if builder is None:
        known = ", ".join(f"{t.__name__} ({t.name})" for t in BUILDERS)
        raise ValueError(f"task={cfg.name!r} ({type(cfg).__name__}): no builder is registered "
                         f"for it in rl.tasks.build.BUILDERS; known: {known}")
    return builder(cfg)


def max_label_bytes(cfg: TaskConfig, task: Task | None = None) -> int:
    """An upper bound of the UTF-8 bytes of the task's labels: a JSONL task's longest label,
    from ``task`` when given (the task ``build_task`` made of ``cfg``, its rows read), else
    read from its file; another task's from its schema (``TaskConfig.max_label_bytes``)."""
    if isinstance(cfg, JsonlTaskConfig):
        rows = task.rows if isinstance(task, JsonlTask) else read_rows(os.path.expanduser(cfg.path))
        return max(len(label.encode("utf-8")) for _, label in rows)
    return cfg.max_label_bytes()


def check_task(cfg: TaskConfig) -> None:
    """What the task needs outside its config, checked by the driver before anything starts
    (``rl.driver.run.CheckConfigFirst``): a JSONL task's whole file is read, since a bad line
    found by the rollout manager would surface only after Ray, the engines and the learners
    started (about 25 s on a laptop), and its reward function is imported."""
    if not isinstance(cfg, JsonlTaskConfig):
        return
    path = os.path.expanduser(cfg.path)
    if not os.path.isfile(path):
        raise ValueError(f"task.path={cfg.path!r} does not exist (a JSONL file of "
                         '{"prompt": ..., "label": ...} lines)')
    try:
        read_rows(path)
    except ValueError as e:
        raise ValueError(f"task.path: {e}") from None
    target = str(cfg.reward["_target_"])
    module, _, fn = target.rpartition(".")
    try:
        getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"task.reward._target_={target!r} cannot be imported: {e}") from None
