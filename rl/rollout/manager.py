"""RolloutManager: turns prompts into a stored, partitioned training batch.

Per step: draw prompts from the task, send one request per prompt for its
``n_samples_per_prompt`` samples (all at once, through one SGLang-protocol client pool),
score each response, compute GRPO advantages, build a ``RolloutBatch``, split it over the
learner ranks balanced by token count, ``put`` each partition into the store and return a
small ``RolloutRef``. The batch itself never goes back to the driver.

Fully async (``train_async.py rollout.fully_async=true``): ``start_stream`` generates batch
after batch on a thread into a queue bounded by ``rollout.max_inflight_batches``; the driver
takes them with ``next_batch`` (too-stale samples dropped and counted) and gives each slot
back with ``release`` after the weight sync, so the next batch starts on the new weights.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

import numpy as np

from rl.backends import data_path
from rl.config import Config
from rl.model import load_tokenizer
from rl.rollout.batch import build_batch, split_balanced, zero_std_groups
from rl.rollout.client import EngineClient, EngineError, EnginePool
from rl.rollout.health import HealthMonitor, describe_dead, restarts_used_up
from rl.runtime import Runtime
from rl.tasks import Prompt
from rl.types import RolloutBatch, RolloutRef

logger = logging.getLogger(__name__)

class RolloutManager:
    def __init__(self, cfg: Config, runtime: Runtime, engine_urls: list[str]) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.tokenizer = load_tokenizer(runtime.model_path)
        self.task = cfg.task.build()
        rc = cfg.rollout
        self.pool = EnginePool([self._client(i, u) for i, u in enumerate(engine_urls)],
                               retry=rc.fault_tolerance)
        self.monitor = None
        self.restarts = 0  # engines replaced (rollout.max_engine_restarts bounds it)
        self._synced = False
        if rc.fault_tolerance:
            self.monitor = HealthMonitor(self.pool, rc.health_check_interval_s, rc.health_check_timeout_s,
                                         rc.health_check_first_wait_s).start()
        self.store = data_path(cfg.transfer).build(runtime)
        self.next_sample_id = 0
        self._lock = threading.Lock()  # data position and sample ids (the stream thread draws too)
        self._stream: Stream | None = None
        self._shown_prompt = False

    # -- the step ----------------------------------------------------------------------
    def generate(self, step: int, stop: threading.Event | None = None) -> RolloutRef:
        """One batch, stored; ``stop`` (set by another thread) abandons the generation."""
        rc = self.cfg.rollout
        started = time.time()
        t0 = time.perf_counter()
        with self._lock:
            prompts = self.task.next_prompts(rc.prompts_per_step)
        sampling = rc.sampling_params()
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
        retried = self.pool.retried
        try:
            answers = asyncio.run(generate_groups(self.pool, prompt_ids, rc.n_samples_per_prompt,
                                                  sampling, rc.request_timeout_s, label=f"step {step}",
                                                  stop=stop))
        except EngineError:
            if self.pool.retry and not self.pool.live():  # every engine down: say how each ended
                raise RuntimeError("every engine is down:\n" + describe_dead(
                    self.runtime.log_dir, self.pool.down_reason)) from None
            raise
        gen_s = time.perf_counter() - t0
        with self._lock:
            batch = self._build_batch(prompts, prompt_ids, answers)
        zero_std = zero_std_groups(batch, rc.n_samples_per_prompt, drop=self.cfg.algo.drop_zero_std_groups)
        parts = split_balanced(batch.prompt_len + batch.response_len, self.cfg.cluster.num_learners)
        refs = self._put_partitions(batch, parts, step)
        put_ms = [r.timings_ms.get("put_ms", 0.0) for r in refs]
        encode_ms = [r.timings_ms.get("encode_ms", 0.0) for r in refs]
        stats = {
            "rollout/reward_mean": float(batch.rewards.mean()),
            "rollout/reward_std": float(batch.rewards.std()),
            "rollout/response_len_mean": float(batch.response_len.mean()),
            "rollout/truncated_frac": float(np.mean([f != "stop" for f in batch.finish_reason])),
            "rollout/zero_std_groups": float(zero_std),
            "rollout/generate_time": gen_s,
            "rollout/retried_requests": float(self.pool.retried - retried),
            "rollout/samples_per_s": len(batch) / max(gen_s, 1e-9),
            "rollout/weight_version_min": float(batch.weight_version.min()),
            "rollout/weight_version_mean": float(batch.weight_version.mean()),
            "rollout/started_at": started,
            "rollout/finished_at": time.time(),
            "transfer/put_ms": float(sum(put_ms)),
            "transfer/encode_ms": float(sum(encode_ms)),
            "transfer/bytes": float(sum(r.nbytes for r in refs)),
        }
        return RolloutRef(step=step, partitions=refs, num_samples=len(batch),
                          num_loss_tokens=batch.num_loss_tokens, stats=stats,
                          first_sample_id=int(batch.sample_id[0]),
                          weight_versions=batch.weight_version.tolist())

    def _build_batch(self, prompts: list[Prompt], prompt_ids: list[list[int]],
                     answers: list[list[dict]]) -> RolloutBatch:
        rc = self.cfg.rollout
        batch = build_batch(prompts, prompt_ids, answers, self.task.reward,
                            group_size=rc.n_samples_per_prompt,
                            std_norm=self.cfg.algo.advantage_std_norm,
                            first_sample_id=self.next_sample_id)
        self.next_sample_id += len(batch)
        return batch

    def _put_partitions(self, batch: RolloutBatch, parts: list[list[int]], step: int) -> list:
        refs = []
        try:
            for rank, idx in enumerate(parts):
                key = f"{self.runtime.run_id}/step-{step:06d}/rank-{rank}"
                refs.append(self.store.put(batch.select(idx).to_columns(), key=key))
        except BaseException:
            self.store.remove(refs)  # nothing half-written stays behind
            raise
        return refs

    # -- bookkeeping ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        with self._lock:
            return {"task": self.task.state_dict(), "next_sample_id": self.next_sample_id}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.task.load_state_dict(state["task"])
            self.next_sample_id = int(state["next_sample_id"])

    def pause(self) -> None:
        """Every engine stops scheduling forward passes (requests in flight are kept)."""
        self._suspend_checks()
        self._on_live("pause_generation", self.cfg.rollout.pause_mode)

    def resume(self) -> None:
        self._on_live("continue_generation")
        self._resume_checks()

    def _on_live(self, method: str, *args) -> None:
        """Call every engine in service; with fault tolerance, one that does not answer is
        taken out of service (replaced at the next sync) instead of failing the call."""
        for i in self.pool.live():
            try:
                getattr(self.pool.clients[i], method)(*args)
            except EngineError as e:
                if self.monitor is None or e.status is not None:
                    raise
                self.pool.mark_down(i, str(e))

    # -- engine faults (rollout.fault_tolerance; driven by rl.cluster.Cluster.push_weights) ----
    def _client(self, i: int, url: str) -> EngineClient:
        rc = self.cfg.rollout
        # control calls (pause, continue): with fault tolerance a hung engine is given the
        # health check's bound, not a whole request's, before it counts as dead
        control_s = rc.health_check_timeout_s if rc.fault_tolerance else rc.request_timeout_s
        return EngineClient(url, f"engine-{i}", timeout_s=control_s)

    def _suspend_checks(self) -> None:
        if self.monitor is not None:
            self.monitor.suspend()

    def _resume_checks(self, joined: list[int] = ()) -> None:
        if self.monitor is not None:
            self.monitor.resume(joined)

    def begin_sync(self) -> dict[int, str]:
        """A weight sync starts (no ``/health_generate`` during it; requests wait for its
        end when no engine is in service): the engines out of service, to replace before
        it, and why."""
        self._suspend_checks()
        self.pool.holding = True
        return dict(self.pool.down_reason)

    def engines_failed(self) -> str | None:
        """Why the run cannot go on (asked by the driver's watchdog once a second): more
        engines dead than replacements left, or every engine dead outside a sync; else None."""
        if self.monitor is None or self.pool.holding:
            return None
        rc, down = self.cfg.rollout, dict(self.pool.down_reason)
        if len(down) > rc.max_engine_restarts - self.restarts:
            return restarts_used_up(self.runtime.log_dir, down, rc.max_engine_restarts, self.restarts)
        if down and not self.pool.watched():
            return "every engine is down:\n" + describe_dead(self.runtime.log_dir, down)
        return None

    def check_engines(self, stuck: dict[int, str]) -> dict[int, str]:
        """After a failed sync: take out the engines ``stuck`` in it (no answer to their
        update) and probe the others; the engines out of service, and why."""
        if self.monitor is None:
            return {}
        for i, why in stuck.items():
            self.pool.mark_down(i, why)
        return self.monitor.check_now()

    def replace_engines(self, urls: dict[int, str]) -> int:
        """Engines started again in place of dead ones; they take requests after ``end_sync``.
        Returns the replacements the run has made."""
        for i, url in urls.items():
            self.pool.replace(i, self._client(i, url))
        self.restarts += len(urls)
        return self.restarts

    def end_sync(self, ok: bool = True) -> list[int]:
        """The sync is over; when it succeeded, replaced engines serve the current weights
        (the sender checked their version) and go back into service. Returns those."""
        joined = self.pool.join() if ok else []
        self.pool.holding = False
        self._resume_checks(joined)
        if ok and not self._synced:  # the start-up's suspension (HealthMonitor) ends too
            self._synced = True
            self._resume_checks()
        if joined:
            logger.info("%s back in service", ", ".join(self.pool.clients[i].name for i in joined))
        return joined

    # -- fully async -------------------------------------------------------------------------
    def start_stream(self, first_step: int) -> None:
        if self._stream is not None:
            raise RuntimeError("the rollout stream is already running")
        self._stream = Stream(self, first_step, self.cfg.rollout.max_inflight_batches)

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
        try:
            if self.monitor is not None:
                self.monitor.stop()
            self.stop_stream()
        finally:
            self.store.close()


class Stopped(Exception):
    """The generation was abandoned because the stream is stopping."""


class Stream:
    """Fully async rollout: batches are generated one after another on a thread and queued
    as store refs. A slot of ``max_inflight`` is taken before a batch starts and given back
    by ``release`` (after the weight sync that follows its training step) or when it is
    dropped, so the store never holds more than ``max_inflight`` batches and a sample is at
    most ``max_inflight - 1`` versions older than the weights it is trained against.

    The ledger has one entry per stored batch: each sample's outcome is ``trained`` (with
    the step), ``stale`` (older than ``algo.max_staleness`` allows) or ``end_of_run`` (still
    queued when the run ended); a generation abandoned at the end stores nothing."""

    def __init__(self, manager: RolloutManager, first_step: int, max_inflight: int) -> None:
        self.manager = manager
        self.slots = threading.Semaphore(max_inflight)
        self.ready: collections.deque[RolloutRef] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.ledger: dict[int, dict] = {}  # batch index -> entry
        self.positions: dict[int, dict] = {}  # batch index -> data position before its prompts
        self.dropped_total = 0
        self.thread = threading.Thread(target=self._produce, args=(first_step,),
                                       name="rollout-stream", daemon=True)
        self.thread.start()

    def _produce(self, step: int) -> None:
        try:
            while not self.stopping.is_set():
                if not self.slots.acquire(timeout=0.2):
                    continue
                with self.cond:
                    self.positions[step] = self.manager.state_dict()
                ref = self.manager.generate(step, stop=self.stopping)
                with self.cond:
                    self.ledger[step] = {"batch": step, "first_sample_id": ref.first_sample_id,
                                         "weight_version": ref.weight_versions,
                                         "outcome": [None] * ref.num_samples, "trained_at_step": None}
                    self.ready.append(ref)
                    self.cond.notify_all()
                step += 1
        except Stopped:
            pass
        except Exception as e:  # handed to the driver by next_batch
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def next_batch(self, step: int, max_staleness: int) -> RolloutRef:
        """The oldest queued batch with a sample fresh enough for ``step``; batches with none
        are dropped on the way (removed from the store, their slot given back)."""
        min_version = step - max_staleness
        dropped = 0
        while True:
            with self.cond:
                while not self.ready:
                    if self.error is not None:
                        raise RuntimeError(f"rollout generation failed: {self.error!r}") from self.error
                    if self.stopping.is_set():
                        raise RuntimeError("the rollout stream was stopped")
                    self.cond.wait(timeout=1.0)
                ref = self.ready.popleft()
                depth = len(self.ready)
                self.positions.pop(ref.step)
            ref.min_version = min_version
            kept = ref.kept()
            entry = self.ledger[ref.step]
            for i in np.flatnonzero(~kept):
                entry["outcome"][i] = "stale"
            dropped += int((~kept).sum())
            if kept.any():
                break
            self.manager.store.remove(ref.partitions)
            self.slots.release()
        self.dropped_total += dropped
        lag = step - np.asarray(ref.weight_versions)[kept]
        ref.stats.update({"async/staleness_mean": float(lag.mean()), "async/staleness_max": float(lag.max()),
                          "async/dropped_samples": float(dropped),
                          "async/dropped_total": float(self.dropped_total),
                          "async/queue_depth": float(depth)})
        return ref

    def resume_position(self) -> dict:
        """The data position a resumed run starts from: before the oldest batch not yet
        handed out (queued batches are generated again after a resume)."""
        with self.cond:
            return self.positions[min(self.positions)] if self.positions else self.manager.state_dict()

    def release(self, ref: RolloutRef, step: int) -> None:
        """``ref`` was trained on at ``step`` (its data is already removed): record it, free
        its slot."""
        with self.cond:
            entry = self.ledger[ref.step]
            entry["trained_at_step"] = step
            entry["outcome"] = [o or "trained" for o in entry["outcome"]]
        self.slots.release()

    def stop(self) -> list[dict]:
        self.stopping.set()
        self.thread.join(timeout=self.manager.cfg.rollout.request_timeout_s + 30)
        if self.thread.is_alive():
            logger.warning("the generation thread did not stop; a batch it still stores would be "
                           "left behind")
        with self.cond:
            leftover = list(self.ready)
            self.ready.clear()
        for ref in leftover:
            entry = self.ledger[ref.step]
            entry["outcome"] = [o or "end_of_run" for o in entry["outcome"]]
            self.manager.store.remove(ref.partitions)
        return [self.ledger[k] for k in sorted(self.ledger)]


# A module-level coroutine: an ``async def`` method would turn the Ray actor into an
# asyncio actor, whose running event loop forbids ``asyncio.run`` in ``generate``.
async def generate_groups(pool: EnginePool, prompt_ids: list[list[int]], n: int, sampling: dict,
                          timeout_s: float, label: str = "",
                          stop: threading.Event | None = None) -> list[list[dict]]:
    """``n`` samples per prompt, one request per prompt (``sampling_params.n``), all in
    flight at once; answers grouped by prompt. ``stop`` set by another thread cancels every
    request and raises ``Stopped``.

    One request per prompt rather than per sample: 64 x 8 separate requests spent most of a
    default step's generation in HTTP and batching overhead (docs/benchmarks.md). SGLang
    expands ``n`` into ``n`` scheduler requests with their own ids
    (``tokenizer_manager._handle_batch_request``), so retract, pause and the abort on a
    dropped connection still act on each sample, and each answer carries its own weight
    versions (``rl.rollout.batch.sample_weight_version``); a request per prompt (not one per
    batch) keeps SGLang's prefix warm-up of each prompt concurrent, where a batch with
    ``n > 1`` runs them one by one."""
    import aiohttp  # start-up cost: the driver imports this module to make the actor (0.15 s)

    total, done = len(prompt_ids) * n, 0
    t0 = last_print = time.perf_counter()
    params = {**sampling, "n": n}

    async def one(session, input_ids: list[int]) -> list[dict]:
        nonlocal done, last_print
        group = await pool.generate(session, {"input_ids": input_ids, "sampling_params": params,
                                              "return_logprob": True}, timeout_s)
        done += n
        now = time.perf_counter()
        if now - last_print > 5.0:  # long generations (real models) show progress
            last_print = now
            logger.info("%s: %d/%d samples, %.0fs", label, done, total, now - t0)
        return group

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.ensure_future(one(session, ids)) for ids in prompt_ids]
        everything = asyncio.gather(*tasks)
        try:
            while stop is not None and not everything.done():
                await asyncio.wait([everything], timeout=0.1)
                if stop.is_set():
                    raise Stopped
            return await everything
        finally:  # one failed request ends the gather but not its siblings: cancel each
            for t in tasks:
                t.cancel()


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    """The token ids of one prompt, as a single user turn of the chat template if asked.

    The template is rendered to text and then encoded without special tokens, which is what
    ``apply_chat_template(tokenize=True)`` does inside (the template writes BOS and the like
    itself) but with one return type on every transformers version: ``tokenize=True``
    returns ``list[int]`` on transformers 4 and a ``BatchEncoding`` on 5, whose ``list()``
    is its keys."""
    if chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
