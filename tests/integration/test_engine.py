"""The CPU engine: SGLang protocol answers, one 400 for bad input, log-probs equal a forward
pass, weight updates through the broadcast path land bit for bit, a sync while requests are
retracted splits their answers between two versions, start-up failures are reported with
the log."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import requests
import torch

from rl.config import HFRolloutConfig
from rl.model import load_model, load_tokenizer
from rl.rollout.client import EngineClient
from rl.rollout.engines.commands import COMMANDS
from rl.rollout.engines.launcher import EngineProcess
from tests.support.procs import wait_until
from transfer.net import free_port
from transfer.weights.broadcast import BroadcastSync
from transfer.weights.group import init_side_group


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    proc = EngineProcess(0, HFRolloutConfig(engine_start_timeout_s=120), tiny_path, seed=0,
                         log_dir=str(tmp_path_factory.mktemp("logs")), host="127.0.0.1")
    url = proc.start()
    yield url
    proc.stop()
    assert not proc.alive()


def _post(url, path, body):
    r = requests.post(url + path, json=body, timeout=60)
    return r.status_code, r.json()


def _post_raw(url, path, data: bytes):
    r = requests.post(url + path, data=data, headers={"Content-Type": "application/json"},
                      timeout=60)
    return r.status_code, r.json()


def _sglang_answer(ans: dict):
    """The answer decoded with SGLang's own response type (raises on a contract violation)."""
    from sglang.api.v1.api_types import GenerateResponse  # the pinned wheel, a test dependency

    return GenerateResponse.from_json_value(ans)


def _until(check, timeout_s: float = 10.0) -> None:
    assert wait_until(check, timeout_s, every_s=0.005), "condition not met in time"


def test_generate_answers_in_sglang_shape(server, tiny_path):
    from sglang.api.v1.api_types import FinishLength, FinishStop

    tok = load_tokenizer(tiny_path)
    code, ans = _post(server, "/generate", {"input_ids": tok.encode("c:"), "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0}})
    assert code == 200
    meta = ans["meta_info"]
    assert 1 <= len(ans["output_ids"]) <= 5
    assert meta["completion_tokens"] == len(ans["output_ids"]) and meta["prompt_tokens"] == 2
    assert meta["id"] and meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    assert meta["weight_version"] == requests.get(server + "/model_info", timeout=5).json()["weight_version"]
    assert [x[1] for x in meta["output_token_logprobs"]] == ans["output_ids"]
    assert all(x[2] is None for x in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert ans["text"] == tok.decode(ans["output_ids"], skip_special_tokens=True)
    decoded = _sglang_answer(ans)
    assert decoded.output_ids == ans["output_ids"]
    assert [e.token_id for e in decoded.meta_info.output_token_logprobs] == ans["output_ids"]
    assert isinstance(decoded.meta_info.finish_reason, (FinishStop, FinishLength))
    # text input, batched; log-probs with their token text
    code, answers = _post(server, "/generate", {"text": ["a:", "b:"], "return_logprob": True,
                                                "return_text_in_logprobs": True,
                                                "sampling_params": {"max_new_tokens": 3}})
    assert code == 200 and isinstance(answers, list) and len(answers) == 2
    assert len({a["meta_info"]["id"] for a in answers}) == 2
    for a in answers:
        assert [x[2] for x in a["meta_info"]["output_token_logprobs"]] == \
            [tok.decode([t]) for t in a["output_ids"]]
        _sglang_answer(a)
    code, ans = _post(server, "/generate", {"text": "a:", "sampling_params": {"max_new_tokens": 2}})
    assert code == 200 and "output_token_logprobs" not in ans["meta_info"]


def _refusal(ans: dict) -> str:
    """The message of the engine's one refusal of bad input, ``{"error": {"message": ...}}``."""
    assert set(ans) == {"error"} and set(ans["error"]) == {"message"}, ans
    return ans["error"]["message"]


SERVES = "; it serves: "
BAD_GENERATE = [
    (b"{not json", "not valid JSON"),
    (b"[" * 100_000, "not valid JSON"),
    (b'{"input_ids": [5], "text": "\xff"}', "not valid JSON"),
    (b"[1, 2]", "the request body: expected a JSON object"),
    (b"", "exactly one of input_ids and text"),
    ({"input_ids": "abc"}, "input_ids: expected a list"),
    ({"input_ids": [1.5]}, "input_ids[0]: expected an integer"),
    ({"input_ids": [5, -1]}, "input_ids: token ids must be in [0, 49)"),
    ({"input_ids": [[5], [6, 49]]}, "input_ids: token ids must be in [0, 49)"),
    ({"input_ids": [[5], []]}, "input_ids: a prompt cannot be empty"),
    ({"input_ids": []}, "input_ids: a prompt cannot be empty"),
    ({"text": ""}, "text: a prompt cannot be empty"),
    ({"text": []}, "text: a prompt cannot be empty"),
    ({"text": 5}, "text: expected a string"),
    ({"input_ids": [5], "text": "a"}, "exactly one of input_ids and text"),
    ({"input_ids": [5], "sampling_params": {"max_tokens": 3}}, "does not serve sampling_params.max_tokens"),
    ({"input_ids": [5], "sampling_params": "hot"}, "sampling_params: expected a JSON object"),
    ({"input_ids": [5], "sampling_params": {"temperature": -1}}, "temperature must be >= 0"),
    ({"input_ids": [5], "sampling_params": {"regex": "a+"}}, "does not serve sampling_params.regex"),
    ({"input_ids": [5], "return_logprob": "yes"}, "return_logprob: expected a boolean"),
    ({"input_ids": [5] * 120, "sampling_params": {"max_new_tokens": 16}}, "context length of 128"),
    ({"input_ids": [5] * 128}, "context length of 128 tokens"),
    ({"input_ids": [5], "rid": "x"}, "does not serve rid" + SERVES),
    ({"input_ids": [5], "stream": True}, "does not serve stream" + SERVES),
]


def test_bad_input_is_one_400_naming_the_problem_and_the_engine_stays_healthy(server):
    for body, names in BAD_GENERATE:
        code, ans = (_post_raw(server, "/generate", body) if isinstance(body, bytes)
                     else _post(server, "/generate", body))
        assert code == 400 and names in _refusal(ans), (body, ans)
    for path, body, names in [
        ("/update_weights_from_distributed", b"[]", "expected a JSON object"),
        ("/init_weights_update_group", b"{}", "master_address is required"),
        ("/init_weights_update_group", b'{"master_address": 1, "master_port": 1, "rank_offset": 1,'
                                       b' "world_size": 2}', "master_address: expected a string"),
        ("/pause_generation", b"{", "not valid JSON"),
        ("/pause_generation", b'{"mode": 3}', "mode: expected a string"),
        ("/pause_generation", b'{"mode": "abort"}', "retract"),
        ("/pause_generation", b"{}", "retract"),  # SGLang's default mode, abort
        ("/continue_generation", b"", "needs a JSON body"),  # FastAPI requires SGLang's
        ("/continue_generation", b'{"now": true}', "does not serve now"),
        ("/get_weights_by_name", b'{"name": "nope"}', "Get parameter by name failed"),
        ("/update_weights_from_distributed", b'{"names": ["a"], "dtypes": ["float32"], '
                                             b'"shapes": [["x"]]}', "shapes[0][0]: expected an integer"),
        ("/update_weights_from_distributed",
         b'{"names": [], "dtypes": [], "shapes": [], "abort_all_requests": true}',
         "does not serve abort_all_requests"),
        ("/weights_checker", b'{"action": "checksum", "allow_quant_error": true}', "allow_quant_error"),
    ]:
        code, ans = _post_raw(server, path, body)
        assert code == 400 and names in _refusal(ans), (path, ans)
    r = requests.post(server + "/flush_cache?timeout=5", timeout=5)
    assert r.status_code == 400 and "query parameters" in _refusal(r.json())
    assert requests.get(server + "/start_profile", timeout=5).status_code == 404  # not served
    assert requests.put(server + "/generate", json={"input_ids": [5]}, timeout=5).status_code == 405
    assert requests.get(server + "/health_generate", timeout=30).status_code == 200
    code, ans = _post(server, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert code == 200 and ans["meta_info"]["completion_tokens"] >= 1


def test_info_endpoints(server, tiny_path):
    assert requests.get(server + "/health", timeout=5).status_code == 200
    assert requests.get(server + "/health_generate", timeout=30).status_code == 200
    info = requests.get(server + "/model_info", timeout=5).json()
    assert info["model_path"] == tiny_path and info["is_generation"]
    assert info["weight_version"] == "default" and info["architectures"] == ["Qwen2ForCausalLM"]
    assert requests.get(server + "/get_model_info", timeout=5).json() == info  # deprecated alias
    server_info = requests.get(server + "/server_info", timeout=5).json()
    assert server_info["model_path"] == tiny_path and server_info["context_length"] == 128
    assert {"running_requests", "weight_update_session", "requests_seen"} <= \
        set(server_info["internal_states"][0])  # read by the fault-tolerance tests
    assert requests.get(server + "/get_weight_version", timeout=5).status_code == 404  # gone in 0.5.21


def test_flush_cache_is_refused_while_requests_run_or_wait(server):
    """SGLang's rule, ``is_fully_idle(ignore_waiting=paused)``: refused while a request runs
    or waits; paused in ``retract`` mode waiting requests do not count, paused ``in_place``
    they do."""
    from concurrent.futures import ThreadPoolExecutor

    client = EngineClient(server, "engine-0")
    flush = lambda: requests.post(server + "/flush_cache", timeout=5)  # noqa: E731
    assert flush().status_code == 200
    long = {"input_ids": [[5, 6]] * 32, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
    short = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(_post, server, "/generate", long)
        _until(lambda: (r := flush()).status_code == 400 and "Flush cache failed" in r.text)
        assert running.result(timeout=60)[0] == 200
        assert flush().status_code == 200
        try:
            client.pause_generation("in_place")
            held = pool.submit(_post, server, "/generate", short)
            _until(lambda: flush().status_code == 400)  # in place: the held request counts
            client.pause_generation("retract")
            assert flush().status_code == 200  # retract: it does not
            assert not held.done()
        finally:
            client.continue_generation()
        assert held.result(timeout=30)[0] == 200
    assert flush().status_code == 200


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_a_forward_pass(server, tiny_path, temperature):
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    client = EngineClient(server, "engine-0")
    prompts = [tok.encode(t) for t in ("a:", "bb:", "xyz:")]
    # concurrent requests of different lengths share one left-padded batch in the engine
    code, answers = _post(server, "/generate", {
        "input_ids": prompts, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": temperature}})
    assert code == 200
    for prompt, ans in zip(prompts, answers):
        ids = torch.tensor([prompt + ans["output_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        t = temperature if temperature > 0 else 1.0
        want = torch.log_softmax(logits / t, -1).gather(
            -1, torch.tensor(ans["output_ids"])[:, None]).squeeze(-1)
        got = torch.tensor([x[0] for x in ans["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        if temperature == 0.0:  # greedy: every token is the argmax
            assert ans["output_ids"] == logits.argmax(-1).tolist()[:len(ans["output_ids"])]
    assert client.get_weight_version() == "default"


def test_pause_holds_requests_and_continue_answers_them(server):
    """While paused no request is answered (so weights can be swapped under no forward
    pass); continue answers the held ones; SGLang's default ``abort`` mode is refused."""
    from concurrent.futures import ThreadPoolExecutor

    client = EngineClient(server, "engine-0")
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    code, ans = _post(server, "/pause_generation", {"mode": "abort"})
    assert code == 400 and "retract" in _refusal(ans)
    assert _post(server, "/pause_generation", {"mode": "retract"})[0] == 200
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(_post, server, "/generate", body) for _ in range(2)]
            time.sleep(1.5)
            assert not any(f.done() for f in held)  # held, not failed
            assert client.health()  # the control plane still answers while paused
            assert _post(server, "/continue_generation", {})[0] == 200
            assert all(f.result(timeout=30)[0] == 200 for f in held)
    finally:
        client.continue_generation()


def test_broadcast_weight_update_is_bit_exact(server, tiny_path):
    """This process plays learner rank 0: push new weights, read them back over HTTP."""
    model = load_model(tiny_path)
    torch.manual_seed(123)
    new = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    client = EngineClient(server, "engine-0")
    sync = BroadcastSync(rank=0, master_address="127.0.0.1", bucket_bytes=64 << 10,
                         backend="gloo", timeout_s=60)
    sync.connect([client])
    try:
        # outside a session the engine refuses at once, without joining the broadcast ...
        name = "model.norm.weight"
        code, ans = _post(server, "/update_weights_from_distributed", {
            "names": [name], "dtypes": ["float32"], "shapes": [[64]],
            "group_name": sync.group_name, "weight_version": "x"})
        assert (code, ans) == (400, {"success": False, "message": OUTSIDE_SESSION})
        # ... so the group stays in step for the real push
        metrics = sync.push(new.items(), version=7)
        assert metrics["weights/bytes"] == sum(t.numel() * 4 for t in new.values())
        assert client.get_weight_version() == "7"
        for name, t in new.items():
            got = np.asarray(client.get_weights_by_name(name), dtype=np.float32)
            np.testing.assert_array_equal(got, t.numpy())
    finally:
        sync.close()
    # the group is gone on both sides: a second connect works
    sync.connect([client])
    sync.close()


OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() "
                   "and end_weight_update()")


def test_a_sync_while_retracted_splits_answers_between_versions(server, tiny_path):
    """As the fully async loop syncs: greedy requests run, ``/pause_generation`` retract, a
    whole push of visibly different weights (version 11), ``/continue_generation``. Every
    answer's spans cover its tokens in order; an answer the pause caught part-way (two
    spans, one retraction) holds the old weights' greedy tokens and log-probs before the
    sync, the new weights' (recomputed over the whole sequence) after it, and counts as the
    old version in a batch."""
    from concurrent.futures import ThreadPoolExecutor

    from rl.rollout.batch import is_partial, sample_weight_version
    from rl.rollout.functions import Sample

    old_model = load_model(tiny_path)
    new_model = load_model(tiny_path)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    client = EngineClient(server, "engine-0")
    sync = BroadcastSync(rank=0, master_address="127.0.0.1", bucket_bytes=1 << 20,
                         backend="gloo", timeout_s=60)
    sync.connect([client])
    prompts = [[5 + i % 7, 6 + i % 5] for i in range(32)]
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 100, "temperature": 0.0, "ignore_eos": True}}
    running = lambda: requests.get(server + "/server_info", timeout=5).json()[  # noqa: E731
        "internal_states"][0]["running_requests"]
    try:
        sync.push(old_model.named_parameters(), version=10)
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(_post, server, "/generate", body)
            _until(lambda: running() > 0)
            time.sleep(0.02)  # a few of the 100 steps (about 3 ms each here), not all of them
            client.pause_generation("retract")
            try:
                sync.push(new_model.named_parameters(), version=11)
            finally:
                client.continue_generation()
            code, answers = sent.result(timeout=120)
    finally:
        sync.close()
    assert code == 200
    straddling = 0
    for prompt, ans in zip(prompts, answers):
        meta, out = ans["meta_info"], ans["output_ids"]
        spans = meta["weight_versions"]
        assert [(s["start"], s["end"]) for s in spans] == \
            list(zip([0] + [s["end"] for s in spans[:-1]], [s["end"] for s in spans]))
        assert spans[-1]["end"] == len(out) == 100 and meta["weight_version"] == spans[-1]["version"]
        if [s["version"] for s in spans] != ["10", "11"]:
            assert [s["version"] for s in spans] == ["10"]  # done before the pause caught it
            assert not is_partial(Sample.from_answer(prompt, ans))
            continue
        straddling += 1
        k = spans[0]["end"]
        assert [(w.version, w.start, w.end) for w in _sglang_answer(ans).meta_info.weight_versions] == \
            [("10", 0, k), ("11", k, 100)]
        assert meta["num_retractions"] == 1 and sample_weight_version(meta) == 10
        assert is_partial(Sample.from_answer(prompt, ans))  # counted in rollout/partial_frac
        got = torch.tensor([x[0] for x in meta["output_token_logprobs"]])
        for model, part in ((old_model, slice(0, k)), (new_model, slice(k, None))):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
            want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
            assert out[part] == logits.argmax(-1).tolist()[part]
            torch.testing.assert_close(got[part], want[part], atol=2e-5, rtol=1e-5)
    assert straddling > 0, "the pause caught no request part-way"



def test_weight_update_sessions_follow_sglang(server):
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
              "group_name": "nobody"}
    ok = (200, {"success": True, "message": "Success"})
    assert _post(server, "/update_weights_from_distributed", update) == \
        (400, {"success": False, "message": OUTSIDE_SESSION})
    assert _post(server, "/end_weight_update", {}) == (400, {
        "success": False, "message": "no weight-update session is open; call begin_weight_update() first"})
    assert _post(server, "/begin_weight_update", {}) == ok
    try:
        assert _post(server, "/begin_weight_update", {}) == (400, {
            "success": False,
            "message": "a weight-update session is already open; call end_weight_update() first"})
        code, ans = _post(server, "/update_weights_from_distributed", update)  # no such group
        assert code == 400 and not ans["success"] and "Group nobody not in" in ans["message"]
    finally:
        assert _post(server, "/end_weight_update", {}) == ok
    assert _post(server, "/end_weight_update", {})[0] == 400


@contextmanager
def _side_group(server, name: str = "test-group"):
    """This process as rank 0 of a weight-update group with the engine."""
    from concurrent.futures import ThreadPoolExecutor

    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(_post, server, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": name, "backend": "gloo"})
        group = init_side_group(backend="gloo", master_address="127.0.0.1", master_port=port,
                                rank=0, world_size=2, group_name=name, timeout_s=30)
        assert joined.result(timeout=30) == (200, {
            "success": True, "message": "Succeeded to initialize custom process group."})
    try:
        yield group
    finally:
        assert _post(server, "/destroy_weights_update_group", {"group_name": name})[0] == 200
        group.destroy()


def _push(server, group, name: str, tensor: torch.Tensor, version: str, flush: bool):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_post, server, "/update_weights_from_distributed", {
            "names": [name], "dtypes": ["float32"], "shapes": [list(tensor.shape)],
            "group_name": group.name, "weight_version": version, "flush_cache": flush})
        group.broadcast(tensor, src=0)
        return answer.result(timeout=30)


def test_update_flushes_unless_requests_are_in_flight(server):
    """Inside a session the weights load and the version is recorded; then, with
    ``flush_cache``, a refused flush (paused in place with a request held) fails the call,
    while paused ``retract`` it succeeds."""
    from concurrent.futures import ThreadPoolExecutor

    client = EngineClient(server, "engine-0")
    name = "model.norm.weight"
    old = torch.tensor(client.get_weights_by_name(name), dtype=torch.float32)
    new = torch.full((64,), 0.5)
    with _side_group(server) as group, ThreadPoolExecutor(1) as pool:
        assert _post(server, "/begin_weight_update", {})[0] == 200
        try:
            client.pause_generation("in_place")
            held = pool.submit(_post, server, "/generate",
                               {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
            _until(lambda: requests.post(server + "/flush_cache", timeout=5).status_code == 400)
            code, ans = _push(server, group, name, new, "in-place", flush=True)
            assert code == 400 and not ans["success"] and "not flushed" in ans["message"]
            assert client.get_weights_by_name(name) == new.tolist()  # loaded all the same
            assert client.get_weight_version() == "in-place"
            assert _push(server, group, name, new, "no-flush", flush=False)[0] == 200
            client.pause_generation("retract")
            assert _push(server, group, name, old, "retract", flush=True) == (200, {
                "success": True, "message": "Succeeded to update parameter online."})
            assert client.get_weights_by_name(name) == old.tolist()
            assert client.get_weight_version() == "retract"
        finally:
            client.continue_generation()
            _post(server, "/end_weight_update", {})
        assert held.result(timeout=30)[0] == 200


def test_update_with_unknown_name_fails_and_names_it(server, tiny_path):
    client = EngineClient(server, "engine-0")
    sync = BroadcastSync(rank=0, master_address="127.0.0.1", bucket_bytes=1 << 20,
                         backend="gloo", timeout_s=30)
    sync.connect([client])
    try:
        with pytest.raises(RuntimeError, match="no.such.weight"):
            sync.push([("no.such.weight", torch.zeros(3))], version=8)
    finally:
        sync.close()


@dataclass(kw_only=True)
class _CommandRollout(HFRolloutConfig):
    command: str = ""


@pytest.fixture
def command_kind(monkeypatch):
    """Registers ``_CommandRollout``'s command (its ``command`` field, run by Python) for
    the duration of a test."""
    monkeypatch.setitem(COMMANDS, _CommandRollout,
                        lambda cfg, *args, **kwargs: [sys.executable, "-c", cfg.command])


@pytest.mark.usefixtures("command_kind")
def test_engine_that_crashes_is_reported_with_its_log(tmp_path, tiny_path):
    cfg = _CommandRollout(command="print('loading weights... boom', flush=True); raise SystemExit(3)",
                          engine_start_timeout_s=30)
    proc = EngineProcess(0, cfg, tiny_path, 0, str(tmp_path), "127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        proc.start()
    assert time.monotonic() - t0 < 15
    assert "exited with code 3" in str(e.value) and "boom" in str(e.value)


@pytest.mark.usefixtures("command_kind")
def test_engine_that_hangs_times_out_with_its_log(tmp_path, tiny_path):
    cfg = _CommandRollout(command="import time; print('stuck in init', flush=True); time.sleep(600)",
                          engine_start_timeout_s=3)
    proc = EngineProcess(0, cfg, tiny_path, 0, str(tmp_path), "127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        proc.start()
    assert time.monotonic() - t0 < 15
    assert "did not answer /health within 3s" in str(e.value) and "stuck in init" in str(e.value)
    assert not proc.alive()  # the hung process was stopped
