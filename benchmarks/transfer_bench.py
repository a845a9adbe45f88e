"""Rollout-data transfer benchmark: Ray object store vs Mooncake Store (packed and bundle).

PUT runs in a producer process, GET in a different consumer process; both are Ray actors.
The payload is a GRPO-shaped rollout batch (``rl.types.RolloutBatch``): N samples of 64..4096
tokens with token ids, loss masks, log-probs, rewards, lengths, ids and short strings.

    python benchmarks/transfer_bench.py                       # same host (one Ray node)
    sudo python benchmarks/transfer_bench.py --two-hosts      # two network namespaces + veth

``--two-hosts`` creates two Linux network namespaces joined by a veth pair, starts a Ray head
in one and a Ray worker in the other, runs the master and the producer on host A and the
consumer on host B, measures the raw TCP throughput of the link as the ceiling, and removes
everything at the end. Results: a table on stdout and JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from rl.config.transfer import BACKENDS  # noqa: E402  (every registered data path)


def make_payload(n: int, seed: int = 0) -> dict:
    """N GRPO samples of 64..4096 tokens (prompt 10-30 %), as the rollout manager stores them."""
    from rl.types import RolloutBatch

    rng = np.random.default_rng(seed)
    total = rng.integers(64, 4097, n)
    plen = np.maximum(1, (total * rng.uniform(0.1, 0.3, n)).astype(np.int32))
    rlen = (total - plen).astype(np.int32)
    batch = RolloutBatch(
        tokens=[rng.integers(0, 151_000, t, dtype=np.int32) for t in total],
        loss_mask=[np.ones(r, dtype=np.int8) for r in rlen],
        rollout_logprobs=[rng.normal(-1, 0.5, r).astype(np.float32) for r in rlen],
        prompt_len=plen, response_len=rlen, rewards=rng.random(n).astype(np.float32),
        advantages=rng.normal(0, 1, n).astype(np.float32), group_id=np.arange(n) // 8,
        sample_id=np.arange(n, dtype=np.int64), weight_version=np.zeros(n, dtype=np.int64),
        finish_reason=[["stop", "length"][i % 2] for i in range(n)],
        label=[f"label-{i}" for i in range(n)])
    return batch.to_columns()


def checksum(cols: dict) -> int:
    return int(sum(int(t.sum()) for t in cols["tokens"]) + len(cols["label"]))


def transfer_config(label: str, chunk_bytes: int, segment: int):
    """The ``transfer`` config of a registered backend, composed as train.py composes it, with
    the benchmark's chunk and segment sizes where the backend has such fields."""
    from rl.config import compose

    transfer = compose(*BACKENDS[label]).transfer
    sizes = {"chunk_bytes": chunk_bytes, "global_segment_size": max(segment, 16 << 20)}
    extra = [f"transfer.{k}={v}" for k, v in sizes.items() if hasattr(transfer, k)]
    return compose(*BACKENDS[label], *extra).transfer if extra else transfer


def _store(transfer, master: dict | None, lend: bool):
    """A store client built by the config's own ``build``, as a train.py process builds it."""
    from rl.runtime import Runtime

    services = {} if master is None else {"master_server_address": master["address"],
                                          "metadata_server": master["metadata"]}
    return transfer.build(Runtime("bench", "/tmp", "/unused", transfer=services),
                          contribute_segment=lend)


class Producer:
    def __init__(self, transfer, master: dict | None, sizes: list[int]):
        self.store = _store(transfer, master, lend=True)
        self.payloads = {n: make_payload(n) for n in sizes}
        self.sums = {n: checksum(p) for n, p in self.payloads.items()}

    def put(self, n: int, key: str):
        t0 = time.perf_counter()
        ref = self.store.put(self.payloads[n], key=key)
        return ref, (time.perf_counter() - t0) * 1e3, self.sums[n]

    def remove(self, ref) -> None:
        self.store.remove([ref])

    def serve_tcp(self, nbytes: int, count: int) -> tuple[str, int]:
        """A one-shot TCP server that sends ``nbytes`` to each of ``count`` connections."""
        import ray

        host = ray.util.get_node_ip_address()
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, 0))
        srv.listen(count)
        data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes()

        def run():
            for _ in range(count):
                conn, _ = srv.accept()
                with conn:
                    conn.sendall(data)
            srv.close()

        threading.Thread(target=run, daemon=True).start()
        return host, srv.getsockname()[1]

    def close(self) -> None:
        self.store.close()


class Consumer:
    def __init__(self, transfer, master: dict | None):
        self.store = _store(transfer, master, lend=False)

    def get(self, ref, want: int) -> float:
        t0 = time.perf_counter()
        cols = self.store.get(ref)
        ms = (time.perf_counter() - t0) * 1e3
        if checksum(cols) != want:
            raise RuntimeError(f"{ref.key}: payload differs after the round trip")
        return ms

    def fetch_tcp(self, host: str, port: int, nbytes: int) -> float:
        buf = bytearray(nbytes)
        view = memoryview(buf)
        t0 = time.perf_counter()
        with socket.create_connection((host, port)) as s:
            got = 0
            while got < nbytes:
                k = s.recv_into(view[got:], nbytes - got)
                if not k:
                    raise RuntimeError("connection closed early")
                got += k
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        self.store.close()


def run_bench(args, producer_opts: dict, consumer_opts: dict, master: dict | None) -> list[dict]:
    import ray

    rows = []
    from transfer.data.base import columns_nbytes

    for backend in args.backends:
        segment = 4 * columns_nbytes(make_payload(max(args.sizes))) + (256 << 20)
        transfer = transfer_config(backend, args.chunk_bytes, segment)
        prod = ray.remote(Producer).options(**producer_opts).remote(transfer, master, args.sizes)
        cons = ray.remote(Consumer).options(**consumer_opts).remote(transfer, master)
        try:
            for n in args.sizes:
                puts, gets = [], []
                for i in range(args.warmup + args.runs):
                    ref, put_ms, want = ray.get(prod.put.remote(n, f"bench/{backend}/{n}/{i}"))
                    get_ms = ray.get(cons.get.remote(ref, want))
                    ray.get(prod.remove.remote(ref))
                    del ref
                    if i >= args.warmup:
                        puts.append(put_ms)
                        gets.append(get_ms)
                nbytes = columns_nbytes(make_payload(n))
                rows.append({"backend": backend, "n": n, "mb": nbytes / 1e6,
                             "put_ms": statistics.median(puts), "get_ms": statistics.median(gets),
                             "put_all": puts, "get_all": gets})
                print(f"  {backend:16s} N={n:5d} {nbytes / 1e6:7.1f} MB  PUT {rows[-1]['put_ms']:8.1f} ms"
                      f"  GET {rows[-1]['get_ms']:8.1f} ms", flush=True)
        finally:
            for a in (prod, cons):
                ray.get(a.close.remote())
                ray.kill(a)
    if args.tcp:
        ray_transfer = transfer_config("ray", args.chunk_bytes, 0)
        prod = ray.remote(Producer).options(**producer_opts).remote(ray_transfer, None, [64])
        cons = ray.remote(Consumer).options(**consumer_opts).remote(ray_transfer, None)
        for n in args.sizes:
            nbytes = int(next(r["mb"] for r in rows if r["n"] == n) * 1e6)
            host, port = ray.get(prod.serve_tcp.remote(nbytes, args.warmup + args.runs))
            times = [ray.get(cons.fetch_tcp.remote(host, port, nbytes))
                     for _ in range(args.warmup + args.runs)][args.warmup:]
            rows.append({"backend": "raw-tcp", "n": n, "mb": nbytes / 1e6, "put_ms": None,
                         "get_ms": statistics.median(times), "get_all": times})
            print(f"  {'raw-tcp':16s} N={n:5d} {nbytes / 1e6:7.1f} MB  fetch {rows[-1]['get_ms']:8.1f} ms",
                  flush=True)
        for a in (prod, cons):
            ray.kill(a)
    return rows


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}\n")
    print("| N | MB | backend | PUT ms | GET ms | GET GB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        put = "-" if r["put_ms"] is None else f"{r['put_ms']:.1f}"
        print(f"| {r['n']} | {r['mb']:.1f} | {r['backend']} | {put} | {r['get_ms']:.1f} | "
              f"{r['mb'] / 1e3 / (r['get_ms'] / 1e3):.2f} |")


def same_host(args) -> None:
    import ray

    from transfer.data.mooncake_master import MooncakeMaster

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "MC_LOG_LEVEL": "WARNING"}})
    master = MooncakeMaster("127.0.0.1", log_path="/tmp/transfer_bench_master.log").start()
    try:
        rows = run_bench(args, {"num_cpus": 0}, {"num_cpus": 0},
                         {"address": master.address, "metadata": master.metadata_server})
    finally:
        master.stop()
        ray.shutdown()
    finish(args, rows, "same host (one Ray node, loopback)")


def inner_two_hosts(args) -> None:
    """Runs inside namespace A as the Ray driver (started by ``two_hosts``)."""
    import ray

    from transfer.data.mooncake_master import MooncakeMaster

    ray.init(address=args.ray_address, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "MC_LOG_LEVEL": "WARNING"}})
    master = MooncakeMaster(args.host_a, log_path="/tmp/transfer_bench_master_2h.log").start()
    try:
        rows = run_bench(args, {"num_cpus": 0, "resources": {"hostA": 0.01}},
                         {"num_cpus": 0, "resources": {"hostB": 0.01}},
                         {"address": master.address, "metadata": master.metadata_server})
    finally:
        master.stop()
        ray.shutdown()
    finish(args, rows, "two hosts (network namespaces joined by a veth pair)")


def finish(args, rows: list[dict], title: str) -> None:
    print_table(rows, title)
    out = {"title": title, "command": os.environ.get("BENCH_COMMAND", " ".join(sys.argv)),
           "machine": platform.platform(),
           "cpus": os.cpu_count(), "runs": args.runs, "warmup": args.warmup, "rows": rows,
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.out}")


def two_hosts(args) -> None:
    from benchmarks.netns import Netns

    if os.geteuid() != 0:
        sys.exit("--two-hosts needs root (it creates network namespaces)")
    net = Netns()
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": REPO}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # makes `ray start --address` abort
    port = 6390
    try:
        net.create()
        for ns, ip, res, extra in ((net.a, net.ip_a, "hostA", ["--head", f"--port={port}",
                                                                "--include-dashboard=false"]),
                                   (net.b, net.ip_b, "hostB", [f"--address={net.ip_a}:{port}"])):
            tmp = f"/tmp/ray_{ns}"
            os.makedirs(tmp, exist_ok=True)
            subprocess.run(["ip", "netns", "exec", ns, ray_bin, "start", *extra,
                            f"--node-ip-address={ip}", "--num-cpus=2",
                            f"--resources={json.dumps({res: 1})}", f"--temp-dir={tmp}",
                            "--disable-usage-stats"],
                           env={**env, "RAY_TMPDIR": tmp}, check=True, stdout=subprocess.DEVNULL)
        cmd = ["ip", "netns", "exec", net.a, sys.executable, os.path.abspath(__file__), "--inner",
               f"--ray-address={net.ip_a}:{port}", f"--host-a={net.ip_a}", f"--out={args.out}",
               f"--runs={args.runs}", f"--warmup={args.warmup}", f"--chunk-bytes={args.chunk_bytes}",
               "--sizes", *map(str, args.sizes),
               "--backends", *args.backends]
        subprocess.run(cmd, env={**env, "RAY_TMPDIR": f"/tmp/ray_{net.a}",
                                 "BENCH_COMMAND": " ".join(["python", *sys.argv])}, check=True)
    finally:
        net.remove()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--two-hosts", action="store_true", help="two network namespaces (root)")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 512, 2048])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--chunk-bytes", type=int, default=4 << 20,
                   help="Mooncake chunk size (transfer.chunk_bytes)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ray-address", help=argparse.SUPPRESS)
    p.add_argument("--host-a", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.tcp = args.two_hosts or args.inner
    args.out = args.out or os.path.join(REPO, "benchmarks", "results",
                                        "transfer_two_hosts.json" if args.tcp else "transfer_same_host.json")
    if args.inner:
        inner_two_hosts(args)
    elif args.two_hosts:
        two_hosts(args)
    else:
        same_host(args)


if __name__ == "__main__":
    main()
