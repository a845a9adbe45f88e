"""The two ends of a transfer-benchmark case (``benchmarks/transfer_bench.py``): the payload,
a producer and a consumer actor whose stores are built from the backend's config by
``rl.backends.data_path`` as a train.py process builds them, and the probes around each PUT
and GET (each Mooncake call of the packed codec timed, the interfaces' byte counters read)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from rl.backends import data_path
from rl.config.transfer import BACKENDS
from transfer.data.base import Ragged
from transfer.data.mooncake import MooncakeStore

PUT_PARTS = ("encode", "batch_put_from")
GET_PARTS = ("batch_get_into", "decode")
"""The packed codec's Mooncake calls (and its own encode/decode) timed around each PUT/GET."""


def make_payload(n: int, seed: int = 0, per_sample: bool = False) -> dict:
    """N GRPO samples of 64..4096 tokens (prompt 10-30 %), as the rollout manager stores them
    (flat ragged columns); ``per_sample``: one array per sample in each ragged column, the
    dict a trainer that keeps per-sample arrays hands to pickle (miles' layout)."""
    from rl.types import RolloutBatch

    rng = np.random.default_rng(seed)
    total = rng.integers(64, 4097, n)
    plen = np.maximum(1, (total * rng.uniform(0.1, 0.3, n)).astype(np.int32))
    rlen = (total - plen).astype(np.int32)
    resp = int(rlen.sum())
    batch = RolloutBatch(
        tokens=Ragged.from_lengths(rng.integers(0, 151_000, int(total.sum()), dtype=np.int32), total),
        loss_mask=Ragged.from_lengths(np.ones(resp, dtype=np.int8), rlen),
        rollout_logprobs=Ragged.from_lengths(rng.normal(-1, 0.5, resp).astype(np.float32), rlen),
        prompt_len=plen, response_len=rlen, rewards=rng.random(n).astype(np.float32),
        advantages=rng.normal(0, 1, n).astype(np.float32), group_id=np.arange(n) // 8,
        sample_id=np.arange(n, dtype=np.int64), weight_version=np.zeros(n, dtype=np.int64),
        finish_reason=[["stop", "length"][i % 2] for i in range(n)],
        label=[f"label-{i}" for i in range(n)])
    cols = batch.to_columns()
    if per_sample:
        cols = {k: [a.copy() for a in v] if isinstance(v, Ragged) else v for k, v in cols.items()}
    return cols


def per_sample_payload(transfer, pickle_layout: str = "per-sample") -> bool:
    """The pickle codec is measured on the per-sample dict (the baseline: Ray as miles uses
    it) unless ``pickle_layout`` is ``flat``; every other codec on the flat columns the
    manager builds."""
    return getattr(transfer, "codec", None) == "pickle" and pickle_layout == "per-sample"


def checksum(cols: dict) -> int:
    tokens = cols["tokens"]
    total = int(tokens.values.sum()) if isinstance(tokens, Ragged) else sum(int(t.sum()) for t in tokens)
    return total + len(cols["label"])


def transfer_config(label: str, chunk_bytes: int, segment: int, master: dict | None = None):
    """The ``transfer`` config of a registered backend, composed as train.py composes it, with
    the benchmark's chunk and segment sizes and the master's address where the backend has
    such fields (the two-node quickstart sets the address through MOONCAKE_MASTER)."""
    from rl.config import compose

    transfer = compose(*BACKENDS[label]).transfer
    fields = {"chunk_bytes": chunk_bytes, "global_segment_size": max(segment, 16 << 20)}
    if master:
        fields |= {"master_server_address": master["address"], "metadata_server": master["metadata"]}
    extra = [f"transfer.{k}={v}" for k, v in fields.items() if hasattr(transfer, k)]
    return compose(*BACKENDS[label], *extra).transfer if extra else transfer


def _net_bytes() -> dict[str, int]:
    """Bytes received and sent per interface of this process's network namespace."""
    out = {}
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, data = line.split(":", 1)
            out[f"rx_mb_{name.strip()}"] = int(data.split()[0])
            out[f"tx_mb_{name.strip()}"] = int(data.split()[8])
    return out


def _net_delta(before: dict[str, int]) -> dict[str, float]:
    """MB received and sent per interface since ``before`` (``lo``: stayed on this host)."""
    return {k: (v - before.get(k, 0)) / 1e6 for k, v in _net_bytes().items()}


class _TimedClient:
    """Wraps a Mooncake client: records the wall time of every call (name, ms)."""

    def __init__(self, inner) -> None:
        self._inner, self.calls = inner, []

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return attr(*a, **kw)
            finally:
                self.calls.append((name, (time.perf_counter() - t0) * 1e3))
        return timed

    def take(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, ms in self.calls:
            out[name] = out.get(name, 0.0) + ms
        self.calls.clear()
        return out


class _Side:
    """One end of a case: a store client built from the config by ``data_path``, as a
    train.py process builds it (``lend``: contribute_segment, learner local rank 0 only)."""

    def __init__(self, transfer, runtime, lend: bool, timed: bool) -> None:
        self.store = data_path(transfer).build(runtime, contribute_segment=lend)
        self.timed = None
        if timed and isinstance(self.store, MooncakeStore):  # the packed codec
            self.timed = self.store.client = _TimedClient(self.store.client)

    def calls(self) -> dict[str, float]:
        return self.timed.take() if self.timed else {}

    def ready(self) -> bool:
        return True

    def location(self) -> str | None:
        return self.store.location

    def net_bytes(self) -> dict[str, int]:
        """This host's interface byte counters (the actor's network namespace is its host's)."""
        return _net_bytes()

    def close(self) -> None:
        self.store.close()


class Producer(_Side):
    def __init__(self, transfer, runtime, lend: bool, timed: bool, sizes: list[int],
                 pickle_layout: str = "per-sample"):
        super().__init__(transfer, runtime, lend, timed)
        per_sample = per_sample_payload(transfer, pickle_layout)
        self.payloads = {n: make_payload(n, per_sample=per_sample) for n in sizes}
        self.sums = {n: checksum(p) for n, p in self.payloads.items()}
        self.blobs: dict[int, bytes] = {}

    def put(self, n: int, key: str, near: str | None = None):
        self.calls()
        net = _net_bytes()
        t0 = time.perf_counter()
        ref = self.store.put(self.payloads[n], key=key, near=near)
        ms = (time.perf_counter() - t0) * 1e3
        calls = self.calls()
        if calls:
            calls["encode"] = ref.timings_ms["encode_ms"]
            calls["other"] = ms - sum(calls[k] for k in PUT_PARTS if k in calls)
            calls |= _net_delta(net)
        return ref, ms, self.sums[n], calls

    def remove(self, ref) -> None:
        self.store.remove([ref])

    def serve_tcp(self, nbytes: int) -> tuple[str, int]:
        """A one-shot TCP server that sends ``nbytes`` to one connection."""
        import ray

        if nbytes not in self.blobs:
            self.blobs[nbytes] = np.random.default_rng(1).integers(0, 255, nbytes, np.uint8).tobytes()
        data = self.blobs[nbytes]
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((ray.util.get_node_ip_address(), 0))
        srv.listen(1)

        def run():
            conn, _ = srv.accept()
            with conn:
                conn.sendall(data)
            srv.close()

        threading.Thread(target=run, daemon=True).start()
        return srv.getsockname()


class Consumer(_Side):
    def get(self, ref, want: int) -> tuple[float, dict]:
        self.calls()
        net = _net_bytes()
        t0 = time.perf_counter()
        cols = self.store.get(ref)
        ms = (time.perf_counter() - t0) * 1e3
        calls = self.calls()
        if calls:
            calls["decode"] = self.store.get_timings_ms.get("decode_ms", 0.0)
            calls["other"] = ms - sum(calls[k] for k in GET_PARTS if k in calls)
            calls |= _net_delta(net)
        if checksum(cols) != want:
            raise RuntimeError(f"{ref.key}: payload differs after the round trip")
        return ms, calls

    def fetch_tcp(self, host: str, port: int, nbytes: int) -> float:
        view = memoryview(bytearray(nbytes))
        t0 = time.perf_counter()
        with socket.create_connection((host, port)) as s:
            got = 0
            while got < nbytes:
                k = s.recv_into(view[got:], nbytes - got)
                if not k:
                    raise RuntimeError("connection closed early")
                got += k
        return (time.perf_counter() - t0) * 1e3
