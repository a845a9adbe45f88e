"""A sample's weight version is the oldest it saw, with SGLang's own span code.

SGLang 0.5.23's ``sglang/srt/utils/weight_versions.py`` (imported from the pinned wheel; it
needs only ``msgspec``) records, when a weight update arrives, the version each live request
had and how many output tokens it held (``record_weight_version_events``); when the request
finishes, the scheduler turns those events into spans (``compute_weight_version_spans``) and
the tokenizer manager writes ``meta_info.weight_versions`` and sets ``weight_version`` to the
last span's, the newest (``add_weight_versions_to_meta_info``). Here that code writes the
meta_info of requests that span a sync, and the manager's batch builder reads it: no Ray, no
processes, no engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.rollout.batch import answer_weight_versions, build_batch, is_partial, sample_weight_version
from rl.rollout.engines import weight_versions as ours
from rl.rollout.functions import Sample
from rl.tasks import Prompt
from tests.support import sglang_release as sgl


@pytest.fixture(scope="module")
def wv():
    sgl.check_pinned()
    from sglang.srt.utils import weight_versions

    return weight_versions


class Request:
    """What SGLang's span code reads of a scheduler ``Req``: its output ids and its events."""

    def __init__(self) -> None:
        self.output_ids: list[int] = []
        self.weight_version_events: list = []

    def decode(self, n: int) -> None:
        self.output_ids += [7] * n


def _finish(wv, req: Request, serving: str) -> dict:
    """The meta_info of a finished request, as SGLang 0.5.23 writes it: the tokenizer
    manager's first fields (``weight_version`` is the server's version at the end), then the
    scheduler's spans (output_streamer) added by ``add_weight_versions_to_meta_info``."""
    n = len(req.output_ids)
    meta = {"id": "r", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 3,
            "weight_version": serving, "num_retractions": 0,
            "output_token_logprobs": [[-0.5, t, None] for t in req.output_ids],
            "completion_tokens": n}
    spans = wv.compute_weight_version_spans(req.weight_version_events, current_version=serving,
                                            num_output_tokens=n)
    wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=n)
    return meta


def _sync(wv, live: list[Request], old: str) -> None:
    """A weight update arrives: SGLang's scheduler records it on every live request."""
    wv.record_weight_version_events(live, old_version=old)


def _sample(meta: dict) -> Sample:
    return Sample.from_answer([1, 2, 3], {"text": "x", "meta_info": meta,
                                          "output_ids": [t for _, t, _ in meta["output_token_logprobs"]]})


def _batch(metas: list[dict]):
    samples = [[_sample(m) for m in metas]]
    return build_batch([Prompt(text="q", label="a", index=0)], samples,
                       lambda text, label, finished: 0.0, group_size=len(metas), std_norm=True,
                       first_sample_id=0)


def test_a_sample_begun_under_v_and_finished_under_v_plus_1_counts_as_v(wv):
    spanning, fresh, before = Request(), Request(), Request()
    spanning.decode(5)  # five tokens under version 3, then the sync (retract, update, continue)
    before.decode(4)
    metas = [_finish(wv, before, "3")]  # finished before the sync
    _sync(wv, [spanning, fresh], old="3")  # `fresh` is queued with no output yet
    spanning.decode(4)
    fresh.decode(6)
    metas += [_finish(wv, spanning, "4"), _finish(wv, fresh, "4")]

    assert metas[1]["weight_version"] == "4"  # SGLang's field names the newest ...
    assert metas[1]["weight_versions"] == [{"version": "3", "start": 0, "end": 5},
                                           {"version": "4", "start": 5, "end": 9}]
    assert metas[2]["weight_versions"] == [{"version": "4", "start": 0, "end": 6}]
    batch = _batch(metas)
    np.testing.assert_array_equal(batch.weight_version, [3, 3, 4])  # ... the batch the oldest
    assert batch.response_len.tolist() == [4, 9, 6]
    assert [answer_weight_versions(m) for m in metas] == [[3], [3, 4], [4]]
    assert [is_partial(_sample(m)) for m in metas] == [False, True, False]  # rollout/partial_frac


def test_a_sample_is_partial_when_its_tokens_come_from_two_versions(wv):
    """``is_partial`` (``rollout/partial_frac``): a request whose tokens span a sync, or a
    multi-turn sample whose turns were answered under different versions; not a request the
    sync found with no output yet (SGLang gives it one span), nor turns of one version."""
    waiting, turn = Request(), Request()
    _sync(wv, [waiting], old="3")  # queued, no output at the sync
    waiting.decode(3)
    turn.decode(2)
    first, later = _finish(wv, turn, "3"), _finish(wv, waiting, "4")
    assert answer_weight_versions(later) == [4] and not is_partial(_sample(later))
    two_turns = _sample(first)
    assert not is_partial(two_turns)
    two_turns.meta_info.append(later)  # a second turn, answered after the sync
    assert is_partial(two_turns)
    two_turns.meta_info[-1] = _finish(wv, Request(), "3")
    assert not is_partial(two_turns)


def test_two_syncs_during_one_sample_count_the_first(wv):
    req = Request()
    req.decode(2)
    _sync(wv, [req], old="5")
    req.decode(2)
    _sync(wv, [req], old="6")
    req.decode(1)
    meta = _finish(wv, req, "7")
    assert [s["version"] for s in meta["weight_versions"]] == ["5", "6", "7"]
    assert meta["weight_version"] == "7" and sample_weight_version(meta) == 5


def test_without_spans_the_one_version_is_taken():
    """Servers before the spans (and answers that lack them) give ``weight_version`` alone;
    an engine never synced reports ``default``."""
    assert sample_weight_version({"weight_version": "12"}) == 12
    assert sample_weight_version({"weight_version": "12", "weight_versions": []}) == 12
    assert sample_weight_version({"weight_version": "default"}) == -1
    assert sample_weight_version({"weight_version": "2", "weight_versions": [
        {"version": "default", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 4}]}) == -1


def test_the_cpu_engine_answers_spans_as_sglang_does(wv):
    """A CPU engine answer with no version change is what SGLang writes for a request that
    saw no sync; one with changes (a retraction or a pause in place across syncs) is what
    SGLang writes for the same changes."""
    from rl.rollout.engines.hf_engine import GenResult
    from rl.rollout.engines.protocol import Generate, answer
    from rl.rollout.engines.sampling import GenRequest

    g = Generate(reqs=[GenRequest(input_ids=[1, 2])], single=True, return_logprob=True)
    tok = SimpleNamespace(decode=lambda ids: "x")
    res = GenResult(output_ids=[4, 5, 6], logprobs=[-1.0] * 3, finish_reason={"type": "length", "length": 3},
                    weight_version="9", text="abc")
    meta = answer(g, 0, res, 0.1, tok)["meta_info"]
    req = Request()
    req.decode(3)
    want = _finish(wv, req, "9")
    assert meta["weight_version"] == want["weight_version"] == "9"
    assert meta["weight_versions"] == want["weight_versions"]
    assert meta["num_retractions"] == want["num_retractions"] == 0

    req = Request()
    req.decode(2)
    _sync(wv, [req], old="3")
    req.decode(4)
    want = _finish(wv, req, "4")
    res = GenResult(output_ids=[7] * 6, logprobs=[-1.0] * 6, finish_reason={"type": "length", "length": 6},
                    weight_version="4", version_events=[ours.VersionEvent("3", 2)], num_retractions=1)
    meta = answer(g, 0, res, 0.1, tok)["meta_info"]
    assert (meta["weight_versions"], meta["weight_version"]) == (want["weight_versions"], "4")
    assert meta["num_retractions"] == 1


_events = st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 12)), max_size=5)


@settings(max_examples=300, deadline=None)
@given(events=_events, current=st.sampled_from("abc"), n=st.integers(0, 12), visible=st.integers(0, 12))
def test_the_engines_span_code_is_sglangs(wv, events, current, n, visible):
    """Any events, current version and token counts: the engine's ``weight_version_spans``
    and ``add_weight_versions_to_meta_info`` give what the pinned wheel's give."""
    theirs = wv.compute_weight_version_spans(
        [wv.WeightVersionEvent(old_version=v, num_output_tokens=k) for v, k in events], current, n)
    mine = ours.weight_version_spans([ours.VersionEvent(v, k) for v, k in events], current, n)
    assert mine == [{"version": s.version, "start": s.start, "end": s.end} for s in theirs]
    want: dict = {}
    wv.add_weight_versions_to_meta_info(want, theirs, num_output_tokens=visible)
    got: dict = {}
    ours.add_weight_versions_to_meta_info(got, mine, num_output_tokens=visible)
    assert got == want
