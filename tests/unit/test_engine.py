"""The CPU engine's generation in this process, no server: decoding stops at the first EOS,
a burst of requests longer than the batch wait is decoded as one batch, a request that
finishes leaves its batch and is answered at once, and one that arrives while a batch decodes
joins it (unless a weight update waits), a weight read or check is answered between two
steps, and ``/health_generate`` passes on a busy batch.
Over HTTP: tests/integration/test_engine.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rl.model import eos_token_ids, load_model, load_tokenizer
from rl.rollout.engines.hf_engine import GenRequest, HFEngine
from rl.rollout.engines.scheduler import BatchScheduler
from tests.support.schedulers import Gated


def _rows_of_forwards(model) -> list[int]:
    rows = []  # batch rows of every forward pass
    model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]),
                                    with_kwargs=True)
    return rows


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


def test_a_burst_longer_than_the_wait_is_decoded_as_one_batch(tiny_path):
    """Requests arriving within ``batch_wait_s`` of each other join one batch even when the
    burst lasts longer than that (a rollout step's requests over a slow HTTP loop); a quiet
    gap of ``batch_wait_s`` closes the batch."""
    class Recording(HFEngine):  # the real engine, noting the rows of each batch it decodes
        def run(self, states, pause=None, on_finish=None, admit=None):
            self.batches.append(len(states))
            return super().run(states, pause, on_finish, admit)

    tok = load_tokenizer(tiny_path)
    engine = Recording(load_model(tiny_path), tok, eos_token_ids(tiny_path, tok), seed=0)
    engine.batches = []
    scheduler = BatchScheduler(engine, max_batch_size=64, batch_wait_s=1.0)

    async def burst_then_pause():
        sent = []
        for i in range(8):  # 0.2 s apart: 1.6 s in all, longer than the wait, gaps well under it
            sent.append(asyncio.ensure_future(
                scheduler.submit([GenRequest(input_ids=[5 + i], max_new_tokens=2)])))
            await asyncio.sleep(0.2)
        first = await asyncio.gather(*sent)
        second = await scheduler.submit([GenRequest(input_ids=[5], max_new_tokens=2)] * 2)
        return first, second

    first, second = asyncio.run(burst_then_pause())
    assert engine.batches == [8, 2]
    assert [len(r) for r in first] == [1] * 8 and len(second) == 2
    assert all(1 <= len(r.output_ids) <= 2 for r in [*(r[0] for r in first), *second])


@pytest.mark.parametrize("selectable", [True, False])
def test_a_finished_request_leaves_the_batch_and_is_answered_at_once(tiny_path, selectable,
                                                                     monkeypatch):
    """As SGLang's scheduler: a short request decoded beside a long one is answered while the
    long one still decodes, and the batch's later forward passes carry the long one's row
    alone; both answers are what each request gets decoded by itself (greedy). A model whose
    cache cannot drop rows (``selectable`` False) keeps them, and answers as early."""
    from rl.rollout.engines import hf_engine

    monkeypatch.setattr(hf_engine, "_rows_selectable", lambda cache: selectable)

    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    rows = _rows_of_forwards(model)
    engine = HFEngine(model, tok, eos_token_ids(tiny_path, tok), seed=0)
    greedy = dict(temperature=0.0, ignore_eos=True)
    short, long = (GenRequest(tok.encode("ab:"), max_new_tokens=n, **greedy) for n in (3, 20))
    scheduler = Gated(engine, max_batch_size=8, batch_wait_s=0.2, at=10)  # held at its 10th step

    async def scenario():
        loop = asyncio.get_running_loop()
        a, b = (asyncio.ensure_future(scheduler.submit([r])) for r in (short, long))
        assert await loop.run_in_executor(None, scheduler.reached.wait, 30)
        await asyncio.sleep(0.05)  # the answer crosses to this loop
        early = (a.done(), b.done(), scheduler.running())
        scheduler.go.set()
        return early, (await a)[0], (await b)[0]

    early, a, b = asyncio.run(scenario())
    assert early == (True, False, 1)
    if selectable:
        assert rows[:4] == [2, 2, 2, 1] and set(rows[4:]) == {1}  # prefill, 2 decodes, then alone
    else:
        assert set(rows) == {2} and len(rows) == 20  # the prefill and 19 decodes, both rows
    assert (len(a.output_ids), len(b.output_ids)) == (3, 20)
    alone = [engine.generate([r])[0] for r in (short, long)]
    assert [a.output_ids, b.output_ids] == [r.output_ids for r in alone]
    torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(alone[1].logprobs),
                               atol=2e-5, rtol=1e-5)


def test_rows_leave_a_batch_only_from_a_cache_of_attention_layers(tiny_path):
    """The tiny model's cache drops rows; a cache holding a linear-attention layer (the
    recurrent state of a hybrid model, which ``batch_select_indices`` does not select) keeps them."""
    from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionAndFullAttentionLayer

    from rl.rollout.engines.hf_engine import _cache_of, _rows_selectable

    tok = load_tokenizer(tiny_path)
    with torch.no_grad():
        out = load_model(tiny_path)(input_ids=torch.tensor([tok.encode("ab:")]), use_cache=True)
    assert _rows_selectable(_cache_of(out))
    assert not _rows_selectable(Cache(layers=[DynamicLayer(), LinearAttentionAndFullAttentionLayer()]))


def test_a_request_whose_answer_fails_fails_alone(tiny_path):
    """An answer that cannot be built fails its own request; the others of its batch are
    answered, and the scheduler counts nothing running after."""
    class Failing(HFEngine):  # the real engine, whose answer to 2-token requests breaks
        def result(self, state):
            if state.req.max_new_tokens == 2:
                raise ValueError("no answer")
            return super().result(state)

    tok = load_tokenizer(tiny_path)
    engine = Failing(load_model(tiny_path), tok, eos_token_ids(tiny_path, tok), seed=0)
    scheduler = BatchScheduler(engine, max_batch_size=8, batch_wait_s=0.2)
    reqs = [GenRequest(tok.encode("ab:"), max_new_tokens=n, ignore_eos=True) for n in (2, 5)]

    async def both():
        return await asyncio.gather(*(scheduler.submit([r]) for r in reqs), return_exceptions=True)

    failed, [answered] = asyncio.run(both())
    assert isinstance(failed, ValueError) and len(answered.output_ids) == 5
    assert (scheduler.running(), scheduler.waiting()) == (0, 0)



@pytest.mark.parametrize("joiner", ["longer_prompt", "shorter_prompt_with_penalties"])
def test_a_request_arriving_while_a_batch_decodes_joins_it(tiny_path, joiner):
    """Continuous batching, as SGLang's scheduler: a request submitted while a batch decodes
    is prefilled at the batch's next step boundary and decodes in it (one forward pass for
    both rows), whether its prompt is longer than the running request's tokens so far or
    shorter (the shorter KV cache padded); it is answered when it finishes, and each answer
    is what the request gets decoded alone (greedy: tokens, log-probs, and a joining row's
    own penalties and min_new_tokens count, not the batch's)."""
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    eos = eos_token_ids(tiny_path, tok)
    rows = _rows_of_forwards(model)
    engine = HFEngine(model, tok, eos, seed=0)
    greedy = dict(temperature=0.0)
    running = GenRequest(tok.encode("ab:"), max_new_tokens=20, ignore_eos=True, **greedy)
    if joiner == "longer_prompt":
        joining = GenRequest(tok.encode("abcdefghijklmnopqrst:"), max_new_tokens=6, ignore_eos=True,
                             **greedy)
    else:  # EOS made likely: the answer ends once min_new_tokens, counted from its own start, allow it
        with torch.no_grad():
            model.lm_head.weight[eos[0]] += 50.0
        joining = GenRequest(tok.encode("b:"), max_new_tokens=12, min_new_tokens=4,
                             frequency_penalty=1.5, presence_penalty=0.5, **greedy)
    scheduler = Gated(engine, max_batch_size=8, batch_wait_s=0.2, at=5)

    async def scenario():
        loop = asyncio.get_running_loop()
        a = asyncio.ensure_future(scheduler.submit([running]))
        assert await loop.run_in_executor(None, scheduler.reached.wait, 30)
        b = asyncio.ensure_future(scheduler.submit([joining]))
        while scheduler.waiting() == 0:
            await asyncio.sleep(0.01)
        scheduler.go.set()
        b_first = (await b)[0], a.done()
        return (await a)[0], *b_first

    a, b, a_done_before_b = asyncio.run(scenario())
    assert not a_done_before_b
    n = len(b.output_ids)
    assert len(a.output_ids) == 20 and (n > 4 if joiner != "longer_prompt" else n == 6)
    # the running request's prefill and 4 decodes alone, the joining one's prefill, then one
    # forward pass for both rows until the joining one finishes, then alone again
    assert rows == [1] * 6 + [2] * (n - 1) + [1] * (16 - n), rows
    alone = [engine.generate([r])[0] for r in (running, joining)]
    assert [a.output_ids, b.output_ids] == [r.output_ids for r in alone]
    for got, want in zip((a, b), alone):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                                   atol=2e-5, rtol=1e-5)
    if joiner != "longer_prompt":
        assert b.output_ids[-1] == eos[0] and eos[0] not in b.output_ids[:-1]


def test_no_request_joins_while_a_weight_update_waits(tiny_path):
    """A weight update (the engine's lock, as ``update_weights_from_distributed`` takes it)
    stops admission: the running batch ends and lets it in rather than taking new requests
    for as long as they come; the request that arrived meanwhile runs in a batch of its own."""
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    rows = _rows_of_forwards(model)
    engine = HFEngine(model, tok, eos_token_ids(tiny_path, tok), seed=0)
    scheduler = Gated(engine, max_batch_size=8, batch_wait_s=0.2, at=3)
    first = GenRequest(tok.encode("ab:"), max_new_tokens=8, ignore_eos=True)
    second = GenRequest(tok.encode("b:"), max_new_tokens=4, ignore_eos=True)
    updated = []

    def update():
        with engine._exclusive():
            updated.append(len(rows))  # forward passes run when the update got the lock

    async def scenario():
        loop = asyncio.get_running_loop()
        a = asyncio.ensure_future(scheduler.submit([first]))
        assert await loop.run_in_executor(None, scheduler.reached.wait, 30)
        waiting = loop.run_in_executor(None, update)
        while engine._waiters == 0:
            await asyncio.sleep(0.01)
        b = asyncio.ensure_future(scheduler.submit([second]))
        while scheduler.waiting() == 0:
            await asyncio.sleep(0.01)
        scheduler.go.set()
        return await a, await b, await waiting

    a, b, _ = asyncio.run(scenario())
    assert (len(a[0].output_ids), len(b[0].output_ids)) == (8, 4)
    assert updated == [8]  # after the first batch's 8 passes, before the second's
    assert set(rows) == {1} and len(rows) == 8 + 4  # never decoded together


class HeldTwice(Gated):
    """Held at boundary ``at`` until ``go``, then at the next one until ``again``."""

    def __init__(self, *args, **kwargs) -> None:
        self.second, self.again = threading.Event(), threading.Event()
        super().__init__(*args, **kwargs)

    def pause_mode(self):
        mode = super().pause_mode()
        if self.boundaries == self.at + 1:
            self.second.set()
            assert self.again.wait(30)
        return mode


def test_weight_reads_and_checks_are_answered_between_two_steps(tiny_path):
    """As SGLang's scheduler does, a weight read and a checksum asked while a batch decodes
    are answered at its next step boundary, while the batch still runs (here held at the
    boundary after), with what an idle engine answers; the batch decodes on to its end."""
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    rows = _rows_of_forwards(model)
    engine = HFEngine(model, tok, eos_token_ids(tiny_path, tok), seed=0)
    idle = (engine.get_weights_by_name("lm_head.weight", 2), engine.check_weights("checksum"))
    scheduler = HeldTwice(engine, max_batch_size=8, batch_wait_s=0.2, at=3)
    running = GenRequest(tok.encode("ab:"), max_new_tokens=8, ignore_eos=True)

    async def scenario():
        loop = asyncio.get_running_loop()
        a = asyncio.ensure_future(scheduler.submit([running]))
        assert await loop.run_in_executor(None, scheduler.reached.wait, 30)
        read = loop.run_in_executor(None, engine.get_weights_by_name, "lm_head.weight", 2)
        check = loop.run_in_executor(None, engine.check_weights, "checksum")
        while len(engine._asides) < 2:
            await asyncio.sleep(0.01)
        assert not read.done() and not check.done()  # the batch holds the engine: they wait
        scheduler.go.set()
        assert await loop.run_in_executor(None, scheduler.second.wait, 30)
        answered = await asyncio.wait_for(asyncio.gather(read, check), 30)  # batch still held
        assert len(rows) == 4 and not a.done()  # answered at boundary 3, held at 4
        scheduler.again.set()
        return answered, await a

    (weights, checksums), a = asyncio.run(scenario())
    assert (weights, checksums) == idle
    assert len(a[0].output_ids) == 8 and len(rows) == 8
    with pytest.raises(ValueError, match="not supported"):
        engine.check_weights("snapshot")
    with pytest.raises(ZeroDivisionError):  # what fails between steps fails in the thread that asked
        engine._between_steps(lambda: 1 / 0)


def test_a_request_that_cannot_join_fails_alone(tiny_path):
    """A request whose prefill fails as it joins a running batch (a token id outside the
    vocabulary) fails by itself; the running request decodes on untouched and is answered as
    if alone, and the scheduler counts nothing running after."""
    tok = load_tokenizer(tiny_path)
    engine = HFEngine(load_model(tiny_path), tok, eos_token_ids(tiny_path, tok), seed=0)
    scheduler = Gated(engine, max_batch_size=8, batch_wait_s=0.2, at=3)
    running = GenRequest(tok.encode("ab:"), max_new_tokens=8, ignore_eos=True, temperature=0.0)
    broken = GenRequest([engine.vocab_size + 7], max_new_tokens=4, ignore_eos=True)

    async def scenario():
        loop = asyncio.get_running_loop()
        a = asyncio.ensure_future(scheduler.submit([running]))
        assert await loop.run_in_executor(None, scheduler.reached.wait, 30)
        b = asyncio.ensure_future(scheduler.submit([broken]))
        while scheduler.waiting() == 0:
            await asyncio.sleep(0.01)
        scheduler.go.set()
        return await asyncio.gather(a, b, return_exceptions=True)

    [answered], failed = asyncio.run(scenario())
    assert isinstance(failed, IndexError), failed
    assert answered.output_ids == engine.generate([running])[0].output_ids
    assert (scheduler.running(), scheduler.waiting()) == (0, 0)


def test_health_generate_passes_on_a_busy_batch_and_fails_on_a_stuck_one(tiny_path, monkeypatch):
    """``/health_generate`` on a batch too big for its probe to join (one request waits, the
    rule asks for an eighth of 16 rows): the running batch's steps answer it while the probe
    still waits and the batch runs on, as SGLang's check passes on a busy engine; with the
    batch held at a step boundary and no step coming, it answers 503 once the health timeout
    passes."""
    from rl.rollout.engines import hf_server

    monkeypatch.setattr(hf_server, "HEALTH_CHECK_TIMEOUT_S", 1.0)
    tok = load_tokenizer(tiny_path)
    engine = HFEngine(load_model(tiny_path), tok, eos_token_ids(tiny_path, tok), seed=0)

    async def probe_at_third_step(stuck: bool):
        loop = asyncio.get_running_loop()
        scheduler = Gated(engine, max_batch_size=32, batch_wait_s=0.2, at=3)
        routes = hf_server.Routes(engine, scheduler, tiny_path)
        # busy: long, so that it still runs when the probe is answered (a step takes milliseconds)
        batch = [GenRequest(tok.encode("ab:"), max_new_tokens=8 if stuck else 200, ignore_eos=True)
                 for _ in range(16)]
        running = asyncio.ensure_future(scheduler.submit(batch))
        assert await loop.run_in_executor(None, scheduler.reached.wait, 30)
        if stuck:
            answer = await routes.health_generate(None)  # held: no step comes
            seen = None
        else:
            probe = asyncio.ensure_future(routes.health_generate(None))
            while scheduler.waiting() == 0:  # the probe's request queued
                await asyncio.sleep(0.01)
        scheduler.go.set()
        if not stuck:
            answer = await probe
            seen = scheduler.waiting(), running.done()
        await running
        return answer.status, seen

    assert asyncio.run(probe_at_third_step(stuck=False)) == (200, (1, False))  # probe not joined
    assert asyncio.run(probe_at_third_step(stuck=True)) == (503, None)
