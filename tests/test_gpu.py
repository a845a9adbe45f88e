"""GPU checks (marked ``gpu``): skipped on machines without CUDA; run them where a GPU is."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from rl.runtime import Runtime
from tests.conftest import compose
from tests.test_learner import make_batch
from transfer.weights.group import free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_fsdp2_step_over_nccl(tiny_path, tmp_path):
    from rl.learner.learner import Learner

    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    learner = Learner(compose("cluster.gpus_per_learner=1", "cluster.num_learners=1"),
                      Runtime("gpu", str(tmp_path), tiny_path), 0, 1)
    learner.setup("127.0.0.1", free_port())
    try:
        metrics = learner.train_batch(make_batch(16))
        assert torch.isfinite(torch.tensor(metrics["train/loss"]))
        assert metrics["train/grad_norm"] > 0
        assert next(learner.model.parameters()).is_cuda
    finally:
        learner.close()


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
