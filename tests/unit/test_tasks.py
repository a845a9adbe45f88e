"""Built-in tasks and JSONL prompts: deterministic, resumable, graded rewards."""

from __future__ import annotations

import json

import pytest

from rl.tasks.builtin import AdditionTask, RepeatCountTask, RepeatLetterTask
from rl.tasks.jsonl import JsonlTask, read_rows
from rl.tasks.rewards import exact_match, math_answer
from tests.support.env import compose


def test_repeat_letter_rewards():
    t = RepeatLetterTask(repeat=4)
    assert t.reward("cccc", "cccc", finished=True) == 1.0
    assert t.reward("cccc", "cccc", finished=False) == 0.0  # no EOS -> no credit
    assert t.reward("cc", "cccc", finished=True) == 0.5
    assert t.reward("ccccxx", "cccc", finished=True) == pytest.approx(4 / 6)
    assert t.reward("", "cccc", finished=True) == 0.0


def test_addition_rewards_per_digit():
    t = AdditionTask()
    assert t.reward("46", "46", True) == 1.0
    assert t.reward("56", "46", True) == 0.5
    assert t.reward("146", "46", True) == pytest.approx(2 / 3)
    assert t.reward("46", "46", False) == 0.0


@pytest.mark.parametrize("cls", [RepeatLetterTask, RepeatCountTask, AdditionTask])
def test_stream_is_deterministic_and_resumable(cls):
    a, b = cls(seed=3), cls(seed=3)
    first = a.next_prompts(5) + a.next_prompts(5)
    b.load_state_dict({"position": 5})
    assert b.next_prompts(5) == first[5:]
    assert [p.index for p in first] == list(range(10))
    assert cls(seed=4).next_prompts(10) != first


def test_repeat_letter_prompt_shape():
    p = RepeatLetterTask(repeat=3).next_prompts(1)[0]
    assert p.text.endswith(":") and p.label == p.text[0] * 3


def test_repeat_count_rewards():
    t = RepeatCountTask()
    assert t.reward("ccccccc", "ccccccc", finished=True) == 1.0
    assert t.reward("ccccccc", "ccccccc", finished=False) == 0.0  # no EOS -> no credit
    assert t.reward("ccc", "ccccccc", finished=True) == pytest.approx(3 / 7)  # stopped early
    assert t.reward("cccccccccc", "ccccccc", finished=True) == pytest.approx(7 / 10)  # too long
    assert t.reward("cxc", "ccc", finished=True) == pytest.approx(2 / 3)
    assert t.reward("", "c", finished=True) == 0.0


def test_repeat_count_prompts_name_letter_and_length_and_lengths_vary():
    t = RepeatCountTask(min_repeat=3, max_repeat=40, seed=1)
    prompts = t.next_prompts(300)
    lengths = []
    for p in prompts:
        letter, count = p.text[0], int(p.text[1:-1])
        assert p.text == f"{letter}{count}:" and letter.isalpha()
        assert p.label == letter * count
        lengths.append(count)
    assert min(lengths) == 3 and max(lengths) == 40  # both ends are drawn
    assert len(set(lengths)) > 30  # uneven lengths, not a few fixed ones
    assert [len(p.label) for p in RepeatCountTask(min_repeat=5, max_repeat=5).next_prompts(3)] == [5] * 3


def test_repeat_count_answers_are_one_tiny_model_token_per_letter(tiny_path):
    """The tiny model's tokenizer spells prompt and answer one token per character, so an
    answer of n letters is n tokens (plus EOS): from 1 to task.max_repeat + 1 tokens."""
    from rl.model import load_tokenizer

    tok = load_tokenizer(tiny_path)
    for p in RepeatCountTask(max_repeat=100).next_prompts(20):
        assert len(tok(p.text, add_special_tokens=False)["input_ids"]) == len(p.text)
        ids = tok(p.label, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(p.label) and tok.unk_token_id not in ids
        assert tok.decode(ids) == p.label


def test_repeat_count_needs_room_for_its_longest_answer():
    """The longest answer plus EOS must fit in rollout.max_new_tokens, checked when the config
    loads, with the fix in the message."""
    with pytest.raises(ValueError) as e:
        compose("task=repeat_count")  # rollout.max_new_tokens is 8 by default
    assert ("task.max_repeat=40 letters plus the end-of-sequence token; rollout.max_new_tokens=8 is "
            "too short: set rollout.max_new_tokens=41") in str(e.value)
    cfg = compose("task=repeat_count", "task.max_repeat=7")
    assert (cfg.task.name, cfg.task.min_repeat, cfg.task.max_repeat) == ("repeat_count", 1, 7)
    assert compose("task=repeat_count", "rollout.max_new_tokens=41").task.max_repeat == 40
    with pytest.raises(ValueError, match="task.max_repeat=2 is below task.min_repeat=3"):
        compose("task=repeat_count", "task.min_repeat=3", "task.max_repeat=2")
    with pytest.raises(ValueError, match="task.min_repeat=0 must be > 0"):
        compose("task=repeat_count", "task.min_repeat=0")


def test_repeat_count_is_built_from_its_config():
    from rl.config.task import RepeatCountTaskConfig
    from rl.tasks.build import build_task

    task = build_task(RepeatCountTaskConfig(min_repeat=2, max_repeat=9, seed=5))
    assert isinstance(task, RepeatCountTask)
    assert task.next_prompts(4) == RepeatCountTask(min_repeat=2, max_repeat=9, seed=5).next_prompts(4)


def test_jsonl_task(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": f"q{i}", "label": str(i)} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    t = JsonlTask(str(path), {"_target_": "rl.tasks.rewards.exact_match"}, seed=0)
    epoch = t.next_prompts(4)
    assert sorted(p.text for p in epoch) == [f"q{i}" for i in range(4)]  # each once per epoch
    assert t.reward(" 2 ", "2", True) == 1.0 and t.reward("2", "2", False) == 0.0
    state = t.state_dict()
    nxt = t.next_prompts(3)
    t2 = JsonlTask(str(path), {"_target_": "rl.tasks.rewards.exact_match"}, seed=0)
    t2.load_state_dict(state)
    assert t2.next_prompts(3) == nxt


def test_jsonl_bad_line_is_located(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        JsonlTask(str(path), {"_target_": "rl.tasks.rewards.exact_match"})


@pytest.mark.parametrize("content,fragment", [
    (b'{"prompt": "a:", "label": "aaaa"}\n{"prompt": "b:", "label": "bbbb"\n',
     "bad.jsonl:2: not valid JSON"),
    (b'\n{"label": "x"}\n', "bad.jsonl:2: missing 'prompt'"),
    (b'{"prompt": "a:"}\n', "bad.jsonl:1: missing 'label'"),
    (b'["a:", "aaaa"]\n', "bad.jsonl:1: expected a JSON object"),
    (b'{"prompt": ["a:"], "label": "aaaa"}\n', "bad.jsonl:1: 'prompt' must be a string, got list"),
    (b'{"prompt": "", "label": "aaaa"}\n', "bad.jsonl:1: 'prompt' is empty"),
    (b'{"prompt": "a:", "label": null}\n', "bad.jsonl:1: 'label' must be a string or a number"),
    (b'{"prompt": "a:", "label": "x"}\n{"prompt": "\xff", "label": "x"}\n', "bad.jsonl:2: not UTF-8"),
    (b"", "bad.jsonl holds no prompts"),
    (b"\n  \n", "bad.jsonl holds no prompts"),
])
def test_jsonl_errors_name_file_line_and_fault(tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_rows(str(path))
    assert fragment in str(e.value)


def test_jsonl_number_labels_become_text(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "label": 2}\n{"prompt": "x", "label": 0.5}\n')
    assert read_rows(str(path)) == [("1+1=", "2"), ("x", "0.5")]


def test_reward_kwargs_and_math():
    assert exact_match("x", "x") == 1.0
    assert math_answer("so the answer is 1,234.", "#### 1234") == 1.0
    assert math_answer("no number", "5") == 0.0


def test_check_task_reads_the_file_and_imports_the_reward_before_anything_starts(tmp_path):
    """The config holds values only; ``check_task`` (run by the driver before Ray starts)
    finds a missing file, a bad line and a reward function that cannot be imported."""
    from rl.config.task import JsonlTaskConfig, RepeatLetterTaskConfig
    from rl.tasks.build import check_task

    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a:", "label": "aaaa"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a:"}\n')
    check_task(JsonlTaskConfig(path=str(good)))
    check_task(RepeatLetterTaskConfig())
    for cfg, fragment in [
        (JsonlTaskConfig(path=str(tmp_path / "none.jsonl")), "does not exist"),
        (JsonlTaskConfig(path=str(bad)), "bad.jsonl:1: missing 'label'"),
        (JsonlTaskConfig(path=str(good), reward={"_target_": "rl.tasks.rewards.nope"}), "cannot be imported"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            check_task(cfg)


@pytest.mark.parametrize("overrides", [
    ("task=repeat_letter", "task.repeat=3"), ("task=repeat_count", "rollout.max_new_tokens=41"),
    ("task=addition", "task.max_value=499"),
    ("task=calculator", "task.max_value=12", "rollout.function=rl.rollout.functions:calculator_tool",
     "rollout.max_new_tokens=16")])
def test_max_label_bytes_bounds_every_label_of_a_built_in_task(overrides):
    """The stores' capacity estimate counts labels at ``max_label_bytes``: reached, not passed."""
    from rl.tasks.build import build_task, max_label_bytes

    cfg = compose(*overrides)
    labels = [p.label.encode() for p in build_task(cfg.task).next_prompts(3000)]
    assert max(map(len, labels)) == max_label_bytes(cfg.task)


def test_max_label_bytes_of_a_jsonl_task_is_its_longest_label(tmp_path):
    from rl.config.task import JsonlTaskConfig
    from rl.tasks.build import build_task, max_label_bytes

    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "q", "label": x}) for x in ("1", "ü" * 5, "abc")))
    cfg = JsonlTaskConfig(path=str(path))
    assert max_label_bytes(cfg) == 10
    task = build_task(cfg)  # the rollout manager's: the rows it read, not the file again
    path.write_text(json.dumps({"prompt": "q", "label": "x"}))
    assert (max_label_bytes(cfg, task), max_label_bytes(cfg)) == (10, 1)


def test_a_label_longer_than_the_bound_is_warned_of_once_per_length(caplog):
    from rl.rollout.batch import check_label_bytes

    assert check_label_bytes(["ab", "ü"], 2, "jsonl") == 2 and not caplog.records
    with caplog.at_level("WARNING", logger="rl.rollout.batch"):
        assert check_label_bytes(["abc", "üü"], 2, "mine") == 4
        assert check_label_bytes(["abcd"], 4, "mine") == 4
    [record] = caplog.records
    assert "a label of 4 bytes is longer than task=mine's max_label_bytes (2)" in record.getMessage()
