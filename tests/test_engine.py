"""The CPU engine: SGLang protocol answers, log-probs equal a forward pass, weight updates
through the broadcast path land bit for bit, start-up failures are reported with the log."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest
import requests
import torch

from rl.config import HFRolloutConfig
from rl.model import eos_token_ids, load_model, load_tokenizer
from rl.rollout.client import EngineClient
from rl.rollout.engines.hf_engine import GenRequest, HFEngine
from rl.rollout.engines.launcher import EngineProcess
from transfer.weights.broadcast import BroadcastSync


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


def test_generate_answers_in_sglang_shape(server, tiny_path):
    tok = load_tokenizer(tiny_path)
    code, ans = _post(server, "/generate", {"input_ids": tok.encode("c:"), "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0}})
    assert code == 200
    meta = ans["meta_info"]
    assert 1 <= len(ans["output_ids"]) <= 5
    assert meta["completion_tokens"] == len(ans["output_ids"]) and meta["prompt_tokens"] == 2
    assert [x[1] for x in meta["output_token_logprobs"]] == ans["output_ids"]
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert ans["text"] == tok.decode(ans["output_ids"], skip_special_tokens=True)
    # text input, batched
    code, answers = _post(server, "/generate", {"text": ["a:", "b:"],
                                                "sampling_params": {"max_new_tokens": 3}})
    assert code == 200 and isinstance(answers, list) and len(answers) == 2
    assert "output_token_logprobs" not in answers[0]["meta_info"]


def test_bad_generate_requests_are_400(server):
    for body in ({"input_ids": [5], "sampling_params": {"max_tokens": 3}},
                 {"input_ids": [5], "text": "a"}, {"input_ids": [5], "stream": True},
                 {"input_ids": []}):
        code, ans = _post(server, "/generate", body)
        assert code == 400 and ans["error"]["message"]


def test_info_endpoints(server, tiny_path):
    assert requests.get(server + "/health", timeout=5).status_code == 200
    assert requests.get(server + "/health_generate", timeout=30).status_code == 200
    info = requests.get(server + "/get_model_info", timeout=5).json()
    assert info["model_path"] == tiny_path and info["is_generation"]
    assert requests.post(server + "/flush_cache", timeout=5).status_code == 200


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
    assert code == 400 and "retract" in ans["error"]["message"]
    client.pause_generation()
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(_post, server, "/generate", body) for _ in range(2)]
            time.sleep(1.5)
            assert not any(f.done() for f in held)  # held, not failed
            assert client.health()  # the control plane still answers while paused
            client.continue_generation()
            assert all(f.result(timeout=30)[0] == 200 for f in held)
    finally:
        client.continue_generation()

def test_generation_stops_at_first_eos(tiny_path):
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    eos = eos_token_ids(tiny_path, tok)
    engine = HFEngine(model, tok, eos, seed=0)
    # make EOS certain: bias the output layer towards it
    with torch.no_grad():
        model.lm_head.weight[eos[0]] += 50.0
    res = engine.generate([GenRequest(tok.encode("a:"), max_new_tokens=8)])[0]
    assert res.output_ids == [eos[0]] and res.finish_reason == {"type": "stop", "matched": eos[0]}
    res = engine.generate([GenRequest(tok.encode("a:"), max_new_tokens=3, ignore_eos=True)])[0]
    assert len(res.output_ids) == 3 and res.finish_reason["type"] == "length"


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

    def server_command(self, model_path, host, port, index, seed, gpus):
        return [sys.executable, "-c", self.command]


def test_engine_that_crashes_is_reported_with_its_log(tmp_path, tiny_path):
    cfg = _CommandRollout(command="print('loading weights... boom', flush=True); raise SystemExit(3)",
                          engine_start_timeout_s=30)
    proc = EngineProcess(0, cfg, tiny_path, 0, str(tmp_path), "127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        proc.start()
    assert time.monotonic() - t0 < 15
    assert "exited with code 3" in str(e.value) and "boom" in str(e.value)


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
