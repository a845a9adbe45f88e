"""Learner: 2-rank FSDP2 gradients equal the 1-rank reference; packing keeps sampled ids
and masks everything outside the response; checkpoints round-trip."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from rl.runtime import Runtime
from rl.types import RolloutBatch
from tests.conftest import compose
from transfer.weights.group import free_port


def make_batch(n: int, seed: int = 0, vocab: int = 49) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    plen = rng.integers(2, 5, n).astype(np.int32)
    rlen = rng.integers(1, 7, n).astype(np.int32)
    tokens = [rng.integers(3, vocab, p + r).astype(np.int32) for p, r in zip(plen, rlen)]
    masks = [np.ones(r, dtype=np.int8) for r in rlen]
    masks[0][-1] = 0  # a masked response token must not count
    return RolloutBatch(
        tokens=tokens, loss_mask=masks,
        rollout_logprobs=[rng.normal(-3, 0.1, r).astype(np.float32) for r in rlen],
        prompt_len=plen, response_len=rlen, rewards=rng.random(n).astype(np.float32),
        advantages=rng.normal(0, 1, n).astype(np.float32), group_id=np.arange(n) // 4,
        sample_id=np.arange(n), weight_version=np.zeros(n, dtype=np.int64),
        finish_reason=["stop"] * n, label=["x"] * n)


def _grads_worker(rank, world, port, tiny_path, out_dir, pad_id):
    from rl.learner.learner import Learner
    from transfer.weights.base import full_tensor

    cfg = compose(f"cluster.num_learners={world}", "algo.micro_batch_size=3")
    learner = Learner(cfg, Runtime("t", out_dir, tiny_path), rank, world)
    learner.setup("127.0.0.1", port)
    learner.pad_id = pad_id
    batch = make_batch(16)
    part = batch.select(range(rank * 16 // world, (rank + 1) * 16 // world))
    learner.optimizer.zero_grad()
    learner.accumulate_grads(part)
    grads = {n: full_tensor(p.grad).clone() for n, p in learner.model.named_parameters()}
    if rank == 0:
        torch.save(grads, os.path.join(out_dir, f"grads_w{world}_pad{pad_id}.pt"))
    learner.close()


def _run(world, tiny_path, out_dir, pad_id=0):
    mp.start_processes(_grads_worker, args=(world, free_port(), tiny_path, out_dir, pad_id),
                       nprocs=world, join=True, start_method="spawn")
    return torch.load(os.path.join(out_dir, f"grads_w{world}_pad{pad_id}.pt"))


def test_fsdp2_gradients_match_single_process(tiny_path, tmp_path):
    ref = _run(1, tiny_path, str(tmp_path))
    two = _run(2, tiny_path, str(tmp_path))
    assert ref.keys() == two.keys()
    assert any(g.abs().sum() > 0 for g in ref.values())
    for name in ref:
        torch.testing.assert_close(two[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_pad_ids_never_reach_the_gradient(tiny_path, tmp_path):
    """Padding with EOS instead of pad must change nothing: pads are masked and unattended."""
    a = _run(1, tiny_path, str(tmp_path), pad_id=0)
    b = _run(1, tiny_path, str(tmp_path), pad_id=1)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)


def _async_worker(rank, world, port, tiny_path, out_dir):
    """Gradients under truncated IS and under the staleness mask, in one process group."""
    from rl.learner.learner import Learner, mask_stale
    from transfer.weights.base import full_tensor

    cfg = compose("cluster.num_learners=1", "algo.micro_batch_size=3")
    learner = Learner(cfg, Runtime("t", out_dir, tiny_path), 0, 1)
    learner.setup("127.0.0.1", port)

    def grads(batch, tis_cap=0.0):
        learner.cfg.algo.tis_cap = tis_cap
        learner.optimizer.zero_grad()
        learner.accumulate_grads(batch)
        return {n: full_tensor(p.grad).clone() for n, p in learner.model.named_parameters()}

    def with_engine_logp(value):
        b = make_batch(8)
        b.rollout_logprobs = [np.full_like(lp, value) for lp in b.rollout_logprobs]
        return b

    out = {"plain": grads(make_batch(8)),
           # engine log-prob -100: ratio current/engine is huge, every token capped at tis_cap
           "capped_2": grads(with_engine_logp(-100.0), tis_cap=2.0),
           "capped_half": grads(with_engine_logp(-100.0), tis_cap=0.5),
           # engine log-prob +50 (more likely than possible): ratio ~0, nothing learned
           "tiny_ratio": grads(with_engine_logp(50.0), tis_cap=2.0)}
    stale = make_batch(8)
    stale.weight_version = np.array([3, 1, 3, 2, 1, 3, 3, 2])
    keep = mask_stale(stale, min_version=2)
    out["keep"] = torch.from_numpy(keep)
    out["masked"] = grads(stale)
    out["fresh_only"] = grads(make_batch(8).select(np.flatnonzero(keep)))
    torch.save(out, os.path.join(out_dir, "async_grads.pt"))
    learner.close()


def test_truncated_is_and_staleness_mask_shape_the_gradient(tiny_path, tmp_path):
    mp.start_processes(_async_worker, args=(1, free_port(), tiny_path, str(tmp_path)),
                       nprocs=1, join=True, start_method="spawn")
    g = torch.load(os.path.join(tmp_path, "async_grads.pt"))
    plain = g["plain"]
    assert any(v.abs().sum() > 0 for v in plain.values())
    for name in plain:
        torch.testing.assert_close(g["capped_2"][name], 2.0 * plain[name], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(g["capped_half"][name], 0.5 * plain[name], rtol=1e-4, atol=1e-7)
        assert g["tiny_ratio"][name].abs().max() < 1e-12
        # stale samples masked == trained on the fresh ones only (loss normalised by their tokens)
        torch.testing.assert_close(g["masked"][name], g["fresh_only"][name], rtol=1e-4, atol=1e-6)
    assert g["keep"].tolist() == [True, False, True, True, False, True, True, True]


def test_pack_keeps_sampled_ids_and_masks_outside_the_response(tiny_path):
    from rl.learner.learner import Learner

    learner = Learner(compose(), Runtime("t", "/tmp", tiny_path), 0, 1)
    learner.pad_id, learner.device = 0, torch.device("cpu")
    batch = make_batch(6, seed=1)
    mb = learner._pack(batch)
    for i in range(len(batch)):
        p, r, n = int(batch.prompt_len[i]), int(batch.response_len[i]), len(batch.tokens[i])
        assert mb["ids"][i, :n].tolist() == batch.tokens[i].tolist()  # exactly as sampled
        assert mb["ids"][i, n:].eq(0).all() and mb["attn"][i, n:].eq(0).all()
        expect = np.zeros(mb["mask"].shape[1], dtype=np.float32)
        expect[p - 1:p - 1 + r] = batch.loss_mask[i]
        np.testing.assert_array_equal(mb["mask"][i].numpy(), expect)
        # position p-1+j predicts response token j
        np.testing.assert_array_equal(mb["rollout_logp"][i, p - 1:p - 1 + r].numpy(),
                                      batch.rollout_logprobs[i])
    assert mb["mask"][0].sum() == batch.response_len[0] - 1  # its last token was masked


def test_split_balanced_is_even_and_balanced():
    from rl.rollout.manager import split_balanced

    lengths = np.array([10, 1, 9, 2, 8, 3, 7, 4])
    parts = split_balanced(lengths, 2)
    assert sorted(sum(parts, [])) == list(range(8)) and all(len(p) == 4 for p in parts)
    loads = [int(lengths[p].sum()) for p in parts]
    assert max(loads) - min(loads) <= 2
    with pytest.raises(AssertionError):
        split_balanced(lengths[:7], 2)
