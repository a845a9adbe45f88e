"""One learner rank: FSDP2 policy, GRPO update on its partition, weight push, checkpoints.

A plain class, built in its own process by the Ray actor ``rl.learner.actor.LearnerActor``.
All ranks call the same methods in the same order: ``setup`` -> (``train`` ->
``push_weights``)* -> ``close``.
"""

from __future__ import annotations

import datetime
import math
import os
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rl.algo import (agg_count, agg_sum, effective_sample_size, entropy_bt, is_keep_bt, is_log_ratio_bt,
                     is_stat_sums, is_weight_bt, kl_penalty_bt, policy_loss_bt, token_logprobs)
from rl.backends import data_path, weight_path
from rl.config import Config
from rl.learner import checkpoint, export_hf
from rl.learner.micro_batches import by_token_budget, fixed_size, split_to
from rl.model import load_model, load_tokenizer
from rl.runtime import Runtime, node_ip
from rl.types import RolloutBatch, RolloutRef, fresh
from transfer.data.base import Ragged
from transfer.net import free_port
from transfer.weights.base import full_tensor

SUM_KEYS = ("loss", "clipped", "approx_kl", "ref_kl", "entropy", "logp_diff", "tis_mean", "tokens",
            "is_w", "is_w2", "is_n", "is_truncated", "is_masked", "engine_kl", "slots", "pad_slots",
            "micro_batches")
"""What ``accumulate_grads`` sums over micro-batches (and ``train_batch`` over steps and ranks);
``is_max`` beside them is a max."""


class Learner:
    def __init__(self, cfg: Config, runtime: Runtime, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.rank = rank
        self.world_size = world_size
        self.on_gpu = cfg.cluster.gpus_per_learner > 0
        torch.set_num_threads(cfg.cluster.torch_threads)
        # The LR schedule counts rollouts, those that take no optimizer step too (every group
        # flat or stale): torch warns about exactly that when the first rollout takes none.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")

    # -- setup -------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """(node IP, a free port) for the rank-0 rendezvous."""
        return node_ip(), free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
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

        # Master weights and optimizer state in model.master_dtype; with a narrower
        # model.dtype, FSDP2 gathers the parameters in it for the forward and backward and
        # reduces the gradients in float32 (what the field does: an update below bfloat16's
        # resolution still moves the float32 master weights).
        mp_policy = MixedPrecisionPolicy()  # no casts
        if cfg.model.mixed_precision:
            mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.model.dtype),
                                             reduce_dtype=torch.float32)

        def sharded(model):
            layer_types = tuple(getattr(model, "_no_split_modules", None) or ())
            for module in model.modules():
                if type(module).__name__ in layer_types:
                    fully_shard(module, mesh=mesh, mp_policy=mp_policy)
            fully_shard(model, mesh=mesh, mp_policy=mp_policy)
            return model

        master = cfg.model.master_dtype
        self.model = sharded(load_model(self.runtime.model_path, master, self.device))
        self.model.train()
        self.ref_model = None
        if cfg.algo.kl_coef > 0:
            self.ref_model = sharded(load_model(self.runtime.model_path, master, self.device))
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

    def connect_store(self) -> str | None:
        """Open this rank's store client, which lends a segment of its own (Mooncake): the
        manager puts this rank's partitions there, and the rank reads them with a local
        copy. Returns the client's ``location`` for the manager."""
        self.store = data_path(self.cfg.transfer).build(self.runtime, contribute_segment=True)
        return self.store.location

    @property
    def weight_sync(self):
        if self._weight_sync is None:
            self._weight_sync = weight_path(self.cfg.weights).build(
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

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max) ``values`` over the ranks. The tensor is made on this rank's device:
        NCCL serves CUDA tensors only, and a CPU tensor there raises at the first step."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

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
        [trained] = self._all_reduce([float(keep.sum())])
        metrics["train/samples"] = trained
        # Slowest rank's GET, and all ranks' bytes: the step waits for the slowest reader.
        [get_ms] = self._all_reduce([get_s * 1e3], "max")
        metrics["transfer/get_ms"] = get_ms
        metrics["transfer/get_gbps"] = sum(p.nbytes for p in ref.partitions) / 1e9 / max(
            get_ms / 1e3, 1e-9)  # GB/s of payload
        # The store's own timings of this get, slowest rank as for get_ms (every rank runs the
        # same backend, so the same names in the same order).
        names = sorted(self.store.get_timings_ms)
        if names:
            slowest = self._all_reduce([self.store.get_timings_ms[k] for k in names], "max")
            metrics.update({f"transfer/{k}": v for k, v in zip(names, slowest)})
        metrics["train/step_time"] = time.perf_counter() - t0
        metrics["train/started_at"], metrics["train/finished_at"] = started, time.time()
        return metrics

    def train_batch(self, batch: RolloutBatch) -> dict[str, float]:
        """``algo.steps_per_rollout`` optimizer steps on this rank's partition, one per
        mini-batch (all ranks call it together, with partitions of equal size). The
        behaviour log-probs (the weights this rollout's step starts from) are computed once,
        before the first step; every step's ratio and clip, and the importance weights
        against the engines' log-probs, work from them."""
        a = self.cfg.algo
        t0 = time.perf_counter()
        old_logp, old_s = None, 0.0  # one step: the behaviour policy is the current one
        if a.steps_per_rollout > 1:
            old_logp = self.behaviour_logprobs(batch)
            old_s = time.perf_counter() - t0
        totals: dict[str, float] = {}
        steps = 0
        grad_norm = 0.0  # summed over steps, reported as their mean
        # Mini-batches of shuffled samples (the same sizes on every rank); the order is seeded
        # by the run's seed and the rollout count, so a resumed run splits as the first did.
        order = np.random.default_rng([self.cfg.seed, self.scheduler.last_epoch, self.rank]).permutation(
            len(batch)) if a.steps_per_rollout > 1 else np.arange(len(batch))
        for idx in np.array_split(order, a.steps_per_rollout):
            mini = batch.select(idx)
            old_mini = None if old_logp is None else old_logp.take(idx)
            [count] = self._all_reduce([agg_count_of(mini, a.loss_agg)])
            if count == 0:  # nothing left to learn from on any rank (stale or dropped)
                continue
            self.optimizer.zero_grad(set_to_none=True)
            sums = self.accumulate_grads(mini, old_mini, count)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip)
            grad_norm += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.optimizer.step()
            steps += 1
            sums["loss"] /= count  # this mini-batch's loss, summed over ranks below
            for k in SUM_KEYS:
                totals[k] = totals.get(k, 0.0) + sums[k]
            totals["is_max"] = max(totals.get("is_max", 0.0), sums["is_max"])
        self.scheduler.step()  # the LR schedule counts rollouts, those without an optimizer step too
        g = dict(zip(SUM_KEYS, self._all_reduce([totals.get(k, 0.0) for k in SUM_KEYS])))
        [is_max] = self._all_reduce([totals.get("is_max", 0.0)], "max")
        tok, n = max(g["tokens"], 1.0), g["is_n"]
        return {
            "train/loss": g["loss"] / max(steps, 1),
            "train/clipfrac": g["clipped"] / tok,
            "train/approx_kl": g["approx_kl"] / tok,
            "train/kl": g["ref_kl"] / tok if self.ref_model is not None else g["approx_kl"] / tok,
            "train/entropy": g["entropy"] / tok,
            "train/logp_diff": g["logp_diff"] / tok,
            "train/tis_mean": g["tis_mean"] / tok,
            # importance weights w = exp(logp_behaviour - logp_engine) over the step's loss
            # tokens on all ranks; without any, the on-policy values (1, and fractions 0)
            "train/is_weight_mean": g["is_w"] / n if n else 1.0,
            "train/is_weight_max": is_max if n else 1.0,
            "train/is_ess": effective_sample_size(g["is_w"], g["is_w2"], n),
            "train/is_truncated_frac": g["is_truncated"] / max(n, 1.0),
            "train/is_masked_frac": g["is_masked"] / max(n, 1.0),
            "train/engine_kl": g["engine_kl"] / max(n, 1.0),
            "train/optimizer_steps": float(steps),
            "train/grad_norm": grad_norm / max(steps, 1),
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/tokens_per_s": tok / max(time.perf_counter() - t0, 1e-9),
            # the forward/backward passes of the step's optimizer steps: padded token slots that
            # hold no token, over all slots of all ranks; passes per rank (equal on every rank)
            "train/pad_frac": g["pad_slots"] / max(g["slots"], 1.0),
            "train/micro_batches": g["micro_batches"] / self.world_size,
            "perf/old_logp_time": old_s,
        }

    def micro_batches(self, batch: RolloutBatch) -> list[np.ndarray]:
        """The micro-batches of ``batch`` on this rank (sample indices, one forward pass each):
        ``algo.micro_batch_size`` samples in order, or, with ``algo.max_tokens_per_micro_batch``,
        samples sorted by length and packed within the token budget. Every rank must run as many
        passes (FSDP2 all-gathers each layer's parameters in every forward and reduces its
        gradients in every backward), so in budget mode the ranks agree on the largest number
        (a collective) and those with fewer split their largest micro-batches until they have
        as many: smaller passes rather than empty ones, no forward wasted on a dummy sample. Every
        rank's mini-batch holds the same number of samples, so the split always reaches it."""
        a = self.cfg.algo
        if not a.max_tokens_per_micro_batch:
            return fixed_size(len(batch), a.micro_batch_size)
        lengths = batch.tokens.lengths
        groups = by_token_budget(lengths, a.max_tokens_per_micro_batch)
        [most] = self._all_reduce([float(len(groups))], "max")
        return split_to(groups, lengths, int(most))

    def behaviour_logprobs(self, batch: RolloutBatch) -> Ragged:
        """Per sample, the log-probs of its response tokens under the current weights (one
        no-grad forward over the partition's micro-batches), laid out as
        ``batch.rollout_logprobs``."""
        T, offsets = self.cfg.rollout.temperature, batch.rollout_logprobs.offsets
        values = np.zeros(offsets[-1], dtype=np.float32)
        slot = Ragged(np.arange(offsets[-1]), offsets)  # where each sample's values go in ``values``
        with torch.no_grad():
            for sel in self.micro_batches(batch):
                sub = batch.select(sel)
                mb = self._pack(sub)
                logits = self.model(input_ids=mb["ids"], attention_mask=mb["attn"]).logits
                logp_bt = token_logprobs(logits[:, :-1], mb["ids"][:, 1:], T).cpu().numpy()
                values[slot.take(sel).values] = logp_bt[response_positions(sub)]
        return Ragged(values, offsets)

    def accumulate_grads(self, batch: RolloutBatch, old_logp: Ragged | None = None,
                         count: float | None = None) -> dict[str, float]:
        """Forward/backward over micro-batches; gradients end up equal to those of the
        aggregated loss (``algo.loss_agg``) of the mini-batch over all ranks, whose
        denominator is ``count`` (summed over ranks here when not given). ``old_logp`` None:
        the behaviour policy is the current one (one step per rollout, ratio 1). Returns
        this rank's sums."""
        a, T = self.cfg.algo, self.cfg.rollout.temperature
        if count is None:
            [total] = self._all_reduce([agg_count_of(batch, a.loss_agg)])
            count = max(total, 1.0)
        max_len, lengths = self.cfg.rollout.max_new_tokens, batch.tokens.lengths
        scale = self.world_size / count  # FSDP averages gradients over ranks
        clip_high = a.clip_eps_high if a.clip_eps_high is not None else a.clip_eps
        sums = dict.fromkeys(SUM_KEYS + ("is_max",), 0.0)
        for sel in self.micro_batches(batch):
            mb = self._pack(batch.select(sel), None if old_logp is None else old_logp.take(sel))
            logits = self.model(input_ids=mb["ids"], attention_mask=mb["attn"]).logits
            logp_bt = token_logprobs(logits[:, :-1], mb["ids"][:, 1:], T)
            mask_bt = mb["mask"]
            # Outside the loss tokens the behaviour log-probs are 0 (padding): keep them equal
            # to the current ones there, so that no exp() of a pad position overflows.
            old_bt = (logp_bt.detach() if old_logp is None
                      else torch.where(mask_bt != 0, mb["old_logp"], logp_bt.detach()))
            # Samples the engines drew from other weights (async) or other numerics: the ratio
            # w = behaviour / engine per token masks tokens or sequences out of the policy loss
            # (algo.is_mask) and truncates the rest (algo.tis_cap). The weight multiplies the
            # token losses, not the mask: masked tokens stay in the normaliser.
            log_w_bt = is_log_ratio_bt(old_bt, mb["rollout_logp"], mask_bt)
            keep_bt = is_keep_bt(log_w_bt, mask_bt, a.is_mask, a.is_mask_low, a.is_mask_high)
            is_bt = is_weight_bt(log_w_bt, keep_bt, a.tis_cap)
            if a.tis_cap > 0:
                sums["tis_mean"] += float((is_bt * mask_bt).sum())
            for k, v in is_stat_sums(log_w_bt, mask_bt, keep_bt, a.tis_cap).items():
                sums[k] = max(sums[k], v) if k == "is_max" else sums[k] + v
            loss_bt, clipped_bt, approx_kl_bt = policy_loss_bt(logp_bt, old_bt, mb["adv"],
                                                               a.clip_eps, clip_high)
            loss = agg_sum(loss_bt * is_bt, mask_bt, a.loss_agg, max_len)
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logits = self.ref_model(input_ids=mb["ids"], attention_mask=mb["attn"]).logits
                    ref_bt = token_logprobs(ref_logits[:, :-1], mb["ids"][:, 1:], T)
                ref_bt = torch.where(mask_bt != 0, ref_bt, logp_bt.detach())  # pads: no exp overflow
                kl_bt = kl_penalty_bt(logp_bt, ref_bt, a.kl_estimator)
                loss = loss + a.kl_coef * agg_sum(kl_bt, mask_bt, a.loss_agg, max_len)
                sums["ref_kl"] += float((kl_bt.detach() * mask_bt).sum())
            with torch.set_grad_enabled(a.entropy_coef > 0):  # at loss tokens only: [N, V], not [B, T, V]
                loss_pos_bt = mask_bt != 0
                ent_bt = torch.zeros_like(logp_bt).masked_scatter(
                    loss_pos_bt, entropy_bt(logits[:, :-1][loss_pos_bt], T))
            if a.entropy_coef > 0:
                loss = loss - a.entropy_coef * agg_sum(ent_bt, mask_bt, a.loss_agg, max_len)
            (loss * scale).backward()
            sums["loss"] += float(loss.detach())
            sums["clipped"] += float((clipped_bt * mask_bt).sum())
            sums["approx_kl"] += float((approx_kl_bt * mask_bt).sum())
            sums["entropy"] += float((ent_bt.detach() * mask_bt).sum())
            # learner vs engine on the same weights: the behaviour log-probs, not the moved ones
            sums["logp_diff"] += float(((old_bt - mb["rollout_logp"]).abs() * mask_bt).sum())
            sums["tokens"] += float(mask_bt.sum())
            slots = len(sel) * int(lengths[sel].max())  # what _pack allocated
            sums["slots"] += slots
            sums["pad_slots"] += slots - int(lengths[sel].sum())
            sums["micro_batches"] += 1
        return sums

    def _pack(self, batch: RolloutBatch, old_logp: Ragged | None = None) -> dict[str, torch.Tensor]:
        """Right-pad a micro-batch, one scatter per field from the flat columns. Token ids
        stay exactly as sampled; pad positions and everything past a sample's response are
        masked out, so their ids never matter."""
        B, L = len(batch), int(batch.tokens.lengths.max())
        ids = np.full((B, L), self.pad_id, dtype=np.int64)
        attn = np.zeros((B, L), dtype=np.int64)
        at = batch.tokens.rows_and_columns()
        ids[at] = batch.tokens.values
        attn[at] = 1
        # position t predicts token t + 1: response token j of sample i sits at p_i - 1 + j
        resp = response_positions(batch)
        mask = np.zeros((B, L - 1), dtype=np.float32)
        mask[resp] = batch.loss_mask.values
        rollout_logp = np.zeros((B, L - 1), dtype=np.float32)
        rollout_logp[resp] = batch.rollout_logprobs.values
        if batch.token_advantages is None:  # one advantage a sample: [B]
            adv = np.asarray(batch.advantages, dtype=np.float32)
        else:  # one a token (algo.turn_credit): [B, L - 1], 0 off the response
            adv = np.zeros((B, L - 1), dtype=np.float32)
            adv[resp] = batch.token_advantages.values
        dev = self.device
        packed = {"ids": torch.from_numpy(ids).to(dev), "attn": torch.from_numpy(attn).to(dev),
                  "mask": torch.from_numpy(mask).to(dev),
                  "rollout_logp": torch.from_numpy(rollout_logp).to(dev),
                  "adv": torch.from_numpy(adv).to(dev)}
        if old_logp is not None:
            old = np.zeros((B, L - 1), dtype=np.float32)
            old[resp] = old_logp.values
            packed["old_logp"] = torch.from_numpy(old).to(dev)
        return packed

    # -- weights -----------------------------------------------------------------------
    def connect_engines(self, receivers: list) -> None:
        self.weight_sync.connect(receivers)

    def reconnect_engines(self, receivers: list, replaced: list[int]) -> None:
        """Engines ``replaced`` were started again (rollout fault tolerance)."""
        self.weight_sync.reconnect(receivers, replaced)

    def push_weights(self, version: int) -> dict[str, float]:
        """Send the master weights to the engines, cast to their dtype (``model.dtype``)
        shard by shard, so that the gather moves the narrow copy."""
        dtype = getattr(torch, self.cfg.model.dtype)
        return self.weight_sync.push(((n, p.detach().to(dtype)) for n, p in self.model.named_parameters()),
                                     version)

    def full_state(self) -> dict[str, np.ndarray] | None:
        """Every parameter as a whole numpy array (rank 0; a collective on all ranks)."""
        out = {n: t.numpy() for n, t in self.full_tensors(self.model.named_parameters()).items()}
        return out if self.rank == 0 else None

    def full_tensors(self, named, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Each of ``named`` (parameters, buffers) whole, on the CPU, on rank 0 (other ranks:
        an empty dict); a collective on all ranks. Floating tensors are cast to ``dtype``
        shard by shard, so that the gather moves the narrow copy; the gather itself runs on
        this rank's device (NCCL serves CUDA tensors only)."""
        out = {}
        for name, t in named:
            t = t.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            t = full_tensor(t)
            if self.rank == 0:
                # A copy: on CPU with one rank the full tensor is the parameter itself, and
                # holding it (or a numpy view of it) would pin FSDP's storage past the next
                # reshard and change with the next step.
                out[name] = t.to("cpu", copy=True)
        return out

    # -- checkpoints -------------------------------------------------------------------
    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        checkpoint.save_learner(path, self.model, self.optimizer, self.scheduler)
        if self.cfg.checkpoint.save_hf:
            self.save_hf(os.path.join(path, export_hf.HF_DIR))

    def save_hf(self, path: str) -> None:
        """The policy as a Hugging Face model directory at ``path`` (``rl.learner.export_hf``),
        weights in ``model.dtype``, config and tokenizer files from the model the run started
        from. A collective: every rank gathers, rank 0 writes, while the others return (no
        barrier: writing a large model may outlast the process group's timeout, and the
        driver waits for every rank's answer anyway)."""
        # parameters and persistent buffers: the state_dict's names (no gather), less the tied
        # aliases (lm_head.weight of a tied model), which named_parameters leaves out
        params = dict(self.model.named_parameters())
        keys = self.model.state_dict().keys()
        buffers = [(n, b) for n, b in self.model.named_buffers() if n in keys and n not in params]
        state = self.full_tensors([*params.items(), *buffers], getattr(torch, self.cfg.model.dtype))
        if self.rank == 0:
            export_hf.write_hf(path, state, self.runtime.model_path, self.cfg.model.dtype)

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
    if not keep.all():
        batch.loss_mask = batch.loss_mask.with_zeroed(~keep)
    return keep


def response_positions(batch: RolloutBatch) -> tuple[np.ndarray, np.ndarray]:
    """Where the response tokens' predictions sit in a padded ``[B, L - 1]`` array (position
    t predicts token t + 1, so response token j of sample i is at ``prompt_len[i] - 1 + j``),
    in the order of the flat per-response columns."""
    return batch.loss_mask.rows_and_columns(batch.prompt_len.astype(np.int64) - 1)


def agg_count_of(batch: RolloutBatch, mode: str) -> float:
    """``rl.algo.agg_count`` of a batch's loss masks, without packing it: loss tokens, or
    sequences with at least one loss token."""
    nonzero_b = np.bincount(batch.loss_mask.sample_index(), weights=batch.loss_mask.values != 0,
                            minlength=len(batch))
    if mode == "token_mean":
        return float(nonzero_b.sum())
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        return float((nonzero_b > 0).sum())
    return agg_count(torch.zeros(0, 0), mode)  # raises: unknown mode
