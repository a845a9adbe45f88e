"""Learner on spawned gloo ranks: 2-rank FSDP2 gradients equal the 1-rank reference, pad ids
never reach the gradient, the truncated importance ratio and staleness mask, the masked
importance ratio and the off-policy metrics over two ranks, several steps per rollout clip
against the behaviour policy, dropped flat groups equal training without them (and kept,
a batch of only flat groups still takes its step, on a zero gradient), the KL penalty and
entropy bonus match plain autograd, and micro-batches by token budget give the
gradients of fixed-size ones, on ranks of very different lengths."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from rl.runtime import Runtime
from rl.types import RolloutBatch
from tests.support.batches import grouped_batch, make_batch
from tests.support.env import compose
from transfer.data.base import Ragged
from transfer.net import free_port


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


def _run(ranks, world, tiny_path, out_dir, pad_id=0):
    ranks.run(_grads_worker, (world, free_port(), tiny_path, out_dir, pad_id), nprocs=world)
    return torch.load(os.path.join(out_dir, f"grads_w{world}_pad{pad_id}.pt"))


def test_fsdp2_gradients_match_single_process(ranks, tiny_path, tmp_path):
    ref = _run(ranks, 1, tiny_path, str(tmp_path))
    two = _run(ranks, 2, tiny_path, str(tmp_path))
    assert ref.keys() == two.keys()
    assert any(g.abs().sum() > 0 for g in ref.values())
    for name in ref:
        torch.testing.assert_close(two[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_pad_ids_never_reach_the_gradient(ranks, tiny_path, tmp_path):
    """Padding with EOS instead of pad must change nothing: pads are masked and unattended."""
    a = _run(ranks, 1, tiny_path, str(tmp_path), pad_id=0)
    b = _run(ranks, 1, tiny_path, str(tmp_path), pad_id=1)
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
        b.rollout_logprobs = Ragged(np.full_like(b.rollout_logprobs.values, value),
                                    b.rollout_logprobs.offsets)
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


def test_truncated_is_and_staleness_mask_shape_the_gradient(ranks, tiny_path, tmp_path):
    ranks.run(_async_worker, (1, free_port(), tiny_path, str(tmp_path)))
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


# -- masked importance sampling and the off-policy metrics (algo.is_mask) ---------------------
SHIFT = math.log(2.0)  # rank 1's engine log-probs in the "split" cases: ratio w = 2 on each token


def _is_batch(rank: int):
    return make_batch(8, seed=10 + rank)


def _is_worker(rank, world, port, tiny_path, out_dir):
    """Two ranks. Engine log-probs far from the learner's (-100: w ~ e^96) under token and
    sequence masks with a narrow band: gradients; then ``train_batch``'s metrics with engine
    log-probs equal to the learner's own (``behaviour_logprobs`` at the current weights) on
    rank 0 and shifted by ln 2 (w = 2) on rank 1, and equal on both."""
    import pickle

    from rl.learner.learner import Learner
    from transfer.weights.base import full_tensor

    cfg = compose(f"cluster.num_learners={world}", "algo.micro_batch_size=3")
    learner = Learner(cfg, Runtime("t", out_dir, tiny_path), rank, world)
    learner.setup("127.0.0.1", port)
    a = learner.cfg.algo

    def setting(is_mask="none", low=0.5, high=2.0, tis_cap=0.0):
        a.is_mask, a.is_mask_low, a.is_mask_high, a.tis_cap = is_mask, low, high, tis_cap

    def grads(batch):
        learner.optimizer.zero_grad()
        sums = learner.accumulate_grads(batch)
        return sums, {n: full_tensor(p.grad).clone() for n, p in learner.model.named_parameters()}

    def far():
        b = _is_batch(rank)
        engine = b.rollout_logprobs
        b.rollout_logprobs = Ragged(np.full_like(engine.values, -100.0), engine.offsets)
        return b

    def engine_shifted(shift):
        """Engine log-probs = the learner's own at the current weights - ``shift``."""
        b = _is_batch(rank)
        own = learner.behaviour_logprobs(b)
        b.rollout_logprobs = Ragged((own.values - shift).astype(np.float32), own.offsets)
        return b

    out = {}
    setting()
    out["far_plain"] = grads(far())
    setting("token", 0.9, 1.1)
    out["far_token"] = grads(far())
    setting("sequence", 0.9, 1.1, tis_cap=2.0)
    out["far_sequence"] = grads(far())
    # train_batch: every token masked, so a zero gradient (AdamW then moves nothing either)
    setting("token", 0.9, 1.1)
    out["far_metrics"] = learner.train_batch(far())
    split = SHIFT if rank == 1 else 0.0
    setting(tis_cap=1.5)
    out["split_tis"] = learner.train_batch(engine_shifted(split))
    setting("token", 0.5, 1.5, tis_cap=1.5)
    out["split_token"] = learner.train_batch(engine_shifted(split))
    setting("sequence", 0.5, 1.5)
    out["split_sequence"] = learner.train_batch(engine_shifted(split))
    setting("token", 0.9, 1.1)
    out["equal"] = learner.train_batch(engine_shifted(0.0))
    if rank == 0:
        with open(os.path.join(out_dir, "is.pkl"), "wb") as f:
            pickle.dump(out, f)
    learner.close()


@pytest.fixture(scope="module")
def is_out(ranks, tiny_path, tmp_path_factory) -> dict:
    import pickle

    out_dir = str(tmp_path_factory.mktemp("is"))
    ranks.run(_is_worker, (2, free_port(), tiny_path, out_dir), nprocs=2)
    with open(os.path.join(out_dir, "is.pkl"), "rb") as f:
        return pickle.load(f)


def _loss_tokens(rank: int) -> int:
    return sum(int(np.count_nonzero(m)) for m in _is_batch(rank).loss_mask)


def test_masking_far_engine_logprobs_leaves_no_gradient(is_out):
    """Engine log-probs of -100 (ratio ~e^96 on every token): a narrow band masks every token,
    at the token level and at the sequence level (with TIS on too), and no gradient is left;
    without a mask the same batch does have one."""
    sums, plain = is_out["far_plain"]
    assert any(float(g.abs().max()) > 0 for g in plain.values())
    assert sums["is_masked"] == 0
    for case in ("far_token", "far_sequence"):
        sums, g = is_out[case]
        assert sums["is_masked"] == sums["tokens"] == sums["is_n"] == _loss_tokens(0), case
        for name, t in g.items():
            assert float(t.abs().max()) == 0.0, (case, name)
    m = is_out["far_metrics"]
    assert m["train/is_masked_frac"] == 1.0 and m["train/is_truncated_frac"] == 0.0
    assert m["train/is_weight_max"] == pytest.approx(math.exp(20.0))  # clamped for the statistics
    assert m["train/engine_kl"] > 1e6
    assert all(math.isfinite(v) for v in m.values())


def test_off_policy_metrics_are_reduced_over_all_ranks(is_out):
    """Rank 0's engine agrees with the learner (w = 1 on its n0 tokens), rank 1's is ln 2 less
    likely on every token (w = 2 on its n1): each metric is that of all n0 + n1 tokens."""
    n0, n1 = _loss_tokens(0), _loss_tokens(1)
    n = n0 + n1
    for case in ("split_tis", "split_token", "split_sequence"):
        m = is_out[case]
        assert m["train/is_weight_mean"] == pytest.approx((n0 + 2 * n1) / n, rel=1e-5), case
        assert m["train/is_weight_max"] == pytest.approx(2.0, rel=1e-5), case
        assert m["train/is_ess"] == pytest.approx((n0 + 2 * n1) ** 2 / (n * (n0 + 4 * n1)), rel=1e-5), case
        # k3 of KL(engine || learner): w - 1 - ln w = 1 - ln 2 on rank 1's tokens, 0 on rank 0's
        assert m["train/engine_kl"] == pytest.approx(n1 * (1 - SHIFT) / n, rel=1e-4), case
    # tis_cap 1.5 truncates rank 1's tokens; the band [0.5, 1.5] masks them (first: none is
    # left to truncate), token by token or as whole sequences
    assert is_out["split_tis"]["train/is_truncated_frac"] == pytest.approx(n1 / n)
    assert is_out["split_tis"]["train/is_masked_frac"] == 0.0
    assert is_out["split_tis"]["train/tis_mean"] == pytest.approx((n0 + 1.5 * n1) / n, rel=1e-5)
    for case in ("split_token", "split_sequence"):
        assert is_out[case]["train/is_masked_frac"] == pytest.approx(n1 / n), case
        assert is_out[case]["train/is_truncated_frac"] == 0.0, case
    # The loss (ratio 1 to the behaviour policy: -advantage per token): rank 1's tokens weigh
    # 1.5 under TIS, 0 under either mask, and the normaliser stays every loss token, n.
    adv_tokens = [sum(float(a) * int(np.count_nonzero(m)) for a, m in
                      zip(_is_batch(r).advantages, _is_batch(r).loss_mask)) for r in (0, 1)]
    assert is_out["split_tis"]["train/loss"] == pytest.approx(
        -(adv_tokens[0] + 1.5 * adv_tokens[1]) / n, rel=1e-4)
    for case in ("split_token", "split_sequence"):
        assert is_out[case]["train/loss"] == pytest.approx(-adv_tokens[0] / n, rel=1e-4), case


def test_equal_engine_logprobs_give_ess_one_and_mask_nothing(is_out):
    m = is_out["equal"]
    assert m["train/is_ess"] == pytest.approx(1.0, abs=1e-9)
    assert m["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["train/is_weight_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["train/is_masked_frac"] == 0.0 and m["train/is_truncated_frac"] == 0.0
    assert m["train/engine_kl"] == pytest.approx(0.0, abs=1e-9)
    assert m["train/logp_diff"] == pytest.approx(0.0, abs=1e-5)
    assert m["train/optimizer_steps"] == 1


# -- several optimizer steps per rollout (algo.steps_per_rollout) ----------------------------
def _plain(t):
    """A DTensor (FSDP2 shard) or tensor as a plain CPU tensor copy."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def _optimizer_state(optimizer) -> dict:
    sd = optimizer.state_dict()
    return {"state": {i: {k: _plain(v) if torch.is_tensor(v) else v for k, v in s.items()}
                      for i, s in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def _spy_steps(learner) -> list[dict]:
    """Wrap ``accumulate_grads`` (one call per optimizer step): record each mini-batch's sample
    ids, the behaviour log-probs and count it was given, its sums, and the full weights it
    started from. Behaviour unchanged."""
    record: list[dict] = []
    inner = learner.accumulate_grads

    def spy(mini, old_mini=None, count=None):
        weights = learner.full_state()
        sums = inner(mini, old_mini, count)
        record.append({"ids": mini.sample_id.tolist(), "count": count, "sums": dict(sums),
                       "old": None if old_mini is None else [o.copy() for o in old_mini],
                       "weights": weights})
        return sums

    learner.accumulate_grads = spy
    return record


CLIP_LOW, CLIP_HIGH = 0.02, 0.03


def _steps_worker(rank, world, port, tiny_path, out_dir):
    import pickle

    from rl.learner.learner import Learner

    cfg = compose("cluster.num_learners=1", "algo.micro_batch_size=3", "algo.steps_per_rollout=2",
                  "algo.lr=0.01", f"algo.clip_eps={CLIP_LOW}", f"algo.clip_eps_high={CLIP_HIGH}")
    learner = Learner(cfg, Runtime("t", out_dir, tiny_path), 0, 1)
    learner.setup("127.0.0.1", port)
    record = _spy_steps(learner)
    out = {"pad_id": learner.pad_id}
    out["two"] = learner.train_batch(make_batch(8, seed=3))
    out["two_steps"], record[:] = list(record), []
    learner.cfg.algo.steps_per_rollout = 1
    out["one"] = learner.train_batch(make_batch(8, seed=3))
    out["one_steps"], record[:] = list(record), []
    # An all-masked batch (every loss mask zero), with the optimizer's moments non-zero by now.
    out["before"] = (learner.full_state(), _optimizer_state(learner.optimizer))
    for steps in (2, 1):
        learner.cfg.algo.steps_per_rollout = steps
        masked = make_batch(8, seed=3)
        masked.loss_mask = masked.loss_mask.with_zeroed(np.arange(len(masked)))
        out[f"masked_{steps}"] = learner.train_batch(masked)
    out["masked_steps"] = list(record)
    out["after"] = (learner.full_state(), _optimizer_state(learner.optimizer))
    with open(os.path.join(out_dir, "steps.pkl"), "wb") as f:
        pickle.dump(out, f)
    learner.close()


def _plain_model(tiny_path, weights: dict):
    """A plain (unsharded) model holding ``weights``: the learner's numbers, not its code."""
    from rl.model import load_model

    model = load_model(tiny_path)
    params = dict(model.named_parameters())
    assert params.keys() == weights.keys()
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(torch.from_numpy(weights[name]))
    return model


def _logprobs_t(model, batch: RolloutBatch, idx) -> list[torch.Tensor]:
    """Log-probs of each sample's response tokens at temperature 1, one unpadded sample at a time."""
    out = []
    for i in idx:
        p, r = int(batch.prompt_len[i]), int(batch.response_len[i])
        ids = torch.from_numpy(batch.tokens[i].astype(np.int64))
        logits = model(input_ids=ids[None]).logits[0].float()
        logp = torch.log_softmax(logits[p - 1:p - 1 + r], dim=-1)
        out.append(logp.gather(-1, ids[p:p + r, None])[:, 0])
    return out


def _response_logprobs(tiny_path, weights: dict, batch: RolloutBatch) -> list[np.ndarray]:
    with torch.no_grad():
        return [t.numpy() for t in _logprobs_t(_plain_model(tiny_path, weights), batch, range(len(batch)))]


def _ppo_grad_norm(tiny_path, weights: dict, old: list[np.ndarray], batch: RolloutBatch, idx) -> float:
    """Norm of the gradient of the token-mean clipped loss of samples ``idx`` at ``weights``
    against the behaviour log-probs ``old`` (plain torch autograd)."""
    model = _plain_model(tiny_path, weights)
    loss, count = 0.0, 0
    for i, logp in zip(idx, _logprobs_t(model, batch, idx)):
        ratio = torch.exp(logp - torch.from_numpy(old[i]))
        a = float(batch.advantages[i])
        m = torch.from_numpy(batch.loss_mask[i].astype(np.float32))
        loss = loss + (torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)) * m).sum()
        count += int(np.count_nonzero(batch.loss_mask[i]))
    (loss / count).backward()
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()
                                if p.grad is not None)))


def _ppo_by_hand(logp, old, batch, idx):
    """Token-mean clipped loss and clipped-token count of samples ``idx``, in plain numpy."""
    loss_sum, clipped, count = 0.0, 0, 0
    for i in idx:
        ratio = np.exp(logp[i].astype(np.float64) - old[i])
        a = float(batch.advantages[i])
        unclipped = -a * ratio
        clip_branch = -a * np.clip(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
        m = batch.loss_mask[i].astype(np.float64)
        loss_sum += float((np.maximum(unclipped, clip_branch) * m).sum())
        clipped += int(((clip_branch > unclipped) & (m != 0)).sum())
        count += int(np.count_nonzero(m))
    return loss_sum / count, clipped, count


@pytest.fixture(scope="module")
def steps_out(ranks, tiny_path, tmp_path_factory) -> dict:
    """What ``_steps_worker`` recorded (one spawned learner for the tests below)."""
    import pickle

    out_dir = str(tmp_path_factory.mktemp("steps"))
    ranks.run(_steps_worker, (1, free_port(), tiny_path, out_dir))
    with open(os.path.join(out_dir, "steps.pkl"), "rb") as f:
        return pickle.load(f)


def test_steps_per_rollout_clip_against_the_behaviour_policy(steps_out, tiny_path):
    """Two optimizer steps on a fixed batch of 8: the second mini-batch's ratio, clipped
    tokens and loss are those of its log-probs under the weights after step 1 against the
    log-probs under the weights before step 1, computed here with a plain model."""
    out = steps_out
    batch = make_batch(8, seed=3)
    first, second = out["two_steps"]
    ids1, ids2 = first["ids"], second["ids"]  # shuffled mini-batches of 4 (sample id = index)
    assert len(ids1) == len(ids2) == 4 and sorted(ids1 + ids2) == list(range(8))

    # Behaviour log-probs: those of the weights the rollout's step started from, for both steps.
    w0, w1 = first["weights"], second["weights"]
    assert any(not np.array_equal(w0[n], w1[n]) for n in w0)  # step 1 moved the weights
    old = _response_logprobs(tiny_path, w0, batch)
    for i, got in zip(ids1 + ids2, first["old"] + second["old"]):
        np.testing.assert_allclose(got, old[i], rtol=0, atol=2e-5)
    logp1 = _response_logprobs(tiny_path, w1, batch)
    # ... and the current weights differ from them enough for the clip to tell them apart
    assert max(np.abs(logp1[i] - old[i]).max() for i in ids2) > 3 * CLIP_HIGH

    # Step 1: the weights are the behaviour policy's: ratio 1, nothing clipped.
    loss1, clipped1, count1 = _ppo_by_hand(old, old, batch, ids1)
    assert first["count"] == count1 and first["sums"]["clipped"] == clipped1 == 0
    assert first["sums"]["loss"] / count1 == pytest.approx(loss1, rel=1e-4, abs=1e-6)
    # Step 2: ratio exp(logp under w1 - logp under w0).
    loss2, clipped2, count2 = _ppo_by_hand(logp1, old, batch, ids2)
    assert second["count"] == count2
    assert 0 < clipped2 < count2  # the clip bites on some tokens, not all
    assert second["sums"]["clipped"] == clipped2
    assert second["sums"]["loss"] / count2 == pytest.approx(loss2, rel=1e-4, abs=1e-6)
    # the metrics of the update
    two = out["two"]
    assert two["train/optimizer_steps"] == 2
    assert two["train/clipfrac"] == pytest.approx(clipped2 / (count1 + count2), rel=1e-9)
    assert two["train/loss"] == pytest.approx((loss1 + loss2) / 2, rel=1e-4, abs=1e-6)
    assert two["train/approx_kl"] > 0 and two["perf/old_logp_time"] > 0
    # each step's gradient is that of its own mini-batch's loss only (the metric: the mean of
    # the steps' norms before clipping)
    norms = [_ppo_grad_norm(tiny_path, w0, old, batch, ids1),
             _ppo_grad_norm(tiny_path, w1, old, batch, ids2)]
    assert two["train/grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-4)

    # One step per rollout: the behaviour policy is the current one, the ratio exactly 1.
    (only,) = out["one_steps"]
    assert only["ids"] == list(range(8)) and only["old"] is None
    one = out["one"]
    assert one["train/optimizer_steps"] == 1
    assert one["train/clipfrac"] == 0.0 and one["train/approx_kl"] == 0.0
    assert one["perf/old_logp_time"] == 0.0
    loss_one, _, _ = _ppo_by_hand(old, old, batch, range(8))  # ratio 1: -mean advantage
    assert one["train/loss"] == pytest.approx(loss_one, rel=1e-5)


def test_all_masked_batch_changes_nothing(steps_out):
    """Every loss mask zero (all stale, or every group dropped): no optimizer step, and every
    parameter and optimizer state tensor stays the same bit for bit (with 2 steps and 1)."""
    out = steps_out
    assert out["masked_steps"] == []  # no forward/backward of a mini-batch at all
    for steps in (2, 1):
        m = out[f"masked_{steps}"]
        assert m["train/optimizer_steps"] == 0 and m["train/loss"] == 0.0
        assert all(np.isfinite(v) for v in m.values())
    (w_before, opt_before), (w_after, opt_after) = out["before"], out["after"]
    assert w_before.keys() == w_after.keys()
    for name in w_before:
        assert np.array_equal(w_before[name], w_after[name]), name
    assert opt_before["state"].keys() == opt_after["state"].keys() and opt_before["state"]
    for i, state in opt_before["state"].items():
        assert state.keys() == opt_after["state"][i].keys()
        for k, v in state.items():
            assert torch.equal(v, opt_after["state"][i][k]), (i, k)
    assert opt_before["param_groups"] == opt_after["param_groups"]


# -- drop_zero_std_groups ---------------------------------------------------------------------
def _drop_worker(rank, world, port, tiny_path, out_dir):
    from rl.algo import LOSS_AGGS
    from rl.learner.learner import Learner
    from rl.rollout.batch import grpo_advantages, zero_std_groups
    from transfer.weights.base import full_tensor

    cfg = compose("cluster.num_learners=1", "algo.micro_batch_size=3")
    learner = Learner(cfg, Runtime("t", out_dir, tiny_path), 0, 1)
    learner.setup("127.0.0.1", port)

    def grads(batch, mode):
        learner.cfg.algo.loss_agg = mode
        learner.optimizer.zero_grad()
        learner.accumulate_grads(batch)
        return {n: full_tensor(p.grad).clone() for n, p in learner.model.named_parameters()}

    out = {}
    for mode in LOSS_AGGS:
        dropped = grouped_batch()
        assert zero_std_groups(dropped, 4, drop=True) == 2
        kept = grouped_batch().select(np.flatnonzero(np.repeat([1, 0, 1, 0], 4)))
        out[mode] = {"dropped": grads(dropped, mode), "without": grads(kept, mode),
                     "not_dropped": grads(grouped_batch(), mode)}
    # every group flat and kept (drop=False): counted, left in the loss, and the step is taken
    learner.cfg.algo.loss_agg = "token_mean"  # the default
    flat = grouped_batch()
    flat.rewards[:] = 0.0
    flat.advantages = grpo_advantages(flat.rewards, 4)
    out["flat_count"] = zero_std_groups(flat, 4, drop=False)
    out["flat_kept"] = learner.train_batch(flat)
    torch.save(out, os.path.join(out_dir, "drop_grads.pt"))
    learner.close()


def test_dropping_flat_groups_equals_training_without_them(ranks, tiny_path, tmp_path):
    """Flat groups dropped give the gradient of the batch without them, in every loss
    aggregation; kept (``drop=False``), they dilute it; a batch of only flat groups kept still
    takes its optimizer step, with a zero gradient (every group dropped, in a whole run:
    tests/integration/test_train.py)."""
    ranks.run(_drop_worker, (1, free_port(), tiny_path, str(tmp_path)))
    g = torch.load(os.path.join(tmp_path, "drop_grads.pt"))
    # all flat, kept: the optimizer step runs, on a gradient that is exactly zero
    assert g.pop("flat_count") == 4
    kept = g.pop("flat_kept")
    assert kept["train/optimizer_steps"] == 1, kept
    assert kept["train/grad_norm"] == 0.0 and kept["train/loss"] == 0.0, kept
    for mode, grads in g.items():
        assert any(v.abs().sum() > 0 for v in grads["without"].values())
        for name in grads["without"]:
            torch.testing.assert_close(grads["dropped"][name], grads["without"][name],
                                       rtol=1e-4, atol=1e-7, msg=f"{mode} {name}")
        # kept in the loss, the flat groups (zero advantage) only dilute the normalisation:
        # the gradient is the same direction, scaled by 8 samples' count / 16 samples' count
        diff = max(float((grads["not_dropped"][n] - grads["without"][n]).abs().max())
                   for n in grads["without"])
        assert diff > 1e-3 * max(float(v.abs().max()) for v in grads["without"].values()), mode


# -- KL penalty and entropy bonus: the learner's gradient against plain autograd ----------------
PENALTY_T = 0.7  # a sampling temperature other than 1: log-probs and entropy are of logits / T

PENALTY_CASES = {"kl_k1": ("algo.kl_coef=0.1", "algo.kl_estimator=k1"),
                 "kl_k3": ("algo.kl_coef=0.1", "algo.kl_estimator=k3"),
                 "entropy": ("algo.entropy_coef=0.01",)}


def _penalty_worker(rank, world, port, tiny_path, out_dir, case):
    import pickle

    from rl.learner.learner import Learner
    from transfer.weights.base import full_tensor

    cfg = compose("cluster.num_learners=1", "algo.micro_batch_size=3", "algo.lr=0.01",
                  f"rollout.temperature={PENALTY_T}", *PENALTY_CASES[case])
    learner = Learner(cfg, Runtime("t", out_dir, tiny_path), 0, 1)
    learner.setup("127.0.0.1", port)
    out = {"initial": learner.full_state(), "has_ref": learner.ref_model is not None}
    # one update first, so the policy is no longer the reference (k3's gradient is 0 there)
    out["first"] = learner.train_batch(make_batch(8, seed=5))
    out["weights"] = learner.full_state()
    learner.optimizer.zero_grad(set_to_none=True)
    out["sums"] = learner.accumulate_grads(make_batch(8, seed=6))
    out["grads"] = {n: full_tensor(p.grad).detach().cpu().clone()
                    for n, p in learner.model.named_parameters()}
    with open(os.path.join(out_dir, "penalty.pkl"), "wb") as f:
        pickle.dump(out, f)
    learner.close()


def _penalty_loss_by_autograd(tiny_path, weights, ref_weights, batch, kl_coef, kl_estimator,
                              entropy_coef) -> tuple[dict, dict]:
    """Gradients at ``weights`` of token-mean policy loss (ratio 1) + ``kl_coef`` * token-mean
    KL estimate against ``ref_weights`` - ``entropy_coef`` * token-mean entropy, each term's
    gradient on its own, computed one unpadded sample at a time with a plain model; and the
    masked sums of the KL estimate and the entropy."""
    model, ref = _plain_model(tiny_path, weights), _plain_model(tiny_path, ref_weights)
    count = sum(int(np.count_nonzero(m)) for m in batch.loss_mask)
    terms = {"policy": 0.0, "kl": 0.0, "entropy": 0.0}
    for i in range(len(batch)):
        p, r = int(batch.prompt_len[i]), int(batch.response_len[i])
        ids = torch.from_numpy(batch.tokens[i].astype(np.int64))
        targets = ids[p:p + r, None]
        m = torch.from_numpy(batch.loss_mask[i].astype(np.float32))
        logp_v = torch.log_softmax(model(input_ids=ids[None]).logits[0, p - 1:p - 1 + r].float()
                                   / PENALTY_T, dim=-1)
        logp = logp_v.gather(-1, targets)[:, 0]
        with torch.no_grad():
            ref_logp = torch.log_softmax(ref(input_ids=ids[None]).logits[0, p - 1:p - 1 + r].float()
                                         / PENALTY_T, dim=-1).gather(-1, targets)[:, 0]
        a = float(batch.advantages[i])
        terms["policy"] = terms["policy"] + (-a * torch.exp(logp - logp.detach()) * m).sum()
        if kl_estimator == "k1":
            kl = logp - ref_logp
        else:  # k3 of KL(policy || ref): r - 1 - log r with r = ref / policy
            kl = torch.exp(ref_logp - logp) - 1 - (ref_logp - logp)
        terms["kl"] = terms["kl"] + (kl * m).sum()
        ent = -(logp_v.exp() * logp_v).sum(-1)
        terms["entropy"] = terms["entropy"] + (ent * (m != 0)).sum()
    sums = {"ref_kl": float(terms["kl"].detach()), "entropy": float(terms["entropy"].detach())}
    coefs = {"policy": 1.0, "kl": kl_coef, "entropy": -entropy_coef}
    grads = {}
    for name, term in terms.items():
        model.zero_grad(set_to_none=True)
        (coefs[name] * term / count).backward(retain_graph=True)
        grads[name] = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                       for n, p in model.named_parameters()}
    return grads, sums


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.reshape(-1).double() for _, g in sorted(grads.items())])


@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_kl_penalty_and_entropy_bonus_gradients_match_plain_autograd(case, ranks, tiny_path, tmp_path):
    """One step, token_mean, 1 rank: the learner's gradient after ``accumulate_grads`` is that
    of policy loss + kl_coef * token-mean KL estimate to the reference (the initial weights)
    - entropy_coef * token-mean entropy of the temperature-scaled distribution at loss
    positions, computed here with plain autograd; and the penalty's own part of it matches."""
    import pickle

    ranks.run(_penalty_worker, (1, free_port(), tiny_path, str(tmp_path), case))
    with open(os.path.join(tmp_path, "penalty.pkl"), "rb") as f:
        out = pickle.load(f)
    kl_coef, entropy_coef = (0.1, 0.0) if case.startswith("kl") else (0.0, 0.01)
    assert out["has_ref"] == (kl_coef > 0)  # a reference model exactly when there is a KL term
    assert out["first"]["train/optimizer_steps"] == 1
    assert any(not np.array_equal(out["initial"][n], out["weights"][n]) for n in out["initial"])
    batch = make_batch(8, seed=6)
    want, sums = _penalty_loss_by_autograd(tiny_path, out["weights"], out["initial"], batch, kl_coef,
                                           case.removeprefix("kl_"), entropy_coef)
    got = out["grads"]
    assert got.keys() == want["policy"].keys()
    # the whole gradient, tensor by tensor
    for name in got:
        total = want["policy"][name] + want["kl"][name] + want["entropy"][name]
        torch.testing.assert_close(got[name], total, rtol=1e-4, atol=1e-7, msg=name)
    # the penalty's part (learner minus the policy term) equals the penalty term's gradient:
    # a dropped coefficient, a flipped sign or the wrong reference shows here at once
    extra = _flat(want["kl"] if kl_coef else want["entropy"])
    got_extra = _flat(got) - _flat(want["policy"])
    assert float(extra.norm()) > 5e-4 * float(_flat(want["policy"]).norm())  # not negligible
    assert float((got_extra - extra).norm()) <= 1e-3 * float(extra.norm()), (
        float((got_extra - extra).norm()), float(extra.norm()))
    # the logged sums: the KL estimate (0 without a reference) and the entropy
    count = sum(int(np.count_nonzero(m)) for m in batch.loss_mask)
    assert out["sums"]["tokens"] == count
    assert out["sums"]["entropy"] == pytest.approx(sums["entropy"], rel=1e-5)
    if kl_coef:
        assert out["sums"]["ref_kl"] == pytest.approx(sums["ref_kl"], rel=1e-4, abs=1e-7)
        if case == "kl_k3":
            assert sums["ref_kl"] > 0
    else:
        assert out["sums"]["ref_kl"] == 0.0


# -- micro-batches by token budget (algo.max_tokens_per_micro_batch) ---------------------------
BUDGET = 48
BUDGET_CFG = ("cluster.num_learners=2", "algo.micro_batch_size=3", "rollout.max_prompt_tokens=4",
              "rollout.max_new_tokens=40", f"algo.max_tokens_per_micro_batch={BUDGET}")


def _uneven_part(rank: int):
    """Partitions of very different lengths: rank 0 gets 8 samples of 3-10 tokens (two
    micro-batches within the budget), rank 1 8 samples of 22-44 tokens (one or two a pass)."""
    return make_batch(8, seed=20) if rank == 0 else make_batch(8, seed=21, response=(20, 40))


def _budget_worker(rank, world, port, tiny_path, out_dir):
    """On the uneven partitions, each computation twice, with fixed-size micro-batches and with
    token-budget ones at the same weights: the gradient under every ``algo.loss_agg``; then
    ``train_batch`` with two steps per rollout whose behaviour log-probs and both steps'
    gradients are computed both ways (the budget's go on to the optimizer); then one step
    each way for the padding metrics."""
    import pickle

    from rl.algo import LOSS_AGGS
    from rl.learner.learner import Learner
    from transfer.weights.base import full_tensor

    cfg = compose(*BUDGET_CFG, "algo.steps_per_rollout=2", "algo.lr=0.01")
    learner = Learner(cfg, Runtime("t", out_dir, tiny_path), rank, world)
    learner.setup("127.0.0.1", port)
    a = learner.cfg.algo
    inner_old, inner_acc = learner.behaviour_logprobs, learner.accumulate_grads

    def both(fn) -> tuple:
        """``fn()`` with fixed-size micro-batches, then with the token budget (left on)."""
        out = []
        for budget in (0, BUDGET):
            a.max_tokens_per_micro_batch = budget
            out.append(fn())
        return tuple(out)

    def accumulate(mini, old=None, count=None):
        learner.optimizer.zero_grad(set_to_none=True)
        sums = inner_acc(mini, old, count)
        return sums, {n: full_tensor(p.grad).clone() for n, p in learner.model.named_parameters()}

    part = _uneven_part(rank)
    out = {}
    for mode in LOSS_AGGS:
        a.loss_agg = mode
        out[mode] = both(lambda: accumulate(part))
    a.loss_agg = "token_mean"

    out["old"], out["steps"] = [], []

    def old_spy(batch):
        pair = both(lambda: inner_old(batch))
        out["old"].append(pair)
        return pair[1]

    def acc_spy(mini, old_mini=None, count=None):
        pair = both(lambda: accumulate(mini, old_mini, count))
        out["steps"].append(tuple((dict(sums), g) for sums, g in pair))  # train_batch edits its sums
        return pair[1][0]  # the budget's sums; its gradient is what .grad holds now

    learner.behaviour_logprobs, learner.accumulate_grads = old_spy, acc_spy
    out["two_steps"] = learner.train_batch(part)
    learner.behaviour_logprobs, learner.accumulate_grads = inner_old, inner_acc
    a.steps_per_rollout = 1
    out["metrics"] = both(lambda: learner.train_batch(part))
    with open(os.path.join(out_dir, f"budget_{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    learner.close()


@pytest.fixture(scope="module")
def budget_out(ranks, tiny_path, tmp_path_factory) -> list[dict]:
    """What ``_budget_worker`` recorded on each of the two ranks."""
    import pickle

    out_dir = str(tmp_path_factory.mktemp("budget"))
    ranks.run(_budget_worker, (2, free_port(), tiny_path, out_dir), nprocs=2)
    out = []
    for rank in (0, 1):
        with open(os.path.join(out_dir, f"budget_{rank}.pkl"), "rb") as f:
            out.append(pickle.load(f))
    return out


def _assert_same_grads(fixed: dict, budget: dict, what: str) -> None:
    assert fixed.keys() == budget.keys()
    assert any(float(g.abs().max()) > 0 for g in fixed.values()), what
    for name in fixed:
        torch.testing.assert_close(budget[name], fixed[name], rtol=1e-4, atol=1e-6, msg=f"{what} {name}")


def test_token_budget_micro_batches_give_the_gradient_of_fixed_size_ones(budget_out):
    """Sorted and packed within the budget instead of 3 samples in order: the same gradient
    under every loss aggregation (the aggregation divides by a count of the whole mini-batch,
    so only the grouping changes), the same loss and tokens, fewer padded slots."""
    from rl.algo import LOSS_AGGS

    for mode in LOSS_AGGS:
        (fixed_sums, fixed), (budget_sums, budget) = budget_out[0][mode]
        _assert_same_grads(fixed, budget, mode)
        assert budget_sums["loss"] == pytest.approx(fixed_sums["loss"], rel=1e-5, abs=1e-7), mode
        assert budget_sums["tokens"] == fixed_sums["tokens"]
        assert fixed_sums["micro_batches"] == 3  # 8 samples by 3
        assert budget_sums["pad_slots"] < fixed_sums["pad_slots"]


def test_token_budget_with_several_steps_per_rollout(budget_out):
    """``algo.steps_per_rollout=2``: the behaviour log-probs (one pass over the partition,
    grouped by length and put back in sample order) and each step's gradient, the second one
    against those log-probs after the first step moved the weights, equal the fixed-size ones."""
    for rank in (0, 1):
        out = budget_out[rank]
        [(fixed_old, budget_old)] = out["old"]
        np.testing.assert_array_equal(budget_old.offsets, fixed_old.offsets)
        np.testing.assert_allclose(budget_old.values, fixed_old.values, rtol=0, atol=2e-6)
        assert len(out["steps"]) == 2 and out["two_steps"]["train/optimizer_steps"] == 2
        for i, ((fixed_sums, fixed), (budget_sums, budget)) in enumerate(out["steps"]):
            _assert_same_grads(fixed, budget, f"rank {rank} step {i}")
            for k in ("loss", "clipped", "approx_kl"):
                assert budget_sums[k] == pytest.approx(fixed_sums[k], rel=1e-4, abs=1e-7), (rank, i, k)
        assert out["steps"][1][1][0]["approx_kl"] > 0  # the second step's ratio is not 1


def test_uneven_partitions_run_as_many_passes_on_every_rank(budget_out):
    """Rank 0's short samples fit in fewer micro-batches than rank 1's long ones; rank 0
    splits its own until both run as many passes (no hang in FSDP's collectives), and the
    metrics count the passes and the padding of both ranks."""
    from rl.learner.micro_batches import by_token_budget, fixed_size, padded_slots, split_to

    lengths = [_uneven_part(r).tokens.lengths for r in (0, 1)]
    formed = [len(by_token_budget(n, BUDGET)) for n in lengths]
    assert formed[0] < formed[1] - 3, formed  # very different
    for mode in ("token_mean", "seq_mean_token_mean"):
        ran = [budget_out[r][mode][1][0]["micro_batches"] for r in (0, 1)]
        assert ran == [formed[1], formed[1]], (mode, ran)
    # train_batch's metrics, one step: fixed-size micro-batches, then by the token budget
    fixed, budget = budget_out[0]["metrics"]
    for mine, theirs in zip((fixed, budget), budget_out[1]["metrics"]):  # reduced over both ranks
        for k in ("train/pad_frac", "train/micro_batches", "train/loss"):
            assert theirs[k] == pytest.approx(mine[k]), k
    real = sum(int(n.sum()) for n in lengths)
    fixed_slots = sum(padded_slots(fixed_size(8, 3), n) for n in lengths)
    budget_slots = sum(padded_slots(split_to(by_token_budget(n, BUDGET), n, formed[1]), n) for n in lengths)
    assert fixed["train/micro_batches"] == 3 and budget["train/micro_batches"] == formed[1]
    assert fixed["train/pad_frac"] == pytest.approx(1 - real / fixed_slots)
    assert budget["train/pad_frac"] == pytest.approx(1 - real / budget_slots)
    assert budget["train/pad_frac"] < fixed["train/pad_frac"]
    assert budget["train/loss"] == pytest.approx(fixed["train/loss"], rel=1e-4)
