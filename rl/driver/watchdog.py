"""The driver watches what a run depends on and says which one died.

Without it a dead Mooncake master surfaces only when a client's RPC gives up (26.5 s,
measured, as a ``put ... RPC_FAIL`` from the manager) and a dead node as whatever actor
call happened to be waiting. A thread probes each dependency once a second: a TCP connect to
the master (the kernel accepts even while the server is busy, so a refusal means the process
is gone), the rollout manager's word on its engines (``EngineFleet.failure``), and Ray's
node table for the nodes alive at start. On
the first death it records what died and interrupts the main thread as Ctrl-C does, so the
run unwinds through its ``finally`` blocks and ``Cluster.__exit__`` raises an error naming it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable, Optional

import ray

from rl.driver.nodes import describe_nodes
from rl.probe import probe_port

logger = logging.getLogger(__name__)
Probe = Callable[[], Optional[str]]
"""None while alive, else why it is considered dead."""
STOP_WAIT_S = 30.0
"""How long ``Watchdog.stop`` waits for a probe round in progress."""


class Watchdog:
    def __init__(self, period_s: float = 1.0, misses: int = 3) -> None:
        self.period_s = period_s
        self.misses = misses  # consecutive misses that count as dead (a refusal counts at once)
        self.probes: list[tuple[str, Probe]] = []
        self.failure: Optional[str] = None
        self.fired = False
        """Whether the main thread was interrupted (its KeyboardInterrupt is this watchdog's)."""
        self._stop = threading.Event()
        self._lock = threading.Lock()  # no interrupt once stop() has begun
        self._thread: Optional[threading.Thread] = None

    def watch(self, name: str, probe: Probe) -> None:
        self.probes.append((name, probe))

    def watch_port(self, name: str, host: str, port: int) -> None:
        state = {"misses": 0}

        def probe() -> Optional[str]:
            outcome, why = probe_port(host, port)
            if outcome == "refused":  # nothing listens there any more
                return why
            state["misses"] = state["misses"] + 1 if outcome == "miss" else 0
            return f"{why} for {self.misses} probes" if state["misses"] >= self.misses else None

        self.watch(name, probe)

    def check_now(self) -> Optional[str]:
        """Probe everything once; the first death found (or the one already recorded)."""
        if self.failure is None:
            for name, probe in self.probes:
                why = probe()
                if why is not None:
                    self.failure = f"{name} died: {why}"
                    break
        return self.failure

    def check_settling(self) -> Optional[str]:
        """After the run failed: probe up to ``misses`` rounds, a period apart, until a death
        is found. A dependency that just died can look alive or only missed for a moment (a
        killed process's port closes as it finishes exiting), and the error it caused may
        arrive before that; one probe would leave it unnamed."""
        for round_ in range(self.misses):
            if round_:
                time.sleep(self.period_s)
            if self.check_now() is not None:
                break
        return self.failure

    def start(self) -> "Watchdog":
        # A driver started in the background (nohup, a job runner) may inherit SIGINT ignored,
        # and one started by `ray job submit` inherits it blocked (Ray starts its processes
        # with SIGINT masked): the interrupt below must reach the main thread as
        # KeyboardInterrupt, so handle and unblock it there.
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
                signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """After this returns no interrupt comes (one already sent has ``fired`` set)."""
        with self._lock:
            self._stop.set()
        if self._thread is not None:
            # a round is short (a 2 s connect per port, a 5 s bound on the manager's answer),
            # but Ray's node table has no bound of its own: a thread still probing cannot
            # interrupt any more (the lock above), and is a daemon
            self._thread.join(timeout=STOP_WAIT_S)
            if self._thread.is_alive():
                logger.warning("the watchdog's probe did not return within %.0fs; left behind", STOP_WAIT_S)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.check_now() is not None:
                with self._lock:
                    if self._stop.is_set():
                        return  # the run is already shutting down: let it finish
                    self.fired = True
                    logger.error("%s; stopping the run", self.failure)
                    os.kill(os.getpid(), signal.SIGINT)  # the main thread unwinds as on Ctrl-C
                return


def ray_nodes_probe() -> Probe:
    """Dead when a node alive now (at the call) leaves Ray's node table."""
    def alive() -> dict[str, dict]:
        return {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}

    start = alive()

    def probe() -> Optional[str]:
        gone = [n for i, n in start.items() if i not in alive()]
        return f"{describe_nodes(gone)} left the cluster" if gone else None

    return probe
