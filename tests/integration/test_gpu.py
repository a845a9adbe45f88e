"""GPU checks (marked ``gpu``): skipped on machines without CUDA; run them where a GPU is
(``scripts/gpu_check.sh`` on a machine with torch and transformers only).

- A learner step on CUDA (NCCL) is compared with the same step on the CPU (gloo); the
  comparison itself also runs on every machine, between a one-rank and a two-rank gloo step.
- The real ``Learner`` trains a few steps over NCCL on one GPU (world size 1) with mixed
  precision, through ``train`` and so through every metric reduction, then pushes its
  weights to a receiver that joins the side group as SGLang does and writes its Hugging Face
  export (``save_hf``); the same harness runs on the CPU over gloo in every suite, so that a
  GPU run tests the device, not the harness.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from rl.runtime import Runtime
from rl.types import RolloutRef
from tests.support.batches import make_batch
from tests.support.env import compose
from transfer.data.base import Ragged, StoreRef
from transfer.net import free_port

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TIMING = ("train/tokens_per_s", "perf/", "train/micro_batches", "train/pad_frac")
"""Metrics that measure time, or describe each rank's micro-batches (their count and padding),
not the update."""


def _step_worker(rank: int, world: int, port: int, device: str, tiny_path: str, out: str,
                 overrides: tuple[str, ...] = ()) -> None:
    """One ``train_batch`` of ``world`` learner ranks on ``device`` over a fixed batch (each
    rank its half); rank 0 saves the metrics, and every parameter before and after the step
    and its gradient, whole, on the CPU."""
    from rl.learner.learner import Learner
    from transfer.weights.base import full_tensor

    on_gpu = device == "cuda"
    if on_gpu:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    cfg = compose(f"cluster.num_learners={world}", f"cluster.gpus_per_learner={int(on_gpu)}",
                  "algo.micro_batch_size=3", *overrides)
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


def learner_step(device: str, world: int, tiny_path: str, out_dir, overrides: tuple[str, ...] = ()) -> dict:
    out = os.path.join(str(out_dir), f"step_{device}_{world}_{len(overrides)}.pt")
    mp.start_processes(_step_worker, args=(world, free_port(), device, tiny_path, out, overrides),
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


BUDGET_AND_MASK = ("rollout.max_prompt_tokens=4", "rollout.max_new_tokens=6",
                   "algo.max_tokens_per_micro_batch=24", "algo.is_mask=token", "algo.is_mask_low=0.4",
                   "algo.is_mask_high=2", "algo.tis_cap=0.5")
"""Token-budget micro-batches (their pass count max-reduced across ranks) and masked, truncated
importance sampling (its statistics sum- and max-reduced): more collectives on the device."""


@gpu
@needs_cuda
def test_fsdp2_step_with_token_budget_and_is_mask_over_nccl_matches_gloo(tiny_path, tmp_path):
    got = learner_step("cuda", 1, tiny_path, tmp_path, BUDGET_AND_MASK)
    want = learner_step("cpu", 1, tiny_path, tmp_path, BUDGET_AND_MASK)
    m = want["metrics"]  # the paths under test were taken
    assert m["train/micro_batches"] > 1 and m["train/is_truncated_frac"] > 0
    assert 0 < m["train/is_masked_frac"] < 1
    assert_same_step(got, want, "token budget + is_mask: nccl (CUDA) vs gloo (CPU)")


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


# -- the real Learner: train over its device's backend, then push to a receiver -------------
class MemoryStore:
    """A rollout store in the learner's own process: ``get`` returns the columns it holds."""

    def __init__(self, columns: dict) -> None:
        self.columns = columns
        self.get_timings_ms = {"fetch_ms": 0.0}

    def get(self, ref: StoreRef) -> dict:
        self.get_timings_ms = {"fetch_ms": 0.1}
        return {k: list(v) if isinstance(v, list) else v.take(range(len(v))) if isinstance(v, Ragged)
                else v.copy() for k, v in self.columns.items()}

    def close(self) -> None:
        pass


def _receiver(conn, device: str) -> None:
    """An engine's weight-update side, as SGLang's: join the group at ``rank_offset``, then
    per update receive each named tensor by ``broadcast`` from rank 0, in order."""
    from transfer.weights.group import init_side_group

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    group, held, version = None, {}, "initial"
    while (msg := conn.recv()) is not None:
        op, args = msg
        try:
            reply = None
            if op == "init_weights_update_group":
                address, port, offset, world, name, backend = args
                group = init_side_group(backend=backend, master_address=address, master_port=port,
                                        rank=offset, world_size=world, group_name=name, timeout_s=120)
            elif op == "update_weights_from_distributed":
                names, dtypes, shapes, _, version = args
                for name, dtype, shape in zip(names, dtypes, shapes):
                    held[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                    group.broadcast(held[name], src=0)
            elif op == "get_weight_version":
                reply = version
            elif op == "held":
                reply = {n: t.cpu() for n, t in held.items()}
            elif op == "destroy_weights_update_group":
                group.destroy()
            conn.send(("ok", reply))
        except BaseException as e:  # noqa: BLE001 - the sender raises it with the engine's name
            conn.send(("error", repr(e)))


class PipeReceiver:
    """``WeightReceiver`` over a pipe to ``_receiver`` in a process of its own."""

    name, num_ranks = "pipe-engine", 1

    def __init__(self, conn) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def _call(self, op: str, *args):
        with self.lock:
            self.conn.send((op, args))
            status, reply = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name}: {op} failed: {reply}")
        return reply

    def init_weights_update_group(self, *args) -> None:
        self._call("init_weights_update_group", *args)

    def begin_weight_update(self) -> None:
        self._call("begin_weight_update")

    def update_weights_from_distributed(self, *args) -> None:
        self._call("update_weights_from_distributed", *args)

    def end_weight_update(self) -> None:
        self._call("end_weight_update")

    def get_weight_version(self) -> str:
        return self._call("get_weight_version")

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("destroy_weights_update_group", group_name)


def _learner_push_worker(device: str, backend: str, tiny_path: str, out: str, conn) -> None:
    from rl.learner.learner import Learner
    from transfer.weights.base import full_tensor

    on_gpu = device == "cuda"
    cfg = compose("cluster.num_learners=1", f"cluster.gpus_per_learner={int(on_gpu)}",
                  "model.dtype=bfloat16", f"weights.backend={backend}", "weights.bucket_bytes=64kb",
                  "algo.micro_batch_size=4", "algo.lr=1e-4")
    learner = Learner(cfg, Runtime("gpu", os.path.dirname(out), tiny_path), 0, 1)
    learner.setup("127.0.0.1", free_port())
    receiver = PipeReceiver(conn)
    try:
        batch = make_batch(16)
        learner.store = MemoryStore(batch.to_columns())
        ref = RolloutRef(step=0, partitions=[StoreRef("k", "memory", 1 << 10)], num_samples=len(batch),
                         num_loss_tokens=batch.num_loss_tokens)
        before = {n: full_tensor(p).cpu().clone() for n, p in learner.model.named_parameters()}
        metrics = [learner.train(ref) for _ in range(3)]  # every reduction, over NCCL on a GPU
        learner.connect_engines([receiver])
        learner.push_weights(version=3)
        state = {n: full_tensor(p).cpu().clone() for n, p in learner.model.named_parameters()}
        hf = os.path.join(os.path.dirname(out), f"hf_{device}")
        learner.save_hf(hf)  # gathered on the learner's device, written from the CPU
        torch.save({"metrics": metrics, "before": before, "state": state,
                    "hf": load_file(os.path.join(hf, "model.safetensors")),
                    "devices": {p.device.type for p in learner.model.parameters()},
                    "held": receiver._call("held"), "version": receiver.get_weight_version()}, out)
    finally:
        learner.close()
        conn.send(None)


def learner_push(device: str, receiver_device: str, backend: str, tiny_path: str, out_dir) -> dict:
    out = os.path.join(str(out_dir), f"push_{device}_{backend}.pt")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    procs = [ctx.Process(target=_receiver, args=(there, receiver_device)),
             ctx.Process(target=_learner_push_worker, args=(device, backend, tiny_path, out, here))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], f"receiver, learner exit codes: {codes}"
    return torch.load(out, weights_only=False)


def assert_trained_and_pushed(got: dict, device: str) -> None:
    """Three steps ran with finite metrics, the float32 master weights moved, and the
    receiver holds them rounded to bfloat16, bit for bit, under the pushed version."""
    assert got["devices"] == {device}
    for m in got["metrics"]:
        assert m["train/samples"] == 16 and m["train/optimizer_steps"] == 1, m
        assert all(v == v and abs(v) != float("inf") for v in m.values()), m  # finite
        assert m["transfer/fetch_ms"] == pytest.approx(0.1)
    assert {t.dtype for t in got["state"].values()} == {torch.float32}
    assert any(not torch.equal(got["state"][n], got["before"][n]) for n in got["state"])
    assert got["version"] == "3" and got["held"].keys() == got["state"].keys()
    for name, t in got["state"].items():
        assert got["held"][name].dtype == torch.bfloat16, name
        assert torch.equal(got["held"][name], t.to(torch.bfloat16)), name
    # the Hugging Face export holds what the engines got: model.dtype, bit for bit
    assert got["hf"].keys() == got["state"].keys()
    assert all(torch.equal(got["hf"][n], got["held"][n]) for n in got["hf"])


def test_real_learner_trains_with_mixed_precision_and_pushes_over_gloo(tiny_path, tmp_path):
    """The GPU check below, on the CPU: the harness and the learner's path, over gloo."""
    assert_trained_and_pushed(learner_push("cpu", "cpu", "gloo", tiny_path, tmp_path), "cpu")


@gpu
@needs_cuda
def test_real_learner_trains_on_one_gpu_over_nccl_and_pushes_its_weights(tiny_path, tmp_path):
    """World size 1 over NCCL: every metric reduction and FSDP2's collectives on CUDA. The
    push: over NCCL to a receiver on a second GPU where there is one (NCCL takes one GPU per
    rank), else over gloo, the sender's CUDA tensors to a receiver on the CPU."""
    two = torch.cuda.device_count() >= 2
    got = learner_push("cuda", "cuda:1" if two else "cpu", "nccl" if two else "gloo", tiny_path, tmp_path)
    assert_trained_and_pushed(got, "cuda")
