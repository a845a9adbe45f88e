"""The step's batch, from the samples to the learners' partitions (pure functions).

``build_batch`` turns the rollout function's samples (``rl.rollout.functions``) into a
``RolloutBatch``: tokens, loss masks and log-probs exactly as sampled, rewards, GRPO
advantages (``grpo_advantages``), and each sample's weight version, the oldest it saw
(``sample_weight_version``; ``is_partial``, ``partial_frac``: tokens from more than one);
``zero_std_groups`` counts (and may mask) the groups without a learning signal;
``split_balanced`` splits the batch over the learner ranks; ``encode_prompt`` turns a
prompt's text into the token ids the engines get; ``check_label_bytes`` warns of a label
longer than the stores' capacity check counted on.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from rl.rollout.functions import Sample, score_group
from rl.tasks import GroupReward, Prompt, TurnRewards
from rl.types import RolloutBatch
from transfer.data.base import Ragged

logger = logging.getLogger(__name__)


def grpo_advantages(rewards: np.ndarray, group_size: int, std_norm: bool = True,
                    eps: float = 1e-6) -> np.ndarray:
    """(r - mean of its group) / (std of its group + eps); groups are consecutive runs of
    ``group_size`` samples. A group whose rewards are all equal gets zero advantage."""
    r_gn = rewards.reshape(-1, group_size).astype(np.float64)
    adv_gn = r_gn - r_gn.mean(axis=1, keepdims=True)
    if std_norm:
        adv_gn = adv_gn / (r_gn.std(axis=1, keepdims=True) + eps)  # population std
    return adv_gn.reshape(-1).astype(np.float32)


def model_turns(loss_mask: list[int]) -> list[tuple[int, int]]:
    """The model turns of a response: its runs of trained tokens (loss mask 1), as
    ``(start, end)`` positions; the environment's tokens (mask 0) sit between them."""
    turns, start = [], None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            turns.append((start, i))
            start = None
    return turns


def turn_advantages(rewards: list[list[float]], std_norm: bool = True, eps: float = 1e-6) -> list[np.ndarray]:
    """Per sample of one group, per model turn, its tokens' advantage: the turn's reward
    (``rewards[i][k]``) centred, and scaled by the std, over the group's samples that have a
    turn ``k`` (as ``grpo_advantages`` does over the group). A turn is judged by its own reward
    only, none of the later turns': a task's turn rewards say what each turn itself did. With
    one turn a sample it is GRPO's."""
    own = [np.zeros(len(r)) for r in rewards]
    for k in range(max((len(r) for r in rewards), default=0)):
        have = [i for i, r in enumerate(rewards) if len(r) > k]
        x = np.array([rewards[i][k] for i in have], dtype=np.float64)
        if x.max() == x.min():  # a flat turn: exactly 0 (x - mean can leave rounding)
            continue
        adv = x - x.mean()
        if std_norm:
            adv = adv / (x.std() + eps)
        for i, a in zip(have, adv):
            own[i][k] = a
    return own


def zero_std_groups(batch: RolloutBatch, group_size: int, drop: bool) -> int:
    """Count the groups whose rewards are all equal (zero advantage: no policy gradient; with
    ``algo.turn_credit``, the groups whose every token's advantage is 0);
    with ``drop``, take their samples out of the loss. Masked rather than removed, so that
    every learner rank still gets a partition of the same size, as FSDP requires; a step
    whose every group is dropped is stored, removed and logged like any other, and the
    learners skip its optimizer steps."""
    if batch.token_advantages is None:
        r_gn = batch.rewards.reshape(-1, group_size)
        flat_g = (r_gn == r_gn[:, :1]).all(axis=1)
    else:
        flat_n = np.array([not np.any(a) for a in batch.token_advantages], dtype=bool)
        flat_g = flat_n.reshape(-1, group_size).all(axis=1)
    if drop and flat_g.any():
        batch.loss_mask = batch.loss_mask.with_zeroed(np.repeat(flat_g, group_size))
    return int(flat_g.sum())


def split_balanced(lengths: np.ndarray, parts: int) -> list[list[int]]:
    """Indices split into ``parts`` lists of equal size (len divisible by parts), balancing
    the summed lengths: longest first, each to the lightest part that still has room."""
    n = len(lengths)
    assert n % parts == 0, (n, parts)
    cap = n // parts
    out: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(n), key=lambda i: -int(lengths[i])):
        p = min((p for p in range(parts) if len(out[p]) < cap), key=load.__getitem__)
        out[p].append(i)
        load[p] += int(lengths[i])
    return [sorted(o) for o in out]


def build_batch(prompts: list[Prompt], groups: list[list[Sample]],
                reward: Callable[[str, str, bool], float], *, group_size: int, std_norm: bool,
                first_sample_id: int, group_reward: GroupReward | None = None,
                turn_rewards: TurnRewards | None = None) -> RolloutBatch:
    """The training batch of one step: each prompt's samples (from the rollout function,
    grouped by prompt), scored by ``reward(text, label, finished)`` unless a sample carries its
    own (``Sample.reward``; with ``group_reward``, the task's reward of a whole group:
    ``score_group``), with GRPO advantages over each group of ``group_size`` (with
    ``turn_rewards``, per-token ones as well: ``turn_advantages``) and sample ids counted from
    ``first_sample_id``."""
    # Ragged fields are built flat: every sample's ids, mask and log-probs appended to one
    # list, made one array each at the end (no per-sample arrays).
    tokens, mask, logps, plen, rlen, rewards = [], [], [], [], [], []
    group_ids, reasons, labels, versions = [], [], [], []
    token_adv: list[np.ndarray] | None = None if turn_rewards is None else []
    for prompt, group in zip(prompts, groups):
        rewards += score_group(group, prompt, reward, group_reward)
        if token_adv is not None:
            token_adv += _token_advantages(group, prompt, turn_rewards, std_norm)
        for s in group:
            tokens += s.prompt_ids
            tokens += s.response_ids  # exactly as sampled (and appended)
            mask += s.loss_mask
            logps += s.logprobs
            plen.append(len(s.prompt_ids))
            rlen.append(len(s.response_ids))
            group_ids.append(prompt.index)
            reasons.append("stop" if s.finished else "length")
            labels.append(prompt.label)
            versions.append(min(sample_weight_version(meta) for meta in s.meta_info))
    n = len(plen)
    plen_np, rlen_np = np.asarray(plen, dtype=np.int32), np.asarray(rlen, dtype=np.int32)
    rewards_np = np.asarray(rewards, dtype=np.float32)
    return RolloutBatch(
        tokens=Ragged.from_lengths(np.asarray(tokens, dtype=np.int32), plen_np + rlen_np),
        loss_mask=Ragged.from_lengths(np.asarray(mask, dtype=np.int8), rlen_np),
        rollout_logprobs=Ragged.from_lengths(np.asarray(logps, dtype=np.float32), rlen_np),
        prompt_len=plen_np, response_len=rlen_np,
        rewards=rewards_np, advantages=grpo_advantages(rewards_np, group_size, std_norm),
        group_id=np.asarray(group_ids, dtype=np.int64),
        sample_id=np.arange(first_sample_id, first_sample_id + n, dtype=np.int64),
        weight_version=np.asarray(versions, dtype=np.int64),
        finish_reason=reasons, label=labels,
        token_advantages=None if token_adv is None else Ragged.from_lengths(
            np.concatenate(token_adv).astype(np.float32) if token_adv else np.zeros(0, np.float32), rlen_np))


def _token_advantages(group: list[Sample], prompt: Prompt, turn_rewards: TurnRewards,
                      std_norm: bool) -> list[np.ndarray]:
    """Each sample's per-token advantage under ``algo.turn_credit``: its model turns
    (``model_turns``) scored by the task's ``turn_rewards`` (a sample with its own reward:
    that reward on its last turn), ``turn_advantages`` over the group, 0 on the environment's
    tokens."""
    turns = [model_turns(s.loss_mask) for s in group]
    rewards = []
    for s, t in zip(group, turns):
        if s.reward is not None:
            r = [0.0] * (len(t) - 1) + [float(s.reward)] if t else []
        else:
            r = [float(x) for x in turn_rewards(s.text, prompt.label, s.finished, len(t))]
        if len(r) != len(t):
            raise ValueError(f"the task's turn_rewards gave {len(r)} rewards for a sample of {len(t)} "
                             f"model turn(s) of prompt {prompt.index} ({prompt.text!r}): one a turn")
        rewards.append(r)
    out = []
    for s, t, adv in zip(group, turns, turn_advantages(rewards, std_norm)):
        a = np.zeros(len(s.loss_mask), dtype=np.float32)
        for (start, end), v in zip(t, adv):
            a[start:end] = v
        out.append(a)
    return out


def answer_weight_versions(meta: dict) -> list[int]:
    """The weight versions an answer's output tokens were generated with, in token order (-1:
    an engine not yet synced).

    SGLang (0.5.23, ``utils/weight_versions.py``) sets ``meta_info.weight_version`` to the
    newest version a request saw, and lists every version with the output tokens it
    produced in ``meta_info.weight_versions`` (``{version, start, end}`` spans, one per
    version, in token order; a version under which the request produced no visible token has
    no span). Servers without the spans (older releases) give the one ``weight_version``."""
    spans = meta.get("weight_versions")
    if spans:
        return [_version_number(span["version"]) for span in spans]
    return [_version_number(meta.get("weight_version"))]


def sample_weight_version(meta: dict) -> int:
    """The oldest weight version an answer was generated with (``answer_weight_versions``). A
    request begun under v and finished under v + 1 (a sync while it was retracted or paused
    in place) counts as v: staleness is bounded by the oldest tokens a sample holds."""
    return min(answer_weight_versions(meta))


def is_partial(sample: Sample) -> bool:
    """Whether a sample's tokens come from more than one weight version: a request that a sync
    interrupted and that finished under the new weights (a partial rollout), or a multi-turn
    sample whose turns were answered under different versions. A server without the spans
    reports a request's newest version only, so there only the second kind is seen."""
    return len({v for meta in sample.meta_info for v in answer_weight_versions(meta)}) > 1


def partial_frac(groups: list[list[Sample]]) -> float:
    """``rollout/partial_frac``: the share of the samples that are partial (``is_partial``)."""
    flags = [is_partial(s) for group in groups for s in group]
    return sum(flags) / len(flags) if flags else 0.0


def _version_number(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1  # engine not yet synced ("default")


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    """The token ids of one prompt, as a single user turn of the chat template if asked.

    The template is rendered to text and then encoded without special tokens, which is what
    ``apply_chat_template(tokenize=True)`` does inside (the template writes BOS and the like
    itself) but with one return type on every transformers version: ``tokenize=True``
    returns ``list[int]`` on transformers 4 and a ``BatchEncoding`` on 5, whose ``list()``
    is its keys."""
    if chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def check_label_bytes(labels: list[str], bound: int, task: str) -> int:
    """Warns when a batch's label is longer than ``bound``, the task's ``max_label_bytes``
    that the stores' capacity check counted on (a store that fills up fails a put), and
    returns the bound raised to the longest label seen, so that it warns once per new length."""
    longest = max((len(label.encode("utf-8")) for label in labels), default=0)
    if longest <= bound:
        return bound
    logger.warning("a label of %d bytes is longer than task=%s's max_label_bytes (%d), which the stores' "
                   "capacity check counted on: a full store fails a put; override max_label_bytes in "
                   "the task's config (rl/config/task.py)", longest, task, bound)
    return longest
