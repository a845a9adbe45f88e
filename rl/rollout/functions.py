"""Rollout functions: how one prompt group becomes its samples (``rollout.function``).

A rollout function is an ``async def f(ctx, prompt, prompt_ids) -> list[Sample]`` named by
``module:callable``. The rollout manager calls it once per prompt group, in both the
step-by-step path (``manager.generate``) and the fully async stream, with

* ``ctx``: a ``RolloutContext``: ``await ctx.generate(input_ids, sampling_params)`` sends one
  SGLang ``/generate`` request to the least-loaded live engine (retried on another engine when
  one dies) and returns its answers, one per ``sampling_params["n"]``; ``ctx.tokenizer``,
  ``ctx.sampling_params`` (the rollout's), ``ctx.n_samples_per_prompt``;
* ``prompt``: the task's ``Prompt`` (text, label, index) and ``prompt_ids``, its token ids as
  encoded for the engines;

and it returns ``n_samples_per_prompt`` ``Sample``s: prompt ids, response ids (model and
environment tokens interleaved), a per-token loss mask (1 = model token, trained; 0 =
environment token), the engine's log-probs (0 where masked), whether it finished, the
SGLang ``meta_info`` of each model turn, and the text the task's reward scores (or the
sample's own reward, ``Sample.reward``). The manager checks each sample and scores it with the
task's reward unless the function did (a whole group at once for a task with a group reward:
``score_group``); an error raised inside the function
names it and the prompt. Nothing downstream changes: the learner trains the tokens whose
loss mask is 1. Writing one: docs/rollout.md.

Built in: ``single_turn`` (the default: one request of ``n`` samples per prompt) and
``calculator_tool`` (multi-turn tool use, for ``task=calculator``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from rl.rollout.client import EngineError
from rl.tasks import GroupReward, Prompt
from rl.tasks.builtin import (CALCULATOR_CALL_END, CALCULATOR_MAX_CALLS, CALCULATOR_RESULT_END, calculator,
                              calculator_transcript)


@dataclass
class Sample:
    """One answer of a group, as a rollout function returns it."""

    prompt_ids: list[int]
    """The prompt's token ids (usually the ``prompt_ids`` the function was given)."""
    response_ids: list[int]
    """Everything after the prompt, exactly as sampled or appended: model turns and
    environment tokens (tool results) interleaved."""
    loss_mask: list[int]
    """Per response token: 1 = a model token (trained), 0 = an environment token (not)."""
    logprobs: list[float]
    """Per response token: the engine's log-prob of a model token; 0.0 where masked."""
    finished: bool
    """The sample ended by itself (a stop: end-of-sequence), not by running out of tokens."""
    meta_info: list[dict]
    """The SGLang ``meta_info`` of each model turn (its weight versions make the sample's,
    the oldest: ``rl.rollout.batch.sample_weight_version``)."""
    text: str
    """What the task's reward scores (e.g. the final answer's text)."""
    reward: float | None = None
    """The sample's reward, when the function scored it itself (e.g. an environment's own
    verdict: tests passed, the game won); ``None``: the task's reward scores ``text``."""

    @classmethod
    def from_answer(cls, prompt_ids: list[int], answer: dict) -> Sample:
        """A single-turn sample from one SGLang ``/generate`` answer (every token trained)."""
        meta = answer["meta_info"]
        out_ids = list(answer["output_ids"])
        lp = [float(x[0]) for x in meta["output_token_logprobs"]]
        if len(lp) != len(out_ids):
            raise RuntimeError(f"engine returned {len(lp)} log-probs for {len(out_ids)} tokens")
        return cls(prompt_ids=prompt_ids, response_ids=out_ids, loss_mask=[1] * len(out_ids),
                   logprobs=lp, finished=finished(answer), meta_info=[meta], text=answer["text"])


def score(sample: Sample, prompt: Prompt, reward: Callable[[str, str, bool], float]) -> float:
    """A sample's reward: its own (``Sample.reward``), else the task's
    ``reward(text, label, finished)``."""
    if sample.reward is not None:
        return float(sample.reward)
    return float(reward(sample.text, prompt.label, sample.finished))


def score_group(samples: list[Sample], prompt: Prompt, reward: Callable[[str, str, bool], float],
                group_reward: GroupReward | None = None) -> list[float]:
    """The rewards of one prompt's samples: each sample's own (``Sample.reward``), else the
    task's: ``group_reward(texts, label, finished)`` over the samples without their own, for a
    task whose reward compares a group's samples (``group_reward`` in ``rl.tasks``), else
    ``reward`` one by one."""
    todo = [s for s in samples if s.reward is None]
    if group_reward is None or not todo:
        return [score(s, prompt, reward) for s in samples]
    got = list(group_reward([s.text for s in todo], prompt.label, [s.finished for s in todo]))
    if len(got) != len(todo):
        raise ValueError(f"the task's group_reward gave {len(got)} rewards for the {len(todo)} samples of "
                         f"prompt {prompt.index} ({prompt.text!r}) it scored: one a sample")
    it = iter(got)
    return [float(s.reward) if s.reward is not None else float(next(it)) for s in samples]


def _finite(x) -> bool:
    """A number (Python, numpy or a one-element tensor) that is finite."""
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def finished(answer: dict) -> bool:
    """Whether an SGLang answer stopped by itself (EOS, a stop token or a stop string)."""
    return answer["meta_info"]["finish_reason"]["type"] == "stop"


@dataclass
class RolloutContext:
    """What a rollout function may use: the engines, the tokenizer, the rollout's settings."""

    pool: Any
    """The manager's ``EnginePool`` (use ``generate``)."""
    session: Any
    """The aiohttp session requests go through."""
    timeout_s: float
    """Bound on one request (``rollout.request_timeout_s``)."""
    tokenizer: Any
    """The model's tokenizer (Hugging Face)."""
    sampling_params: dict = field(default_factory=dict)
    """The rollout's ``sampling_params`` (SGLang's names: max_new_tokens, temperature ...)."""
    n_samples_per_prompt: int = 1
    """Samples the function must return for its prompt."""

    async def generate(self, input_ids: list[int], sampling_params: dict) -> list[dict]:
        """One ``/generate`` request with log-probs; its answers, one per
        ``sampling_params["n"]`` (default 1), each ``{"text", "output_ids", "meta_info"}``."""
        payload = {"input_ids": list(input_ids), "sampling_params": sampling_params,
                   "return_logprob": True}
        return await self.pool.generate(self.session, payload, self.timeout_s)


# -- built-in rollout functions -----------------------------------------------------------
async def single_turn(ctx: RolloutContext, prompt: Prompt, prompt_ids: list[int]) -> list[Sample]:
    """One request of ``n`` samples (SGLang's ``sampling_params.n``); each answer is a sample."""
    answers = await ctx.generate(prompt_ids, {**ctx.sampling_params, "n": ctx.n_samples_per_prompt})
    return [Sample.from_answer(prompt_ids, a) for a in answers]


async def calculator_tool(ctx: RolloutContext, prompt: Prompt, prompt_ids: list[int]) -> list[Sample]:
    """Multi-turn tool use (``task=calculator``): the model writes a call, text ending in
    ``=`` (a stop string), e.g. ``12+34=``; the environment appends the tool's result and a space
    (``46 ``,
    loss mask 0); the model goes on, and its last turn is the answer. The
    reward scores the transcript, calls and answer (``calculator_transcript``: ``12+34=46 46``).
    ``rollout.max_new_tokens`` bounds the whole response (model and tool tokens); a sample out
    of room is unfinished. The ``n`` samples run concurrently."""
    return list(await asyncio.gather(*(_calculator_sample(ctx, prompt_ids)
                                       for _ in range(ctx.n_samples_per_prompt))))


async def _calculator_sample(ctx: RolloutContext, prompt_ids: list[int]) -> Sample:
    budget = int(ctx.sampling_params["max_new_tokens"])
    ids, mask, logps, metas = [], [], [], []
    calls: list[tuple[str, str]] = []  # (expression, the tool's result)
    while True:
        stop = [CALCULATOR_CALL_END] if len(calls) < CALCULATOR_MAX_CALLS else []
        params = {**ctx.sampling_params, "n": 1, "max_new_tokens": budget - len(ids), "stop": stop}
        [answer] = await ctx.generate(prompt_ids + ids, params)
        turn = Sample.from_answer(prompt_ids, answer)
        ids += turn.response_ids
        mask += turn.loss_mask
        logps += turn.logprobs
        metas.append(answer["meta_info"])
        called = answer["meta_info"]["finish_reason"].get("matched") == CALCULATOR_CALL_END
        if not called:
            return Sample(prompt_ids, ids, mask, logps, turn.finished, metas,
                          calculator_transcript(calls, turn.text))
        calls.append((turn.text, calculator(turn.text)))
        result = ctx.tokenizer.encode(calls[-1][1] + CALCULATOR_RESULT_END, add_special_tokens=False)
        result = result[:budget - len(ids)]
        ids += result
        mask += [0] * len(result)
        logps += [0.0] * len(result)
        if len(ids) >= budget:  # no room left for an answer
            return Sample(prompt_ids, ids, mask, logps, False, metas, calculator_transcript(calls, ""))


# -- loading and calling ------------------------------------------------------------------
def load(path: str) -> Callable[..., Awaitable[list[Sample]]]:
    """The rollout function ``path`` (``module:callable``) names; a ``ValueError`` naming it
    when it cannot be imported or is not an ``async`` callable."""
    module, _, name = path.partition(":")
    where = f"rollout.function={path!r}"
    try:
        fn: Any = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{where} cannot be imported: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{where} is a {type(fn).__name__}, not a function")
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)):
        raise ValueError(f"{where} must be an 'async def f(ctx, prompt, prompt_ids) -> list[Sample]' "
                         f"(docs/rollout.md)")
    return fn


class RolloutFunction:
    """``rollout.function``, loaded once, called per group with its errors and results
    checked: an error names the function and the prompt; engine errors pass through as they
    are (the manager and the fleet act on them)."""

    def __init__(self, path: str, *, n: int, max_prompt_tokens: int, max_new_tokens: int) -> None:
        self.path = path
        self.fn = load(path)
        self.n, self.max_prompt_tokens, self.max_new_tokens = n, max_prompt_tokens, max_new_tokens

    async def group(self, ctx: RolloutContext, prompt: Prompt, prompt_ids: list[int]) -> list[Sample]:
        try:
            samples = await self.fn(ctx, prompt, list(prompt_ids))
        except EngineError:
            raise
        except Exception as e:
            raise RuntimeError(f"{self._where(prompt)} raised {type(e).__name__}: {e}") from e
        problem = self._check(samples)
        if problem:
            raise RuntimeError(f"{self._where(prompt)} returned {problem}")
        return samples

    def _where(self, prompt: Prompt) -> str:
        return f"rollout.function={self.path} on prompt {prompt.index} ({prompt.text!r})"

    def _check(self, samples) -> str | None:
        """What is wrong with a group's samples, if anything."""
        if not isinstance(samples, (list, tuple)) or len(samples) != self.n:
            got = f"{len(samples)} items" if isinstance(samples, (list, tuple)) else type(samples).__name__
            return f"{got}; expected a list of rollout.n_samples_per_prompt={self.n} Samples"
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                return f"a {type(s).__name__} as sample {i}; expected rl.rollout.functions.Sample"
            r = len(s.response_ids)
            if len(s.loss_mask) != r or len(s.logprobs) != r:
                return (f"sample {i} with {r} response tokens, {len(s.loss_mask)} loss-mask values "
                        f"and {len(s.logprobs)} log-probs; each needs one per response token")
            if not 0 < len(s.prompt_ids) <= self.max_prompt_tokens:
                return (f"sample {i} with a prompt of {len(s.prompt_ids)} tokens; 1 to "
                        f"rollout.max_prompt_tokens={self.max_prompt_tokens} expected")
            if r > self.max_new_tokens:
                return (f"sample {i} with {r} response tokens: rollout.max_new_tokens="
                        f"{self.max_new_tokens} bounds the whole response (model and environment tokens)")
            if any(m not in (0, 1) for m in s.loss_mask):
                return f"sample {i} with a loss mask other than 0 and 1"
            if any(lp != 0.0 for m, lp in zip(s.loss_mask, s.logprobs) if m == 0):
                return f"sample {i} with a log-prob other than 0.0 on a masked token"
            if s.reward is not None and not _finite(s.reward):
                return f"sample {i} with reward={s.reward!r}; a finite number, or None for the task's reward"
            if not s.meta_info:
                return f"sample {i} without meta_info (one SGLang meta_info per model turn)"
        return None
