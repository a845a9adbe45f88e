"""GPU checks (marked ``gpu``): skipped on machines without CUDA; run them where a GPU is.

A learner step on CUDA (NCCL) is compared with the same step on the CPU (gloo); the
comparison itself also runs on every machine, between a one-rank and a two-rank gloo step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from rl.runtime import Runtime
from tests.conftest import compose
from tests.test_learner import make_batch
from transfer.net import free_port

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TIMING = ("train/tokens_per_s", "perf/")  # metrics that measure time, not the update


def _step_worker(rank: int, world: int, port: int, device: str, tiny_path: str, out: str) -> None:
    """One ``train_batch`` of ``world`` learner ranks on ``device`` over a fixed batch (each
    rank its half); rank 0 saves the metrics, and every parameter before and after the step
    and its gradient, whole, on the CPU."""
    from rl.learner.learner import Learner
    from transfer.weights.base import full_tensor

    on_gpu = device == "cuda"
    if on_gpu:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    cfg = compose(f"cluster.num_learners={world}", f"cluster.gpus_per_learner={int(on_gpu)}",
                  "algo.micro_batch_size=3")
    learner = Learner(cfg, Runtime("step", os.path.dirname(out), tiny_path), rank, world)
    learner.setup("127.0.0.1", port)
    try:
        params = lambda: {n: full_tensor(p).detach().cpu().clone()  # noqa: E731
                          for n, p in learner.model.named_parameters()}
        before = params()
        batch = make_batch(16)
        metrics = learner.train_batch(batch.select(range(rank * 16 // world, (rank + 1) * 16 // world)))
        grads = {n: full_tensor(p.grad).detach().cpu().clone() for n, p in learner.model.named_parameters()}
        after = params()
        assert next(learner.model.parameters()).device.type == device
        if rank == 0:
            torch.save({"metrics": metrics, "before": before, "grads": grads, "after": after,
                        "lr": cfg.algo.lr}, out)
    finally:
        learner.close()


def learner_step(device: str, world: int, tiny_path: str, out_dir) -> dict:
    out = os.path.join(str(out_dir), f"step_{device}_{world}.pt")
    mp.start_processes(_step_worker, args=(world, free_port(), device, tiny_path, out),
                       nprocs=world, join=True, start_method="spawn")
    return torch.load(out, weights_only=False)


def assert_same_step(got: dict, want: dict, what: str) -> None:
    """The same update up to float rounding: metrics, every gradient, and every parameter's
    change. AdamW's first step moves a parameter by lr * g / (|g| + eps), about +-lr, so
    its change is compared where |g| is well above rounding (elsewhere: at most lr)."""
    keys = sorted(k for k in want["metrics"] if not k.startswith(TIMING))
    assert keys == sorted(k for k in got["metrics"] if not k.startswith(TIMING)), what
    for k in keys:
        assert got["metrics"][k] == pytest.approx(want["metrics"][k], rel=1e-4, abs=1e-7), (what, k)
    assert want["metrics"]["train/grad_norm"] > 0
    lr = want["lr"]
    for name, g in want["grads"].items():
        torch.testing.assert_close(got["before"][name], want["before"][name], rtol=0, atol=0,
                                   msg=f"{what}: {name} before the step")
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6,
                                   msg=f"{what}: gradient of {name}")
        moved_got = got["after"][name] - got["before"][name]
        moved_want = want["after"][name] - want["before"][name]
        sure = g.abs() > 1e-6
        torch.testing.assert_close(moved_got[sure], moved_want[sure], rtol=1e-3, atol=lr * 1e-3,
                                   msg=f"{what}: update of {name}")
        assert moved_got.abs().max() <= lr * 1.01, (what, name)
    assert any((want["after"][n] != want["before"][n]).any() for n in want["grads"])  # it moved


def test_fsdp2_step_over_gloo_matches_one_rank(tiny_path, tmp_path):
    """The comparison the CUDA check below uses, on the CPU: two FSDP2 ranks make the step
    one rank makes."""
    assert_same_step(learner_step("cpu", 2, tiny_path, tmp_path),
                     learner_step("cpu", 1, tiny_path, tmp_path), "gloo 2 ranks vs 1 rank")


@gpu
@needs_cuda
def test_fsdp2_step_over_nccl_matches_gloo(tiny_path, tmp_path):
    assert_same_step(learner_step("cuda", 1, tiny_path, tmp_path),
                     learner_step("cpu", 1, tiny_path, tmp_path), "nccl (CUDA) vs gloo (CPU)")


@gpu
@needs_cuda
def test_cpu_engine_on_cuda_logprobs_match_a_forward_pass(tiny_path):
    from rl.model import eos_token_ids, load_model, load_tokenizer
    from rl.rollout.engines.hf_engine import GenRequest, HFEngine

    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path, device="cuda")
    engine = HFEngine(model, tok, eos_token_ids(tiny_path, tok), device="cuda")
    prompt = tok.encode("ab:")
    res = engine.generate([GenRequest(prompt, max_new_tokens=6, ignore_eos=True)])[0]
    ids = torch.tensor([prompt + res.output_ids], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(res.logprobs, device="cuda"), want, atol=1e-4, rtol=1e-4)


def _nccl_receiver(port: int, tiny_path: str, out: str) -> None:
    from rl.model import load_model
    from transfer.weights.group import init_side_group

    torch.cuda.set_device(1)
    model = load_model(tiny_path, device="cuda:1")
    group = init_side_group(backend="nccl", master_address="127.0.0.1", master_port=port, rank=1,
                            world_size=2, group_name="g", timeout_s=60)
    for _, p in model.named_parameters():
        buf = torch.empty_like(p)
        group.broadcast(buf, src=0)
        p.data.copy_(buf)
    torch.save({n: p.cpu() for n, p in model.named_parameters()}, out)


@gpu
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_weight_broadcast_into_a_cuda_model(tiny_path, tmp_path):
    from rl.model import load_model
    from transfer.weights.group import init_side_group

    port, out = free_port(), str(tmp_path / "recv.pt")
    proc = mp.get_context("spawn").Process(target=_nccl_receiver, args=(port, tiny_path, out))
    proc.start()
    torch.cuda.set_device(0)
    model = load_model(tiny_path, device="cuda:0")
    torch.manual_seed(0)
    new = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    group = init_side_group(backend="nccl", master_address="127.0.0.1", master_port=port, rank=0,
                            world_size=2, group_name="g", timeout_s=60)
    for n in new:
        group.broadcast(new[n], src=0)
    proc.join(120)
    got = torch.load(out)
    for n, t in new.items():
        assert torch.equal(got[n], t.cpu()), n
