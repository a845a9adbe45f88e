"""The CPU engine's generation in this process, no server: decoding stops at the first EOS,
a burst of requests longer than the batch wait is decoded as one batch, and a request that
finishes leaves its batch and is answered at once. Over HTTP: tests/integration/test_engine.py."""

from __future__ import annotations

import pytest
import torch

from rl.model import eos_token_ids, load_model, load_tokenizer
from rl.rollout.engines.hf_engine import GenRequest, HFEngine


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
    import asyncio

    from rl.rollout.engines.scheduler import BatchScheduler

    class Recording(HFEngine):  # the real engine, noting the rows of each batch it decodes
        def run(self, states, pause=None, on_finish=None):
            self.batches.append(len(states))
            return super().run(states, pause, on_finish)

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
    import asyncio
    import threading

    from rl.rollout.engines import hf_engine
    from rl.rollout.engines.scheduler import BatchScheduler

    monkeypatch.setattr(hf_engine, "_rows_selectable", lambda cache: selectable)

    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    rows = []  # batch rows of every forward pass
    model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]),
                                    with_kwargs=True)

    class Held(BatchScheduler):  # the real scheduler, the batch held at its 10th step boundary
        boundaries = 0
        reached, go = threading.Event(), threading.Event()

        def pause_mode(self):
            self.boundaries += 1
            if self.boundaries == 10:
                self.reached.set()
                assert self.go.wait(30)
            return super().pause_mode()

    engine = HFEngine(model, tok, eos_token_ids(tiny_path, tok), seed=0)
    greedy = dict(temperature=0.0, ignore_eos=True)
    short, long = (GenRequest(tok.encode("ab:"), max_new_tokens=n, **greedy) for n in (3, 20))
    scheduler = Held(engine, max_batch_size=8, batch_wait_s=0.2)

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
    import asyncio

    from rl.rollout.engines.scheduler import BatchScheduler

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
