"""RolloutManager: turns prompts into a stored, partitioned training batch.

Per step: draw prompts from the task, run the rollout function (``rollout.function``,
``rl.rollout.functions``; by default one request per prompt for its ``n_samples_per_prompt``
samples) on every prompt group at once (``rl.rollout.fanout``), score each sample, compute GRPO
advantages, build a ``RolloutBatch``, split it over the learner ranks balanced by token count
(``rl.rollout.batch``), ``put`` each partition into the store and return a small
``RolloutRef``. The batch itself never goes back to the driver.

The manager owns the engines (``rl.rollout.fleet``: started, watched, replaced) and, in
fully async, the stream of batches (``rl.rollout.stream``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time

import numpy as np

from rl.backends import data_path
from rl.config import Config
from rl.model import load_tokenizer
from rl.rollout.batch import (build_batch, check_label_bytes, encode_prompt, partial_frac, split_balanced,
                              zero_std_groups)
from rl.rollout.client import EngineError
from rl.rollout.dump import dump_path, dump_samples
from rl.rollout.fanout import EnginePool, run_groups
from rl.rollout.functions import RolloutContext, RolloutFunction, Sample, score_group
from rl.rollout.fleet import EngineFleet, SyncPlan
from rl.rollout.stream import Stream
from rl.runtime import Runtime
from rl.tasks import Prompt, group_reward, turn_rewards
from rl.config.task import JsonlTaskConfig
from rl.tasks.build import build_task, max_label_bytes
from rl.tasks.jsonl import read_rows
from rl.types import RolloutBatch, RolloutRef

logger = logging.getLogger(__name__)


def held_out_prompts(cfg: Config) -> list[Prompt]:
    """The evaluation's prompts: the first ``eval.num_prompts`` rows of ``eval.path``, or of
    the task's own stream under ``task.seed + eval.seed_offset``."""
    ec = cfg.eval
    if ec.path is not None:
        rows = read_rows(os.path.expanduser(ec.path))[:ec.num_prompts]
        return [Prompt(text=text, label=label, index=i) for i, (text, label) in enumerate(rows)]
    if isinstance(cfg.task, JsonlTaskConfig):
        logger.warning("eval: task=jsonl without eval.path draws its prompts from the training "
                       "file (not held out); set eval.path to a file of held-out prompts")
    return build_task(dataclasses.replace(cfg.task, seed=cfg.task.seed + ec.seed_offset)).next_prompts(
        ec.num_prompts)


class RolloutManager:
    def __init__(self, cfg: Config, runtime: Runtime, engine_placement, engine_env: dict[str, str]) -> None:
        """``engine_placement``: the placement group the engines start on (engine ``i`` on
        bundle ``i``, by ``start_engines``); ``engine_env``: their servers' environment."""
        self.cfg = cfg
        self.runtime = runtime
        self.tokenizer = load_tokenizer(runtime.model_path)
        self.task = build_task(cfg.task)
        self.group_reward = group_reward(self.task)
        self.label_bytes = max_label_bytes(cfg.task, self.task)  # the stores' capacity estimate's bound
        self.turn_rewards = turn_rewards(self.task) if cfg.algo.turn_credit else None
        if cfg.algo.turn_credit and self.turn_rewards is None:
            raise ValueError(f"algo.turn_credit=true: task={cfg.task.name} ({type(self.task).__name__}) "
                             f"has no turn_rewards")
        rc = cfg.rollout
        self.rollout_fn = RolloutFunction(rc.function, n=rc.n_samples_per_prompt,
                                          max_prompt_tokens=rc.max_prompt_tokens,
                                          max_new_tokens=rc.max_new_tokens)
        self.fleet = EngineFleet(cfg, runtime, engine_placement, engine_env)
        self.pool: EnginePool | None = None
        self.store = data_path(cfg.transfer).build(runtime)
        self.readers: list[str | None] = [None] * cfg.cluster.num_learners
        """Each learner rank's store ``location``: its partitions are put there."""
        self.next_sample_id = 0
        self._lock = threading.Lock()  # data position and sample ids (the stream thread draws too)
        # held by a put in flight and by close(): a put that raced with the learners' closes
        # would write into segments being unmounted (Mooncake's client crashes on it)
        self._writing = threading.Lock()
        self._closed = False
        self._stream: Stream | None = None
        self._shown_prompt = False
        self._eval_prompts: list[Prompt] | None = None
        self._skip: set[int] = set()
        """Prompt indices ahead of the data position that a resumed run must not draw again
        (fully async trains groups in the order they finish, not the order they started)."""

    def set_readers(self, locations: list[str | None]) -> None:
        """Each learner rank's store ``location`` (the driver sends them once the ranks are
        set up, before the first step)."""
        ranks = self.cfg.cluster.num_learners
        if len(locations) != ranks:
            raise ValueError(f"{len(locations)} reader locations for {ranks} learner ranks")
        self.readers = list(locations)

    def start_engines(self) -> list[str]:
        """Start the engines; returns their URLs once each answers."""
        urls = self.fleet.start()
        self.pool = EnginePool(self.fleet.engines, retry=self.cfg.rollout.fault_tolerance)
        return urls

    # -- the step ----------------------------------------------------------------------
    def generate(self, step: int, stop: threading.Event | None = None) -> RolloutRef:
        """One batch, stored; ``stop`` (set by another thread) abandons the generation."""
        rc = self.cfg.rollout
        started = time.time()
        t0 = time.perf_counter()
        with self._lock:
            prompts = self.task.next_prompts(rc.prompts_per_step)
        prompt_ids = self.encode(prompts)
        retried = self.pool.retried

        async def group(session, i: int) -> list[Sample]:
            return await self.rollout_fn.group(self.context(session), prompts[i], prompt_ids[i])

        try:
            groups = asyncio.run(run_groups(group, len(prompts), rc.n_samples_per_prompt,
                                            label=f"step {step}", stop=stop))
        except EngineError:
            self.raise_if_all_down()
            raise
        return self.store_batch(step, prompts, groups, started=started,
                                gen_s=time.perf_counter() - t0, retried=self.pool.retried - retried)

    def context(self, session) -> RolloutContext:
        """What the rollout function gets: the engines through ``session``, the tokenizer,
        the rollout's sampling settings."""
        rc = self.cfg.rollout
        return RolloutContext(pool=self.pool, session=session, timeout_s=rc.request_timeout_s,
                              tokenizer=self.tokenizer, sampling_params=rc.sampling_params(),
                              n_samples_per_prompt=rc.n_samples_per_prompt)

    def encode(self, prompts: list[Prompt]) -> list[list[int]]:
        """The prompts' token ids as the engines get them (too long: a clear error)."""
        rc = self.cfg.rollout
        prompt_ids = [encode_prompt(self.tokenizer, p.text, self.cfg.model.chat_template)
                      for p in prompts]
        if not self._shown_prompt:  # what the engines really get, once a run (templates go wrong quietly)
            self._shown_prompt = True
            logger.info("first prompt as sent (%d tokens): %r", len(prompt_ids[0]),
                        self.tokenizer.decode(prompt_ids[0]))
        too_long = [len(ids) for ids in prompt_ids if len(ids) > rc.max_prompt_tokens]
        if too_long:
            raise ValueError(f"{len(too_long)} prompt(s) of up to {max(too_long)} tokens exceed "
                             f"rollout.max_prompt_tokens={rc.max_prompt_tokens}; raise it")
        return prompt_ids

    def raise_if_all_down(self) -> None:
        if self.pool.retry and not self.fleet.engines.live():  # every engine down: say how each ended
            raise RuntimeError("every engine is down:\n" + self.fleet.describe()) from None

    def store_batch(self, step: int, prompts: list[Prompt], groups: list[list[Sample]], *,
                    started: float, gen_s: float, retried: int) -> RolloutRef:
        """Score, build, partition and store one batch of answered groups; returns its ref."""
        rc = self.cfg.rollout
        with self._lock:
            batch = self._build_batch(prompts, groups)
        zero_std = zero_std_groups(batch, rc.n_samples_per_prompt, drop=self.cfg.algo.drop_zero_std_groups)
        if rc.dump_every and (step + 1) % rc.dump_every == 0:  # the masks as trained
            dump_samples(dump_path(self.runtime.output_dir, step), step, prompts, groups, batch,
                         self.tokenizer)
        parts = split_balanced(batch.prompt_len + batch.response_len, self.cfg.cluster.num_learners)
        refs = self._put_partitions(batch, parts, step)
        put_ms = [r.timings_ms.get("put_ms", 0.0) for r in refs]
        encode_ms = [r.timings_ms.get("encode_ms", 0.0) for r in refs]
        stats = {
            "rollout/reward_mean": float(batch.rewards.mean()),
            "rollout/reward_std": float(batch.rewards.std()),
            "rollout/solved_frac": float(np.mean(batch.rewards >= 1.0)),
            "rollout/response_len_mean": float(batch.response_len.mean()),
            "rollout/truncated_frac": float(np.mean([f != "stop" for f in batch.finish_reason])),
            "rollout/zero_std_groups": float(zero_std),
            "rollout/generate_time": gen_s,
            "rollout/retried_requests": float(retried),
            "rollout/samples_per_s": len(batch) / max(gen_s, 1e-9),
            "rollout/weight_version_min": float(batch.weight_version.min()),
            "rollout/weight_version_mean": float(batch.weight_version.mean()),
            "rollout/partial_frac": partial_frac(groups),
            "rollout/engine_busy_s": self.pool.busy_seconds(),
            "rollout/engines": float(len(self.pool.inflight)),
            "rollout/started_at": started,
            "rollout/finished_at": time.time(),
            "transfer/put_ms": float(sum(put_ms)),
            "transfer/encode_ms": float(sum(encode_ms)),
            "transfer/bytes": float(sum(r.nbytes for r in refs)),
        }
        return RolloutRef(step=step, partitions=refs, num_samples=len(batch),
                          num_loss_tokens=batch.num_loss_tokens, stats=stats,
                          first_sample_id=int(batch.sample_id[0]),
                          weight_versions=batch.weight_version.tolist(),
                          prompt_indices=[p.index for p in prompts])

    def _build_batch(self, prompts: list[Prompt], groups: list[list[Sample]]) -> RolloutBatch:
        rc = self.cfg.rollout
        batch = build_batch(prompts, groups, self.task.reward, group_reward=self.group_reward,
                            turn_rewards=self.turn_rewards,
                            group_size=rc.n_samples_per_prompt,
                            std_norm=self.cfg.algo.advantage_std_norm,
                            first_sample_id=self.next_sample_id)
        self.next_sample_id += len(batch)
        self.label_bytes = check_label_bytes(batch.label, self.label_bytes, self.cfg.task.name)
        return batch

    def _put_partitions(self, batch: RolloutBatch, parts: list[list[int]], step: int) -> list:
        refs = []
        with self._writing:
            if self._closed:
                raise RuntimeError("the rollout manager is closed: the batch is not stored")
            try:
                for rank, idx in enumerate(parts):
                    key = f"{self.runtime.run_id}/step-{step:06d}/rank-{rank}"
                    refs.append(self.store.put(batch.select(idx).to_columns(), key=key,
                                               near=self.readers[rank]))
            except BaseException:
                self.store.remove(refs)  # nothing half-written stays behind
                raise
        return refs

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Answer the evaluation prompts (``eval``) with the engines' current weights through the
        rollout function (``rollout.function``, with ``eval.n_samples`` samples a prompt and
        the eval sampling) and score them with the task's reward, as training does
        (``score_group``): ``eval/reward_mean``,
        ``eval/pass@<n>`` (prompts with an answer of full reward), ``eval/response_len_mean``,
        ``eval/truncated_frac``, ``eval/time``. Nothing is stored or trained: the sample ids,
        the data position and the fully async accounting are untouched."""
        ec, rc = self.cfg.eval, self.cfg.rollout
        t0 = time.perf_counter()
        if self._eval_prompts is None:
            self._eval_prompts = held_out_prompts(self.cfg)
        prompts = self._eval_prompts
        prompt_ids = self.encode(prompts)
        fn = RolloutFunction(rc.function, n=ec.n_samples, max_prompt_tokens=rc.max_prompt_tokens,
                             max_new_tokens=rc.max_new_tokens)
        sampling = {**rc.sampling_params(), **({"temperature": 0.0} if ec.greedy else {})}

        async def group(session, i: int) -> list[Sample]:
            ctx = RolloutContext(pool=self.pool, session=session, timeout_s=rc.request_timeout_s,
                                 tokenizer=self.tokenizer, sampling_params=sampling,
                                 n_samples_per_prompt=ec.n_samples)
            return await fn.group(ctx, prompts[i], prompt_ids[i])

        groups = asyncio.run(run_groups(group, len(prompts), ec.n_samples, label="eval"))
        rewards = np.asarray([score_group(g, p, self.task.reward, self.group_reward)
                              for p, g in zip(prompts, groups)], dtype=np.float64)
        return {"eval/reward_mean": float(rewards.mean()),
                f"eval/pass@{ec.n_samples}": float((rewards >= 1.0).any(axis=1).mean()),
                "eval/response_len_mean": float(np.mean([len(s.response_ids) for g in groups for s in g])),
                "eval/truncated_frac": 1.0 - float(np.mean([s.finished for g in groups for s in g])),
                "eval/time": time.perf_counter() - t0}

    # -- bookkeeping ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        with self._lock:
            return {"task": self.task.state_dict(), "next_sample_id": self.next_sample_id,
                    "skip": sorted(self._skip)}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.task.load_state_dict(state["task"])
            self.next_sample_id = int(state["next_sample_id"])
            self._skip = set(state.get("skip", ()))

    def draw_prompt(self) -> tuple[Prompt, dict]:
        """The next prompt (fully async draws one group at a time) and the data position
        before it; prompts a checkpoint recorded as done already (``skip``) are passed over."""
        with self._lock:
            while True:
                position = self.task.state_dict()
                [prompt] = self.task.next_prompts(1)
                if prompt.index not in self._skip:
                    return prompt, position
                self._skip.discard(prompt.index)

    def pause(self) -> None:
        """Every engine stops scheduling forward passes (requests in flight are kept)."""
        self.fleet.pause(self.cfg.rollout.pause_mode)

    def resume(self) -> None:
        self.fleet.resume()

    # -- the engines (rl.rollout.fleet; weight syncs framed by rl.driver.weights.WeightPusher)
    def prepare_sync(self, unanswered: list[str] | None = None) -> SyncPlan:
        return self.fleet.prepare_sync(unanswered)

    def end_sync(self, ok: bool) -> list[int]:
        return self.fleet.end_sync(ok)

    def engines_failed(self) -> str | None:
        return self.fleet.failure()

    def receivers(self) -> list:
        return self.fleet.receivers()

    def engine_pids(self) -> list[int | None]:
        return self.fleet.pids()

    def engine_actors(self) -> list:
        return list(self.fleet.actors)

    # -- fully async -------------------------------------------------------------------------
    def start_stream(self, first_step: int) -> None:
        if self._stream is not None:
            raise RuntimeError("the rollout stream is already running")
        self._stream = Stream(self, first_step, self.cfg.rollout.max_inflight_batches,
                              self.cfg.algo.max_staleness)

    def next_batch(self, step: int) -> RolloutRef:
        return self._stream.next_batch(step, self.cfg.algo.max_staleness)

    def release(self, ref: RolloutRef, step: int) -> None:
        self._stream.release(ref, step)

    def resume_position(self) -> dict:
        return self._stream.resume_position()

    def stop_stream(self) -> list[dict]:
        """Stop generating, remove the batches nobody took; returns the sample ledger."""
        stream, self._stream = self._stream, None
        return stream.stop() if stream is not None else []

    def close(self) -> None:
        """Stop watching and streaming, then close the store client once no put is in flight
        (``Cluster.shutdown`` closes the learners, whose segments the puts write to, after)."""
        try:
            self.fleet.stop_watching()
            self.stop_stream()
        finally:
            with self._writing:
                self._closed = True
                self.store.close()
