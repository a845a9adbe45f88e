"""Reward and rollout functions for tests (importable by workers through ``_target_`` and
``rollout.function``), and how the end-to-end matrices pair data paths with weight paths."""

import asyncio

from rl.rollout.functions import calculator_tool, single_turn
from rl.tasks.builtin import calculator, calculator_transcript


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


LATE_PROMPT, LATE_AFTER, LATE_S = 0, 2, 30.0
OLD_PROMPT = 4
_finished: set[int] = set()  # prompts whose group has finished, in the manager's process


async def late_and_old_groups(ctx, prompt, prompt_ids):
    """``rollout.function=tests.support.helpers:late_and_old_groups``: ``single_turn``, except
    that prompt ``LATE_PROMPT``'s group, answered at once, finishes only after prompt
    ``LATE_AFTER``'s group (admitted a version later) has finished, or after ``LATE_S``
    seconds; and prompt ``OLD_PROMPT``'s group reports the first weights (version 0) for its
    answers, as a function returning cached answers would: the first is what fully async
    batch formation waits for, the second what only the safety net can catch
    (rl/rollout/stream.py)."""
    samples = await single_turn(ctx, prompt, prompt_ids)
    if prompt.index == LATE_PROMPT:
        loop = asyncio.get_running_loop()
        until = loop.time() + LATE_S
        while LATE_AFTER not in _finished and loop.time() < until:
            await asyncio.sleep(0.02)
    if prompt.index == OLD_PROMPT:
        for s in samples:
            for meta in s.meta_info:
                meta.pop("weight_versions", None)
                meta["weight_version"] = "0"
    _finished.add(prompt.index)
    return samples


async def calculator_with_a_right_call(ctx, prompt, prompt_ids):
    """``rollout.function=tests.support.helpers:calculator_with_a_right_call``: ``calculator_tool``,
    except that each group's scored texts are set: the first sample's to the right call and
    answer, the others' to a call with one operand wrong and its result copied (the tokens stay
    as sampled). Under ``task.copy_credit_fade`` the right call takes the copy credit off the
    others, which a manager scoring each sample alone would not (0.35 against 0.6 at 0.25)."""
    samples = await calculator_tool(ctx, prompt, prompt_ids)
    a, b = prompt.label.split("+")
    right = calculator(prompt.label)
    wrong = f"{a}+{int(b) + 1}"
    for i, s in enumerate(samples):
        s.finished = True
        s.text = (calculator_transcript([(prompt.label, right)], right) if i == 0
                  else calculator_transcript([(wrong, calculator(wrong))], calculator(wrong)))
    return samples

