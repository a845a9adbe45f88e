"""The CPU engine's sampling parameters over HTTP, on a running engine: stop strings, ``n``
samples in prompt-major order, fields it does not serve refused by name unless left unset.
The rules themselves, in-process: tests/unit/test_engine_sampling.py."""

from __future__ import annotations

import pytest
import requests

from rl.config import HFRolloutConfig
from rl.rollout.engines.launcher import EngineProcess


# -- over HTTP -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    proc = EngineProcess(0, HFRolloutConfig(engine_start_timeout_s=120), tiny_path, seed=0,
                         log_dir=str(tmp_path_factory.mktemp("logs")), host="127.0.0.1")
    yield proc.start()
    proc.stop()


def _post(url, path, body):
    r = requests.post(url + path, json=body, timeout=60)
    return r.status_code, r.json()


def _sglang_answer(ans: dict):
    from sglang.api.v1.api_types import GenerateResponse  # the pinned wheel, a test dependency

    return GenerateResponse.from_json_value(ans)


def test_stop_string_over_http(server, tiny_path):
    greedy = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    code, base = _post(server, "/generate", {"text": "bb:", "sampling_params": greedy})
    assert code == 200 and len(set(base["text"])) >= 6, base["text"]
    stop = base["text"][3:5]
    code, cut = _post(server, "/generate", {"text": "bb:", "sampling_params": {**greedy, "stop": stop}})
    assert code == 200
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == base["text"][:3] and cut["output_ids"] == base["output_ids"][:5]
    assert _sglang_answer(cut).meta_info.finish_reason.matched == stop


def test_n_samples_come_back_prompt_major(server):
    greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    prompts = [[5, 6], [7, 8, 9]]
    singles = [_post(server, "/generate", {"input_ids": p, "sampling_params": greedy})[1]["output_ids"]
               for p in prompts]
    assert singles[0] != singles[1]
    code, answers = _post(server, "/generate", {"input_ids": prompts,
                                                "sampling_params": {**greedy, "n": 3}})
    assert code == 200
    assert [a["output_ids"] for a in answers] == [singles[0]] * 3 + [singles[1]] * 3
    assert [a["meta_info"]["prompt_tokens"] for a in answers] == [2] * 3 + [3] * 3
    assert len({a["meta_info"]["id"] for a in answers}) == 6
    code, answers = _post(server, "/generate", {"input_ids": prompts[0],
                                                "sampling_params": {"n": 2, "max_new_tokens": 3}})
    assert code == 200 and isinstance(answers, list) and len(answers) == 2


@pytest.mark.parametrize("field, value", [
    ("stream", True), ("image_data", "cat.png"), ("lora_path", "a"), ("rid", "r"),
    ("logprob_start_len", 0), ("top_logprobs_num", 2), ("return_prompt_token_ids", True),
    ("session_params", {"id": "s"}), ("a_future_field", {"x": 1})])
def test_fields_the_engine_does_not_serve_are_refused_by_name(server, field, value):
    code, ans = _post(server, "/generate", {"input_ids": [5], field: value})
    assert code == 400 and f"does not serve {field}; it serves: " in ans["error"]["message"]


def test_unserved_fields_left_unset_are_accepted(server):
    code, ans = _post(server, "/generate", {
        "input_ids": [5], "sampling_params": {"max_new_tokens": 2, "regex": None, "stop_regex": []},
        "stream": False, "return_hidden_states": False, "image_data": None, "rid": None})
    assert code == 200
    _sglang_answer(ans)
