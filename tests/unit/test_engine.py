"""The CPU engine's generation in this process, no server: decoding stops at the first EOS,
and a burst of requests longer than the batch wait is decoded as one batch. Over HTTP:
tests/integration/test_engine.py."""

from __future__ import annotations

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
        def run(self, states, pause=None):
            self.batches.append(len(states))
            return super().run(states, pause)

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
