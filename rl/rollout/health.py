"""Engine health, watched from the rollout manager (``rollout.fault_tolerance``).

Two checks per engine in service, on a thread of its own:

- every ``PORT_PROBE_S``, a TCP connect to its server: a refusal means the process is gone
  (the kernel accepts even while a server is busy), so a killed engine is out of service
  within a fraction of a second;
- every ``rollout.health_check_interval_s``, once ``rollout.health_check_first_wait_s`` has
  passed since it came into service, ``GET /health_generate`` (one generated token, on SGLang
  and the CPU engine alike) bounded by ``rollout.health_check_timeout_s``: catches a server
  that still accepts connections but no longer generates (hung, stopped, deadlocked).

A dead engine is taken out of service (``rl.rollout.fleet.EngineSet``; its requests in
flight go to the others) and replaced at the next weight sync (``EngineFleet.prepare_sync``). While
the engines are paused or receiving weights they do not generate, so ``/health_generate`` is
not asked then (``suspend``), nor before the first sync has ended (start-up forms the
weight-update groups), and an answer that spans a suspension does not count.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from rl.probe import host_port, probe_port

PORT_PROBE_S = 0.5


def refused(url: str) -> str | None:
    """Why the server at ``url`` is gone (its port refuses connections), or None (a miss is
    left to ``/health_generate``)."""
    outcome, why = probe_port(*host_port(url))
    return f"its process is gone ({why})" if outcome == "refused" else None


class HealthMonitor:
    def __init__(self, engines, interval_s: float, timeout_s: float,
                 first_wait_s: float) -> None:
        """``engines``: the fleet's ``EngineSet`` (not imported here: the fleet imports this
        module), whose dead engines this takes out of service."""
        self.engines = engines
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.first_wait_s = first_wait_s
        now = time.monotonic()
        self.in_service_since = [now] * len(engines.clients)
        self._suspended = 1  # until the first sync ends: start-up forms the weight groups
        self._epoch = 0  # bumped by every suspend: an answer started before one does not count
        self._lock = threading.Lock()
        self._checks: dict[int, Future] = {}
        self._executor = ThreadPoolExecutor(max_workers=len(engines.clients), thread_name_prefix="health")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-health", daemon=True)

    def start(self) -> "HealthMonitor":
        self._thread.start()
        return self

    def suspend(self) -> None:
        with self._lock:
            self._suspended += 1
            self._epoch += 1

    def resume(self, joined: list[int] = ()) -> None:
        """End a suspension; ``joined`` engines came into service now (their first wait
        starts)."""
        with self._lock:
            self._suspended = max(0, self._suspended - 1)
            now = time.monotonic()
            for i in joined:
                self.in_service_since[i] = now

    def check_now(self) -> dict[int, str]:
        """Probe every engine in service at once (its port: engines paused or receiving
        weights do not generate); take the dead ones out; return every engine out of
        service and why."""
        for i in self.engines.watched():
            why = refused(self.engines.clients[i].url)
            if why is not None:
                self.engines.mark_down(i, why)
        return dict(self.engines.down_reason)

    def _no_generation(self, client) -> str | None:
        why = client.health_generate(self.timeout_s)
        return None if why is None else f"no answer to /health_generate within {self.timeout_s:g}s ({why})"

    def _run(self) -> None:
        next_check = time.monotonic() + self.interval_s
        while not self._stop.wait(PORT_PROBE_S):
            self.check_now()
            now = time.monotonic()
            if now >= next_check:
                next_check = now + self.interval_s
                self._start_checks(now)

    def _start_checks(self, now: float) -> None:
        with self._lock:
            if self._suspended:
                return
            epoch = self._epoch
        for i in self.engines.live():
            if now - self.in_service_since[i] < self.first_wait_s:
                continue
            pending = self._checks.get(i)
            if pending is not None and not pending.done():
                continue  # the last one is still waiting: its timeout decides
            client = self.engines.clients[i]
            f = self._executor.submit(self._no_generation, client)
            f.add_done_callback(lambda f, i=i, client=client: self._checked(i, client, epoch, f))
            self._checks[i] = f

    def _checked(self, i: int, client, epoch: int, f: Future) -> None:
        why = f.result()
        with self._lock:
            counts = not self._suspended and self._epoch == epoch
        # the answer is about this engine, asked while it generated, and it is still the one in service
        if why is not None and counts and self.engines.clients[i] is client:
            self.engines.mark_down(i, why)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._executor.shutdown(wait=False, cancel_futures=True)
