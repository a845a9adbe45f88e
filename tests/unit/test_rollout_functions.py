"""Rollout functions (``rollout.function``): loading and its errors, the checks on what a
function returns, the single-turn default's samples, and the calculator's multi-turn sample
token by token (tool tokens out of the loss), against a scripted engine pool."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from rl.model import load_tokenizer
from rl.rollout.batch import build_batch, zero_std_groups
from rl.rollout.dump import dump_path, dump_samples
from rl.rollout.functions import RolloutContext, RolloutFunction, Sample, load, score, score_group
from rl.tasks import Prompt
from rl.tasks.build import build_task
from rl.tasks.builtin import CalculatorTask, calculator, calculator_transcript, parse_calculator_transcript
from tests.support.env import compose


class ScriptedPool:
    """Stands in for ``EnginePool``: answers each request with the next scripted answer
    (text, output ids, finish reason) and records the payloads."""

    def __init__(self, answers: list[tuple[str, list[int], dict]], version: str = "3") -> None:
        self.answers = list(answers)
        self.payloads: list[dict] = []
        self.version = version

    async def generate(self, session, payload: dict, timeout_s: float) -> list[dict]:
        self.payloads.append(payload)
        out = []
        for _ in range(payload["sampling_params"].get("n", 1)):
            text, ids, reason = self.answers.pop(0)
            logprobs = [[-0.1 * (k + 1), t, None] for k, t in enumerate(ids)]
            out.append({"text": text, "output_ids": ids,
                        "meta_info": {"finish_reason": reason, "output_token_logprobs": logprobs,
                                      "weight_version": self.version}})
        return out


def _ctx(pool, tokenizer=None, n: int = 1, max_new_tokens: int = 16) -> RolloutContext:
    return RolloutContext(pool=pool, session=None, timeout_s=1.0, tokenizer=tokenizer,
                          sampling_params={"max_new_tokens": max_new_tokens, "temperature": 1.0},
                          n_samples_per_prompt=n)


def test_calculator_sample_masks_the_tool_result_token_by_token(tiny_path):
    _calculator_sample_checked(tiny_path)


def _calculator_sample_checked(tiny_path):
    """``12+34:``: the model calls ``12+34=`` (6 tokens, trained), the environment appends
    ``46 `` (3 tokens: loss mask 0, log-prob 0), the model answers ``46<eos>`` (3 tokens,
    trained); the reward scores the transcript, and the batch carries the mask as is."""
    tok = load_tokenizer(tiny_path)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    pool = ScriptedPool([("12+34", enc("12+34="), {"type": "stop", "matched": "="}),
                         ("46", enc("46") + [eos], {"type": "stop", "matched": eos})])
    prompt = CalculatorTask(seed=0).next_prompts(1)[0]
    prompt = Prompt(text="12+34:", label="12+34", index=prompt.index)
    prompt_ids = enc(prompt.text)
    fn = RolloutFunction("rl.rollout.functions:calculator_tool", n=1, max_prompt_tokens=64,
                         max_new_tokens=16)
    [s] = asyncio.run(fn.group(_ctx(pool, tok), prompt, prompt_ids))

    call, result, answer = enc("12+34="), enc("46 "), enc("46") + [eos]
    assert (len(call), len(result), len(answer)) == (6, 3, 3)
    assert s.prompt_ids == prompt_ids
    assert s.response_ids == call + result + answer
    assert s.loss_mask == [1] * 6 + [0] * 3 + [1] * 3
    for j, (m, lp) in enumerate(zip(s.loss_mask, s.logprobs)):
        assert (lp == 0.0) == (m == 0), (j, m, lp)  # the engine's log-probs on model tokens only
    assert s.logprobs[:6] == pytest.approx([-0.1 * (k + 1) for k in range(6)])
    assert s.logprobs[9:] == pytest.approx([-0.1, -0.2, -0.3])
    assert s.finished and s.text == "12+34=46 46" and len(s.meta_info) == 2  # the transcript
    # the second turn continues the whole context, with the budget that is left and no stop
    first, second = pool.payloads
    assert first["sampling_params"]["stop"] == ["="] and first["input_ids"] == prompt_ids
    assert second["input_ids"] == prompt_ids + call + result
    assert second["sampling_params"]["max_new_tokens"] == 16 - 9
    assert second["sampling_params"]["stop"] == []  # one call (CALCULATOR_MAX_CALLS), then the answer

    task = CalculatorTask()
    batch = build_batch([prompt], [[s]], task.reward, group_size=1, std_norm=True, first_sample_id=0)
    assert batch.loss_mask[0].tolist() == s.loss_mask
    assert batch.rollout_logprobs[0].tolist() == pytest.approx(s.logprobs)
    assert batch.tokens[0].tolist() == prompt_ids + s.response_ids
    assert batch.rewards.tolist() == [1.0] and batch.num_loss_tokens == 9
    assert batch.weight_version.tolist() == [3]
    return tok, prompt, s, batch  # for the dump test


def test_a_dumped_sample_reads_back_as_trained(tiny_path, tmp_path):
    """``rollout.dump_every``'s file: the calculator sample above, its text, ids, mask,
    log-probs and reward as the batch holds them."""
    tok, prompt, s, batch = _calculator_sample_checked(tiny_path)
    path = dump_path(str(tmp_path), 7)
    dump_samples(path, 7, [prompt], [[s]], batch, tok)
    assert path == str(tmp_path / "rollouts" / "step_000007.jsonl")
    [d] = [json.loads(line) for line in open(path)]
    assert (d["step"], d["sample_id"], d["prompt"], d["label"]) == (7, 0, "12+34:", "12+34")
    assert d["response"] == d["scored_text"] == "12+34=46 46"  # the ids decoded; the transcript
    assert (d["reward"], d["finished"], d["weight_version"]) == (1.0, True, 3)
    assert (d["response_ids"], d["loss_mask"]) == (s.response_ids, s.loss_mask)
    assert d["logprobs"] == pytest.approx(s.logprobs) and d["prompt_ids"] == s.prompt_ids
    assert not (tmp_path / "rollouts" / "step_000007.jsonl.tmp").exists()
    # a group algo.drop_zero_std_groups takes out of the loss is dumped with its masks as trained
    flat = build_batch([prompt], [[s, s]], CalculatorTask().reward, group_size=2, std_norm=True,
                       first_sample_id=0)
    assert zero_std_groups(flat, 2, drop=True) == 1
    dump_samples(path, 7, [prompt], [[s, s]], flat, tok)
    assert [json.loads(line)["loss_mask"] for line in open(path)] == [[0] * len(s.response_ids)] * 2


def test_calculator_without_a_call_and_out_of_room(tiny_path):
    tok = load_tokenizer(tiny_path)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    prompt = Prompt(text="1+2:", label="1+2", index=0)
    # no call: one turn, every token trained
    pool = ScriptedPool([("3", enc("3") + [eos], {"type": "stop", "matched": eos})])
    [s] = asyncio.run(RolloutFunction("rl.rollout.functions:calculator_tool", n=1, max_prompt_tokens=64,
                                      max_new_tokens=16).group(_ctx(pool, tok), prompt, enc(prompt.text)))
    assert s.loss_mask == [1, 1] and s.finished and s.text == "3"
    # the tool's result fills the budget: unfinished, nothing to score
    pool = ScriptedPool([("1+2", enc("1+2="), {"type": "stop", "matched": "="})])
    [s] = asyncio.run(RolloutFunction("rl.rollout.functions:calculator_tool", n=1, max_prompt_tokens=64,
                                      max_new_tokens=5).group(_ctx(pool, tok, max_new_tokens=5),
                                                              prompt, enc(prompt.text)))
    assert s.response_ids == enc("1+2=3") and s.loss_mask == [1, 1, 1, 1, 0]
    assert not s.finished and s.text == "1+2=3 "


def test_calculator_tool_and_task():
    assert calculator("12+34") == "46" and calculator(" 7 * 6 ") == "42" and calculator("3-5") == "-2"
    assert calculator("12+") == "error" and calculator("import os") == "error"
    t = CalculatorTask(seed=1)
    [p] = t.next_prompts(1)
    a, b = (int(x) for x in p.text.removesuffix(":").split("+"))
    assert p.label == f"{a}+{b}"  # the call; its result is the answer
    call = calculator_transcript([(f"{a}+{b}", str(a + b))], f" {a + b}")
    assert call == f"{a}+{b}={a + b}  {a + b}"
    assert parse_calculator_transcript(call) == ([(f"{a}+{b}", str(a + b))], f" {a + b}")
    assert t.reward(call, p.label, True) == 1.0
    assert t.reward(call, p.label, False) == 0.0  # no end-of-sequence: nothing
    assert t.reward(str(a + b), p.label, True) == 0.0  # no call: nothing
    # a call the calculator reads: 0.2, and 0.15 for each right operand; the answer's half
    # (right characters against the sum) only when the call's result is the sum
    assert t.reward(calculator_transcript([("12+34", "46")], "46"), "12+35", True) == pytest.approx(0.35)
    assert parse_calculator_transcript("2+3=5 2+4=6 6") == ([("2+3", "5")], "2+4=6 6")  # one call
    assert t.reward("2+3=5 2+4=6 6", "2+3", True) == 0.5
    assert t.reward(calculator_transcript([("2+3", "5")], "51"), "2+3", True) == pytest.approx(0.75)
    # task.copy_credit: copying the result after a sum with one right operand earns it
    copying = CalculatorTask(seed=1, copy_credit=0.25)
    assert copying.reward("2+4=6 6", "2+3", True) == pytest.approx(0.6)
    assert t.reward("2+4=6 6", "2+3", True) == pytest.approx(0.35)  # the default: nothing
    assert copying.reward("2+4=6 5", "2+3", True) == pytest.approx(0.35)  # not the tool's result
    assert copying.reward("2*4=8 8", "2+3", True) == pytest.approx(0.35)  # not a sum: nothing
    assert copying.reward("4+4=8 8", "2+3", True) == pytest.approx(0.2)  # no operand right: nothing
    assert copying.reward("1+3=4 4", "2+3", True) == pytest.approx(0.6)  # the second operand right
    assert copying.reward("9+3=12 13", "2+3", True) == pytest.approx(0.35 + 0.25 * 0.5)  # by character
    assert copying.reward("2+3=5 5", "2+3", True) == 1.0
    # task.copy_credit_fade: the credit only in a group where no call gave the sum
    fading = CalculatorTask(seed=1, copy_credit=0.25, copy_credit_fade=True)
    assert fading.reward("2+4=6 6", "2+3", True) == copying.reward("2+4=6 6", "2+3", True)  # alone
    unsolved = ["2+4=6 6", "1+3=4 4", "2+4=6 5"]
    assert fading.group_reward(unsolved, "2+3", [True] * 3) == pytest.approx([0.6, 0.6, 0.35])
    assert copying.group_reward(unsolved + ["2+3=5 4"], "2+3", [True] * 4) == pytest.approx(
        [0.6, 0.6, 0.35, 0.5])  # without fading: a one-right-operand call above the right one
    assert fading.group_reward(unsolved + ["2+3=5 4"], "2+3", [True] * 4) == pytest.approx(
        [0.35, 0.35, 0.35, 0.5])  # a call gave the sum: no copy credit in this group
    assert fading.group_reward(["3+2=5 5", "2+4=6 6"], "2+3", [True, True]) == pytest.approx(
        [0.7, 0.35])  # operands swapped: the sum all the same
    # a right call in an unfinished sample scores nothing and fades nothing
    assert fading.group_reward(["2+3=5 5", "2+4=6 6"], "2+3", [False, True]) == pytest.approx([0.0, 0.6])
    assert t.group_reward(unsolved, "2+3", [True] * 3) == [t.reward(r, "2+3", True) for r in unsolved]
    # a call it cannot read: a fifth of its right characters
    assert t.reward(calculator_transcript([("1+", "error")], "3"), "1+2", True) == pytest.approx(0.2 * 2 / 3)
    assert parse_calculator_transcript("1+2=error 3") == ([("1+2", "error")], "3")


def test_single_turn_makes_one_request_of_n_and_trains_every_token():
    pool = ScriptedPool([("ab", [5, 6], {"type": "stop", "matched": 1}),
                         ("c", [7], {"type": "length"})])
    prompt = Prompt(text="q", label="ab", index=4)
    samples = asyncio.run(RolloutFunction("rl.rollout.functions:single_turn", n=2, max_prompt_tokens=8,
                                          max_new_tokens=8).group(_ctx(pool, n=2), prompt, [1, 2]))
    [payload] = pool.payloads
    assert payload == {"input_ids": [1, 2], "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "n": 2}}
    assert [s.response_ids for s in samples] == [[5, 6], [7]]
    assert [s.loss_mask for s in samples] == [[1, 1], [1]]
    assert [s.finished for s in samples] == [True, False]
    batch = build_batch([prompt], [samples], lambda r, label, f: float(r == label), group_size=2,
                        std_norm=False, first_sample_id=10)
    assert batch.finish_reason == ["stop", "length"] and batch.rewards.tolist() == [1.0, 0.0]
    assert np.array_equal(batch.sample_id, [10, 11]) and batch.group_id.tolist() == [4, 4]


async def raises(ctx, prompt, prompt_ids):
    raise ValueError("the tool is broken")


def sync_function(ctx, prompt, prompt_ids):
    return []


async def returns_one(ctx, prompt, prompt_ids):
    return [Sample([1], [2, 3], [1, 0], [-0.5, 0.0], True, [{}], "x")]


async def logprob_on_masked(ctx, prompt, prompt_ids):
    return [Sample([1], [2, 3], [1, 0], [-0.5, -0.1], True, [{}], "x")]


async def too_long(ctx, prompt, prompt_ids):
    return [Sample([1], [2] * 9, [1] * 9, [-0.5] * 9, True, [{}], "x")]


async def nan_reward(ctx, prompt, prompt_ids):
    return [Sample([1], [2], [1], [-0.5], True, [{}], "x", reward=float("nan"))]


def test_a_sample_scored_by_its_function_keeps_its_reward():
    """``Sample.reward`` set: the manager's batch and evaluation take it as it is; unset: the
    task's reward scores the text."""
    own = Sample([1], [2], [1], [-0.5], True, [{}], "wrong", reward=np.float32(0.75))  # numpy's too
    plain = Sample([1], [3], [1], [-0.5], True, [{}], "right")
    task_reward = lambda text, label, finished: float(text == label)  # noqa: E731
    prompt = Prompt(text="q", label="right", index=0)
    assert score(own, prompt, task_reward) == 0.75 and score(plain, prompt, task_reward) == 1.0
    batch = build_batch([prompt], [[own, plain]], task_reward, group_size=2, std_norm=False,
                        first_sample_id=0)
    assert batch.rewards.tolist() == [0.75, 1.0]
    assert batch.advantages.tolist() == [-0.125, 0.125]
    # a task's group reward scores each group's samples without their own reward, together, in order
    seen = []

    def group_reward(texts, label, finished):
        seen.append((texts, label, finished))
        return [10.0 * len(seen) + len(t) for t in texts]

    short = Sample([1], [3], [1], [-0.5], False, [{}], "ab")
    other = Prompt(text="q2", label="other", index=1)
    batch = build_batch([prompt, other], [[plain, own, short], [short, plain, short]], task_reward,
                        group_reward=group_reward, group_size=3, std_norm=False, first_sample_id=0)
    assert seen == [(["right", "ab"], "right", [True, False]),
                    (["ab", "right", "ab"], "other", [False, True, False])]
    assert batch.rewards.tolist() == [15.0, 0.75, 12.0, 22.0, 25.0, 22.0]
    assert score_group([own], prompt, task_reward, group_reward) == [0.75] and len(seen) == 2  # not called
    with pytest.raises(ValueError, match=r"gave 1 rewards for the 2 samples of prompt 0 \('q'\)"):
        score_group([plain, short], prompt, task_reward, lambda texts, label, finished: [1.0])


def test_load_names_the_function_when_it_cannot_be_used():
    with pytest.raises(ValueError, match=r"rollout.function='nope.module:f' cannot be imported"):
        load("nope.module:f")
    with pytest.raises(ValueError, match=r"rollout.function='rl.rollout.functions:nope' cannot be imported"):
        load("rl.rollout.functions:nope")
    with pytest.raises(ValueError, match=r"test_rollout_functions:sync_function' must be an 'async def"):
        load("tests.unit.test_rollout_functions:sync_function")
    with pytest.raises(ValueError, match="is a int, not a function"):
        load("rl.rollout.functions:CALCULATOR_MAX_CALLS")
    assert load("rl.rollout.functions:single_turn").__name__ == "single_turn"


@pytest.mark.parametrize("name, fragment", [
    ("raises", r"raised ValueError: the tool is broken"),
    ("returns_one", r"returned 1 items; expected a list of rollout.n_samples_per_prompt=2 Samples"),
])
def test_errors_name_the_function_and_the_prompt(name, fragment):
    fn = RolloutFunction(f"tests.unit.test_rollout_functions:{name}", n=2, max_prompt_tokens=8,
                         max_new_tokens=8)
    prompt = Prompt(text="sum 1 2:", label="3", index=17)
    with pytest.raises(RuntimeError) as e:
        asyncio.run(fn.group(_ctx(None, n=2), prompt, [1]))
    assert (f"rollout.function=tests.unit.test_rollout_functions:{name} on prompt 17 ('sum 1 2:') "
            in str(e.value)), str(e.value)
    assert e.match(fragment)


@pytest.mark.parametrize("name, fragment", [
    ("logprob_on_masked", "a log-prob other than 0.0 on a masked token"),
    ("too_long", "rollout.max_new_tokens=8 bounds the whole response"),
    ("nan_reward", "sample 0 with reward=nan; a finite number, or None for the task's reward"),
])
def test_samples_are_checked(name, fragment):
    fn = RolloutFunction(f"tests.unit.test_rollout_functions:{name}", n=1, max_prompt_tokens=8,
                         max_new_tokens=8)
    with pytest.raises(RuntimeError, match=fragment):
        asyncio.run(fn.group(_ctx(None), Prompt(text="q", label="x", index=0), [1]))


def test_rollout_function_config():
    assert compose().rollout.function == "rl.rollout.functions:single_turn"
    with pytest.raises(ValueError, match="rollout.function='rl.rollout.functions.single_turn': name it "
                                         "as module:callable"):
        compose("rollout.function=rl.rollout.functions.single_turn")
    with pytest.raises(ValueError, match="task=calculator answers through a tool: set rollout.function="):
        compose("task=calculator", "rollout.max_new_tokens=16")
    with pytest.raises(ValueError, match="rollout.max_new_tokens=8 bounds the call"):
        compose("task=calculator", "rollout.function=rl.rollout.functions:calculator_tool")
    cfg = compose("task=calculator", "rollout.function=rl.rollout.functions:calculator_tool",
                  "rollout.max_new_tokens=16")
    assert (cfg.task.name, cfg.task.max_value, cfg.task.copy_credit) == ("calculator", 4, 0.0)
    calc = ("task=calculator", "rollout.function=rl.rollout.functions:calculator_tool",
            "rollout.max_new_tokens=16")
    assert build_task(compose(*calc, "task.copy_credit=0.25").task).copy_credit == 0.25
    for bad in ("0.6", "-0.1"):
        with pytest.raises(ValueError, match=rf"task.copy_credit={bad} must be within \[0, 0.5\]"):
            compose(*calc, f"task.copy_credit={bad}")
    fading = build_task(compose(*calc, "task.copy_credit=0.25", "task.copy_credit_fade=true").task)
    assert (fading.copy_credit, fading.copy_credit_fade) == (0.25, True)
    with pytest.raises(ValueError, match="task.copy_credit_fade=true fades task.copy_credit, which is 0"):
        compose(*calc, "task.copy_credit_fade=true")


def test_calculator_dump_stats_read_calls_operands_and_copied_answers():
    """``calculator_dump_stats`` (the last column of docs/rollout.md's calculator table, via
    scripts/calculator_summary.py, and the e2e learning test's checks): of five dumped samples,
    four call the tool (one without room to answer, one in a group dropped from the loss, its
    loss mask all 0), their operands are right 5 times in 8, of the three finished answers
    one copies the tool's result and two repeat the call's second operand; of the two answers
    after a call that gave the sum one copies it, and two of the three groups hold such a call."""
    from rl.tasks.builtin import calculator_dump_stats

    def sample(label, index, calls, answer, finished=True, dropped=False):
        return {"step": 9, "prompt_index": index, "label": label, "finished": finished,
                "scored_text": calculator_transcript(calls, answer),
                "loss_mask": [0] * 8 if dropped else [1] * 8}

    samples = [sample("3+4", 0, [("3+4", "7")], "7"),
               sample("3+4", 0, [("3+3", "6")], "3"),
               sample("1+2", 1, [("1+2", "3")], "2", dropped=True),
               sample("2+1", 2, [("1", "1")], "", finished=False),
               {"step": 9, "prompt_index": 2, "label": "2+1", "scored_text": "21", "finished": True,
                "loss_mask": [1, 1]}]  # no call
    assert calculator_dump_stats(samples) == {"calls": 0.8, "operands_right": 5 / 8,
                                              "answers_copied": pytest.approx(1 / 3),
                                              "answers_second_operand": pytest.approx(2 / 3),
                                              "sum_answers_copied": 0.5,
                                              "groups_with_sum": pytest.approx(2 / 3)}
