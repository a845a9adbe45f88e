"""Partial rollouts on the CPU engine: a weight update lands between two decode steps of a
request, as SGLang 0.5.23's ``/pause_generation`` modes make it land.

The real engine and its real scheduler, in this process: the scheduler's batch stops at
its tenth step boundary until the test has paused it, so the pause lands after exactly ten
tokens; new weights go through the engine's own update path (session, version, load), with
a stand-in for the group's transport. The references are the model run directly: the old
and the new weights, one full forward each. The spans are checked against SGLang's own span
code, imported from the pinned wheel (``sglang/srt/utils/weight_versions.py``).
"""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rl.model import eos_token_ids, load_model, load_tokenizer
from rl.rollout.batch import build_batch, is_partial, partial_frac
from rl.rollout.functions import Sample
from rl.rollout.engines import hf_engine
from rl.rollout.engines.hf_engine import GenRequest, HFEngine
from rl.rollout.engines.protocol import Generate, answer
from rl.tasks import Prompt
from tests.support import sglang_release as sgl
from tests.support.schedulers import Gated

PAUSE_AT = 10
"""Tokens each running request holds when the pause lands."""
LONG, SHORT = 30, 5


@pytest.fixture(scope="module")
def wv():
    sgl.check_pinned()
    from sglang.srt.utils import weight_versions

    return weight_versions


@pytest.fixture(scope="module")
def models(tiny_path):
    """The tiny model's weights (version 1) and visibly different ones (version 2)."""
    old = load_model(tiny_path)
    new = load_model(tiny_path)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return old, new


class Wire:
    """Stands in for the weight-update group's transport: each broadcast the engine joins
    receives the next tensor."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._next = iter(tensors)

    def broadcast(self, buf: torch.Tensor, src: int = 0) -> None:
        buf.copy_(next(self._next))


def _push(engine: HFEngine, model, version: str) -> None:
    """``model``'s weights through the engine's update path, as one session of one bucket."""
    weights = {n: p.detach() for n, p in model.named_parameters()}
    engine.groups["wire"] = Wire(list(weights.values()))
    engine.begin_weight_update()
    try:
        engine.update_weights_from_distributed(
            list(weights), ["float32"] * len(weights), [list(t.shape) for t in weights.values()],
            "wire", weight_version=version)
    finally:
        engine.end_weight_update()
        del engine.groups["wire"]


def _run(engine: HFEngine, mode: str, prompt: list[int], new_model):
    """A long and a short request run together; the pause (``mode``) lands after
    ``PAUSE_AT`` tokens, the weights of ``new_model`` are pushed as version 2, a third
    request arrives while paused; then continue. -> the three results."""
    scheduler = Gated(engine, max_batch_size=8, batch_wait_s=0.05, at=PAUSE_AT)
    greedy = dict(temperature=0.0, ignore_eos=True)
    reqs = [GenRequest(prompt, max_new_tokens=LONG, **greedy),
            GenRequest(prompt, max_new_tokens=SHORT, **greedy)]

    async def scenario():
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(scheduler.submit(reqs))
        assert await loop.run_in_executor(None, scheduler.reached.wait, 30)
        pausing = loop.run_in_executor(None, scheduler.pause, mode)
        while scheduler.paused_mode is None:
            await asyncio.sleep(0.001)
        scheduler.go.set()
        await pausing  # no forward pass runs from here until resume
        assert not first.done()
        if mode == "retract":  # the long request waits, with its output; a flush may run
            assert (scheduler.running(), scheduler.waiting(), scheduler.idle()) == (0, 1, True)
        else:  # it stays on the model (the short one has finished and left the batch)
            assert scheduler.running() == 1 and not scheduler.idle()
        later = asyncio.ensure_future(scheduler.submit([GenRequest(prompt, max_new_tokens=8, **greedy)]))
        await loop.run_in_executor(None, _push, engine, new_model, "2")
        scheduler.resume()
        return [*await first, *await later]

    return asyncio.run(scenario())


def _logprobs(model, prompt: list[int], out: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of ``out``'s tokens, argmax at each of their positions) under ``model``,
    one full forward over prompt + out."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, torch.tensor(out)[:, None]).squeeze(-1), logits.argmax(-1)


def _meta(res, tok) -> dict:
    g = Generate(reqs=[GenRequest(input_ids=[1, 2])], single=True, return_logprob=True)
    return answer(g, 0, res, 0.0, tok)["meta_info"]


def _sglang_meta(wv, n: int, synced_at: int | None, old: str, new: str) -> dict:
    """The ``weight_versions`` and ``weight_version`` SGLang 0.5.23 writes for a request of
    ``n`` output tokens whose version changed from ``old`` to ``new`` when it held
    ``synced_at`` of them (None: no change while it ran)."""
    req = SimpleNamespace(output_ids=[0] * (synced_at or 0), weight_version_events=[])
    if synced_at is not None:
        wv.record_weight_version_events([req], old_version=old)  # the scheduler, at the update
    meta: dict = {}
    spans = wv.compute_weight_version_spans(req.weight_version_events,
                                            current_version=new if synced_at is not None else old,
                                            num_output_tokens=n)
    wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=n)
    return meta


def _engine(tiny_path) -> tuple[HFEngine, object]:
    tok = load_tokenizer(tiny_path)
    return HFEngine(load_model(tiny_path), tok, eos_token_ids(tiny_path, tok), weight_version="1"), tok


def _check_spans_and_old_part(wv, metas, results, prompt, old_model) -> None:
    """What both modes share: the long answer's two spans (SGLang's), its tokens before the
    sync greedy under the old weights with their log-probs, and one span for the others."""
    long, short, _ = results
    assert [len(r.output_ids) for r in results] == [LONG, SHORT, 8]
    assert metas[0]["weight_versions"] == [{"version": "1", "start": 0, "end": PAUSE_AT},
                                           {"version": "2", "start": PAUSE_AT, "end": LONG}]
    for meta, (n, synced_at, old) in zip(metas, [(LONG, PAUSE_AT, "1"), (SHORT, None, "1"),
                                                 (8, None, "2")]):
        want = _sglang_meta(wv, n, synced_at, old, "2")
        assert (meta["weight_versions"], meta["weight_version"]) == \
            (want["weight_versions"], want["weight_version"])
    assert metas[0]["weight_version"] == "2"  # the newest, as SGLang's field
    old_lp, old_argmax = _logprobs(old_model, prompt, long.output_ids)
    assert long.output_ids[:PAUSE_AT] == old_argmax[:PAUSE_AT].tolist()
    torch.testing.assert_close(torch.tensor(long.logprobs[:PAUSE_AT]), old_lp[:PAUSE_AT],
                               atol=2e-5, rtol=1e-5)
    # ... and the tokens after it are not the old weights' (the weights differ visibly)
    assert not torch.allclose(torch.tensor(long.logprobs[PAUSE_AT:]), old_lp[PAUSE_AT:], atol=1e-3)
    short_lp, short_argmax = _logprobs(old_model, prompt, short.output_ids)
    assert short.output_ids == short_argmax.tolist()
    torch.testing.assert_close(torch.tensor(short.logprobs), short_lp, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("selectable", [True, False], ids=["rows-leave", "rows-kept"])
def test_retract_resumes_a_request_under_the_new_weights(tiny_path, models, wv, selectable,
                                                          monkeypatch):
    """Retracted after 10 tokens, the request keeps them (and their old log-probs), is
    recomputed under version 2 at continue, and its 20 later tokens are version 2's greedy
    choices with version 2's log-probs over the whole sequence. Its spans are SGLang's; the
    batch counts it as version 1, and keeps one engine log-prob per token. The same where
    finished requests' rows stay in the batch (a cache that cannot drop rows): only the
    unfinished request counts a retraction."""
    monkeypatch.setattr(hf_engine, "_rows_selectable", lambda cache: selectable)
    old_model, new_model = models
    engine, tok = _engine(tiny_path)
    prompt = tok.encode("ab:")
    results = _run(engine, "retract", prompt, new_model)
    metas = [_meta(r, tok) for r in results]
    _check_spans_and_old_part(wv, metas, results, prompt, old_model)
    long, _, later = results
    assert [m["num_retractions"] for m in metas] == [1, 0, 0]
    new_lp, new_argmax = _logprobs(new_model, prompt, long.output_ids)
    assert long.output_ids[PAUSE_AT:] == new_argmax[PAUSE_AT:].tolist()
    torch.testing.assert_close(torch.tensor(long.logprobs[PAUSE_AT:]), new_lp[PAUSE_AT:],
                               atol=2e-5, rtol=1e-5)
    later_lp, later_argmax = _logprobs(new_model, prompt, later.output_ids)
    assert later.output_ids == later_argmax.tolist()
    torch.testing.assert_close(torch.tensor(later.logprobs), later_lp, atol=2e-5, rtol=1e-5)

    answers = [[{"text": r.text, "output_ids": r.output_ids, "meta_info": m}
                for r, m in zip(results, metas)]]
    samples = [[Sample.from_answer(prompt, a) for a in answers[0]]]
    batch = build_batch([Prompt(text="ab:", label="x", index=0)], samples,
                        lambda text, label, finished: 0.0, group_size=3, std_norm=True,
                        first_sample_id=0)
    np.testing.assert_array_equal(batch.weight_version, [1, 1, 2])  # the oldest version seen
    np.testing.assert_array_equal(batch.rollout_logprobs[0], np.float32(long.logprobs))
    # the retracted request is the group's one partial rollout (rollout/partial_frac)
    assert [is_partial(s) for s in samples[0]] == [True, False, False]
    assert partial_frac(samples) == pytest.approx(1 / 3)


def test_in_place_decodes_on_with_the_new_weights_over_the_old_kv_cache(tiny_path, models, wv):
    """Paused in place after 10 tokens, the batch keeps its KV cache (computed by version 1)
    and decodes on with version 2: each later log-prob is version 2's over that cache, which
    differs from a recomputation (``retract``)."""
    old_model, new_model = models
    engine, tok = _engine(tiny_path)
    prompt = tok.encode("ab:")
    results = _run(engine, "in_place", prompt, new_model)
    metas = [_meta(r, tok) for r in results]
    _check_spans_and_old_part(wv, metas, results, prompt, old_model)
    long = results[0]
    assert [m["num_retractions"] for m in metas] == [0, 0, 0]
    # the reference: version 1's cache over the prompt and the tokens fed before the pause,
    # then version 2 over the tokens fed after it
    cache_arg = "cache" if "cache" in inspect.signature(new_model.forward).parameters else "past_key_values"
    seen = prompt + long.output_ids[:PAUSE_AT - 1]
    fed = long.output_ids[PAUSE_AT - 1:-1]
    with torch.no_grad():
        out = old_model(input_ids=torch.tensor([seen]), use_cache=True)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        logits = new_model(input_ids=torch.tensor([fed]), use_cache=True,
                           position_ids=torch.arange(len(seen), len(seen) + len(fed))[None],
                           **{cache_arg: cache}).logits[0].float()
    want = torch.log_softmax(logits, -1).gather(
        -1, torch.tensor(long.output_ids[PAUSE_AT:])[:, None]).squeeze(-1)
    assert long.output_ids[PAUSE_AT:] == logits.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(long.logprobs[PAUSE_AT:]), want, atol=2e-5, rtol=1e-5)
    recomputed, _ = _logprobs(new_model, prompt, long.output_ids)
    assert not torch.allclose(recomputed[PAUSE_AT:], want, atol=1e-3)


def test_a_second_pause_in_retract_mode_retracts_a_batch_held_in_place(tiny_path):
    """SGLang's ``pause_generation`` retracts whatever runs, a batch paused in place too."""
    engine, tok = _engine(tiny_path)
    scheduler = Gated(engine, max_batch_size=8, batch_wait_s=0.05, at=3)

    async def scenario():
        loop = asyncio.get_running_loop()
        running = asyncio.ensure_future(scheduler.submit(
            [GenRequest(tok.encode("ab:"), max_new_tokens=12, temperature=0.0, ignore_eos=True)]))
        assert await loop.run_in_executor(None, scheduler.reached.wait, 30)
        pausing = loop.run_in_executor(None, scheduler.pause, "in_place")
        while scheduler.paused_mode is None:
            await asyncio.sleep(0.001)
        scheduler.go.set()
        await pausing
        assert scheduler.running() == 1 and not scheduler.idle()
        await loop.run_in_executor(None, scheduler.pause, "retract")
        assert (scheduler.running(), scheduler.waiting(), scheduler.idle()) == (0, 1, True)
        scheduler.resume()
        return await running

    [res] = asyncio.run(scenario())
    assert len(res.output_ids) == 12 and res.num_retractions == 1
    assert _meta(res, tok)["weight_versions"] == [{"version": "1", "start": 0, "end": 12}]
