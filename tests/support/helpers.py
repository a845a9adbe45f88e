"""Reward and rollout functions for tests (importable by workers through ``_target_`` and
``rollout.function``), and how the end-to-end matrices pair data paths with weight paths."""

import asyncio

from rl.rollout.functions import single_turn


def length_reward(response: str, label: str) -> float:
    """Longer finished answers score higher: gives a random model non-zero advantages."""
    return len(response) / 40


WEIGHT_PATHS = ("broadcast", "p2p")


def combination_halves(data_paths) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Every (data path, weight path) pair exactly once, split into two halves that each hold
    every data path and every weight path: the synchronous sync matrix
    (tests/e2e/test_weights.py) runs the first, the train_async.py matrix
    (tests/e2e/test_async.py) the second. The two paths are independent by design;
    running each pair once, in one of the two, keeps every pair end to end without paying for
    each twice."""
    labels = sorted(data_paths)
    first = [(label, WEIGHT_PATHS[i % 2]) for i, label in enumerate(labels)]
    if len(labels) == 1:  # one data path: both halves need both weight paths
        first = [(labels[0], w) for w in WEIGHT_PATHS]
        return first, list(first)
    second = [(label, w) for label in labels for w in WEIGHT_PATHS if (label, w) not in first]
    return first, second


def finished_reward(response: str, label: str) -> float:
    """1 for any answer that ends (unfinished ones score 0 before this is called): a random
    model earns it now and then, and the tiny model learns to stop within a few dozen steps."""
    return 1.0


def eval_task(tmp_path) -> tuple[str, ...]:
    """Overrides for an evaluation test: ``task=jsonl`` over four training prompts and
    ``eval.path`` over six held-out ones, all scored by ``finished_reward`` (so the eval reward
    is the finished fraction); the two files are written under ``tmp_path``."""
    data, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    data.write_text("".join(f'{{"prompt": "{c}:", "label": "x"}}\n' for c in "abcd"))
    held_out.write_text("".join(f'{{"prompt": "{c}{c}:", "label": "x"}}\n' for c in "efghij"))
    return ("task=jsonl", f"task.path={data}", "task.reward._target_=tests.support.helpers.finished_reward",
            f"eval.path={held_out}")


LATE_PROMPT, LATE_UNTIL = 0, 3
_started: set[int] = set()  # prompt indices whose group has started, in the manager's process
_held: list[asyncio.Future] = []  # the late group, waiting for LATE_UNTIL's to start


async def late_first_group(ctx, prompt, prompt_ids):
    """``rollout.function=tests.support.helpers:late_first_group``: ``single_turn``, except that
    prompt ``LATE_PROMPT``'s group, answered at once by the weights it started under, finishes
    only when prompt ``LATE_UNTIL``'s group starts (so, as a rule, before that one finishes): a
    group overtaken by later ones, which fully async admission cannot bound
    (rl/rollout/stream.py)."""
    _started.add(prompt.index)
    if prompt.index == LATE_UNTIL:
        for held in _held:
            if not held.done():
                held.set_result(None)  # wakes the late group at once, not at a poll's next tick
    samples = await single_turn(ctx, prompt, prompt_ids)
    if prompt.index == LATE_PROMPT and LATE_UNTIL not in _started:
        held = asyncio.get_running_loop().create_future()
        _held.append(held)
        await held
    return samples
