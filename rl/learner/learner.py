"""One learner rank: FSDP2 policy, GRPO update on its partition, weight push, checkpoints.

A plain class (``rl.cluster`` makes it a Ray actor). All ranks call the same methods in
the same order: ``setup`` -> (``train`` -> ``push_weights``)* -> ``close``.
"""

from __future__ import annotations

import datetime
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from rl.algo import kl_k3, policy_loss, token_logprobs
from rl.config import Config
from rl.learner import checkpoint
from rl.model import load_model, load_tokenizer
from rl.runtime import Runtime, node_ip
from rl.types import RolloutBatch, RolloutRef, fresh


class Learner:
    def __init__(self, cfg: Config, runtime: Runtime, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.rank = rank
        self.world_size = world_size
        self.on_gpu = cfg.cluster.gpus_per_learner > 0
        torch.set_num_threads(cfg.cluster.torch_threads)

    # -- setup -------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """(node IP, a free port) for the rank-0 rendezvous."""
        from transfer.weights.group import free_port

        return node_ip(), free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        cfg = self.cfg
        if self.on_gpu:
            torch.cuda.set_device(0)  # Ray exposes one GPU per learner as cuda:0
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group("nccl" if self.on_gpu else "gloo",
                                init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=cfg.weights.timeout_s * 5))
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        torch.manual_seed(cfg.seed)

        def sharded(model):
            layer_types = tuple(getattr(model, "_no_split_modules", None) or ())
            for module in model.modules():
                if type(module).__name__ in layer_types:
                    fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model

        self.model = sharded(load_model(self.runtime.model_path, cfg.model.dtype, self.device))
        self.model.train()
        self.ref_model = None
        if cfg.algo.kl_coef > 0:
            self.ref_model = sharded(load_model(self.runtime.model_path, cfg.model.dtype, self.device))
            self.ref_model.requires_grad_(False)
        a = cfg.algo
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr,
                                           betas=(a.adam_beta1, a.adam_beta2),
                                           weight_decay=a.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.pad_id = load_tokenizer(self.runtime.model_path).pad_token_id or 0
        ips: list = [None] * self.world_size
        dist.all_gather_object(ips, node_ip())
        self.local_rank = ips[:self.rank].count(ips[self.rank])
        self.store = None
        self._weight_sync = None

    def connect_store(self) -> None:
        """Open this rank's store client; local rank 0 of each node lends the node's segment."""
        self.store = self.cfg.transfer.build(self.runtime, role="consumer",
                                             contribute_segment=self.local_rank == 0)

    @property
    def weight_sync(self):
        if self._weight_sync is None:
            self._weight_sync = self.cfg.weights.build(
                rank=self.rank, world_size=self.world_size, master_address=node_ip(),
                on_gpu=self.on_gpu, device=str(self.device))
        return self._weight_sync

    def _lr_factor(self, step: int) -> float:
        a = self.cfg.algo
        if a.warmup_steps and step < a.warmup_steps:
            return (step + 1) / a.warmup_steps
        if a.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - a.warmup_steps) / max(1, self.cfg.num_steps - a.warmup_steps))
        return a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    # -- training ----------------------------------------------------------------------
    def train(self, ref: RolloutRef) -> dict[str, float]:
        started = time.time()
        t0 = time.perf_counter()
        part = ref.partitions[self.rank]
        columns = self.store.get(part)
        get_s = time.perf_counter() - t0
        batch = RolloutBatch.from_columns(columns)
        keep = mask_stale(batch, ref.min_version)
        metrics = self.train_batch(batch)
        trained = torch.tensor([float(keep.sum())], dtype=torch.float64)
        dist.all_reduce(trained)
        metrics["train/samples"] = float(trained)
        # Slowest rank's GET, and all ranks' bytes: the step waits for the slowest reader.
        get_ms = torch.tensor([get_s * 1e3], dtype=torch.float64)
        dist.all_reduce(get_ms, op=dist.ReduceOp.MAX)
        metrics["transfer/get_ms"] = float(get_ms)
        metrics["transfer/get_gbps"] = sum(p.nbytes for p in ref.partitions) / 1e9 / max(
            float(get_ms) / 1e3, 1e-9)  # GB/s of payload
        decode = getattr(self.store, "last_decode_ms", 0.0)
        metrics["transfer/decode_ms"] = float(decode)
        metrics["train/step_time"] = time.perf_counter() - t0
        metrics["train/started_at"], metrics["train/finished_at"] = started, time.time()
        return metrics

    def train_batch(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on this rank's partition (all ranks call it together)."""
        a = self.cfg.algo
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        sums, global_tokens = self.accumulate_grads(batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        packed = torch.tensor(list(sums.values()), dtype=torch.float64)
        dist.all_reduce(packed)
        totals = dict(zip(sums, packed.tolist()))
        tok = max(global_tokens, 1.0)
        kl = totals["ref_kl"] if self.ref_model is not None else totals["approx_kl"]
        return {
            "train/loss": totals["loss"] / tok,
            "train/clipfrac": totals["clipped"] / tok,
            "train/kl": kl / tok,
            "train/logp_diff": totals["logp_diff"] / tok,
            "train/tis_mean": totals["tis_mean"] / tok,
            "train/grad_norm": grad_norm,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/tokens_per_s": tok / max(time.perf_counter() - t0, 1e-9),
        }

    def accumulate_grads(self, batch: RolloutBatch) -> tuple[dict[str, float], float]:
        """Forward/backward over micro-batches; gradients end up equal to those of
        (sum of token losses over all ranks) / (their token count). Returns this rank's
        loss statistics (sums over its tokens) and the global token count."""
        a, T = self.cfg.algo, self.cfg.rollout.temperature
        n, mbs = len(batch), a.micro_batch_size
        global_tokens = torch.tensor(float(batch.num_loss_tokens), dtype=torch.float64)
        dist.all_reduce(global_tokens)
        scale = self.world_size / max(float(global_tokens), 1.0)  # FSDP averages over ranks
        clip_high = a.clip_eps_high if a.clip_eps_high is not None else a.clip_eps
        sums = dict.fromkeys(("loss", "clipped", "approx_kl", "ref_kl", "logp_diff", "tis_mean"), 0.0)
        for start in range(0, n, mbs):
            mb = self._pack(batch.select(range(start, min(start + mbs, n))))
            logits = self.model(input_ids=mb["ids"], attention_mask=mb["attn"]).logits
            logp_bt = token_logprobs(logits[:, :-1], mb["ids"][:, 1:], T)
            mask_bt = mb["mask"]
            # One update per batch: the behaviour policy is the current one (ratio = 1).
            # Samples from older weights (async) can be reweighted by the truncated
            # importance ratio current/engine, computed from the engines' log-probs.
            weight_bt = mask_bt
            if a.tis_cap > 0:
                tis_bt = torch.exp(logp_bt.detach() - mb["rollout_logp"]).clamp(max=a.tis_cap)
                weight_bt = mask_bt * tis_bt
                sums["tis_mean"] += float((tis_bt * mask_bt).sum())
            loss, stats = policy_loss(logp_bt, logp_bt.detach(), mb["adv"], weight_bt,
                                      a.clip_eps, clip_high)
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logits = self.ref_model(input_ids=mb["ids"], attention_mask=mb["attn"]).logits
                    ref_bt = token_logprobs(ref_logits[:, :-1], mb["ids"][:, 1:], T)
                kl = kl_k3(logp_bt, ref_bt, mask_bt)
                loss = loss + a.kl_coef * kl
                sums["ref_kl"] += float(kl.detach())
            (loss * scale).backward()
            sums["loss"] += float(loss.detach())
            sums["clipped"] += float(stats["clipped"])
            sums["approx_kl"] += float(stats["approx_kl"])
            sums["logp_diff"] += float(((logp_bt.detach() - mb["rollout_logp"]).abs() * mask_bt).sum())
        return sums, float(global_tokens)

    def _pack(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """Right-pad a micro-batch. Token ids stay exactly as sampled; pad positions and
        everything past a sample's response are masked out, so their ids never matter."""
        B = len(batch)
        L = max(len(t) for t in batch.tokens)
        ids = np.full((B, L), self.pad_id, dtype=np.int64)
        attn = np.zeros((B, L), dtype=np.int64)
        mask = np.zeros((B, L - 1), dtype=np.float32)  # position t predicts token t + 1
        rollout_logp = np.zeros((B, L - 1), dtype=np.float32)
        for i in range(B):
            tok, p, r = batch.tokens[i], int(batch.prompt_len[i]), int(batch.response_len[i])
            ids[i, :len(tok)] = tok
            attn[i, :len(tok)] = 1
            mask[i, p - 1:p - 1 + r] = batch.loss_mask[i]
            rollout_logp[i, p - 1:p - 1 + r] = batch.rollout_logprobs[i]
        dev = self.device
        return {"ids": torch.from_numpy(ids).to(dev), "attn": torch.from_numpy(attn).to(dev),
                "mask": torch.from_numpy(mask).to(dev),
                "rollout_logp": torch.from_numpy(rollout_logp).to(dev),
                "adv": torch.from_numpy(np.asarray(batch.advantages, dtype=np.float32)).to(dev)}

    # -- weights -----------------------------------------------------------------------
    def connect_engines(self, receivers: list) -> None:
        self.weight_sync.connect(receivers)

    def push_weights(self, version: int) -> dict[str, float]:
        return self.weight_sync.push(self.model.named_parameters(), version)

    def full_state(self) -> dict[str, np.ndarray] | None:
        """Every parameter as a whole numpy array (rank 0; a collective on all ranks)."""
        from transfer.weights.base import full_tensor

        out = {n: full_tensor(p).cpu().numpy().copy() for n, p in self.model.named_parameters()}
        return out if self.rank == 0 else None

    # -- checkpoints -------------------------------------------------------------------
    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        checkpoint.save_learner(path, self.model, self.optimizer, self.scheduler)

    def load(self, path: str) -> None:
        checkpoint.load_learner(path, self.model, self.optimizer, self.scheduler)

    def close(self) -> None:
        try:
            for part in (self._weight_sync, self.store):
                if part is not None:
                    part.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def mask_stale(batch: RolloutBatch, min_version: int | None) -> np.ndarray:
    """Zero the loss mask of samples generated by weights older than ``min_version`` (async
    staleness bound); returns which samples are kept. Masked, not removed: every rank still
    runs the same micro-batches, as FSDP's collectives require."""
    keep = fresh(batch.weight_version, min_version)
    for i in np.flatnonzero(~keep):
        batch.loss_mask[i] = np.zeros_like(batch.loss_mask[i])
    return keep
