"""Rollout-data transfer benchmark: Ray object store vs Mooncake Store (packed and bundle).

PUT runs in a producer process (the rollout manager's place), GET in a consumer process
(a learner rank's place); both are Ray actors, and every store is built as train.py builds
it: the backend's config from ``rl.config.transfer.BACKENDS`` (Hydra overrides), then
through ``rl.backends.data_path`` the driver's ``start_services`` and ``build`` in each
process. The payload is a GRPO-shaped rollout batch (``rl.types.RolloutBatch``): N samples
of 64..4096 tokens with token ids, loss masks, log-probs, rewards, lengths, ids and short
strings.

Two Mooncake layouts (``--layouts``):

* ``training``: the consumer lends the segment (learner local rank 0 builds with
  ``contribute_segment=True``), the producer lends none, as in train.py: PUT writes to the
  learner's node, GET reads locally.
* ``producer-lends``: the layout this benchmark used before, the producer lends the segment:
  PUT is local, GET crosses to the producer's node.

Ray has no segment: its object stays on the producer's node and GET pulls it.

    python benchmarks/transfer_bench.py                       # same host (one Ray node)
    sudo python benchmarks/transfer_bench.py --two-hosts      # two network namespaces + veth
    sudo python benchmarks/transfer_bench.py --three-hosts    # rollout host + 2 learner hosts

``--two-hosts`` creates two Linux network namespaces joined by a veth pair, starts a Ray head
in A and a Ray worker in B, runs the masters (one per Mooncake case) and the producer on host A and
the consumer on host B, and removes everything at the end. Backends run interleaved, run by
run (the order rotates every run), so noise hits them alike; in the same rounds the link's
ceiling is measured twice: ``iperf3`` (1 s, one stream, A -> B) and a Python socket moving the payload's
byte count. For the packed codec, each Mooncake client call is timed (``--no-calls`` to skip)
to show where PUT and GET spend their time. Results: a table on stdout and JSON (``--out``;
by default under the temp directory, so that the tracked benchmarks/results/ change only
when asked).

``--three-hosts`` is the layout users run: one rollout host (A) and two learner hosts (B, C)
with two learner ranks each, three namespaces on a bridge (``benchmarks/netns.py``), a Ray
head in A and workers in B and C. Per backend, the producer on A puts each step's batch as
four partitions of N/4 samples, each near the rank that reads it (into the segment that rank
lends), and the four ranks GET theirs at once; the table adds the bytes each host moved over
``lo`` and its link, and checks that the batch crosses the network once and that a Mooncake
GET stays in its rank's process (``benchmarks/transfer_three_hosts.py``). The segment is
always the learner's (``--layouts`` does not apply).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.netns import Netns  # noqa: E402
from benchmarks.transfer_sides import (  # noqa: E402
    GET_PARTS, PUT_PARTS, Consumer, Producer, make_payload, transfer_config)
from rl.backends import data_path  # noqa: E402
from rl.config.transfer import BACKENDS  # noqa: E402  (every registered data path)

LAYOUTS = ("training", "producer-lends")
"""Who lends the Mooncake segment: the consumer (as in train.py) or the producer."""
IPERF3_PORT = 5201


def iperf3(server: str) -> float:
    """Throughput of the link in GB/s: one iperf3 stream for 1 s from here to ``server``."""
    host, port = server.rsplit(":", 1)
    r = subprocess.run(["iperf3", "-c", host, "-p", port, "-t", "1", "-J"], capture_output=True,
                       text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"iperf3 -c {server} failed: {r.stdout[-500:]} {r.stderr[-500:]}")
    return json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"] / 8e9


def _median_calls(all_calls: list[dict]) -> dict[str, float]:
    names = sorted({k for c in all_calls for k in c})
    return {k: statistics.median(c.get(k, 0.0) for c in all_calls) for k in names}


def run_bench(args, place_a: dict, place_b: dict, masters: dict[str, dict],
              num_nodes: int) -> list[dict]:
    """Every case, interleaved: for each N and run, each case once, in an order that rotates
    from run to run; the ceilings (iperf3, Python socket) take their turn in the same rounds.
    ``masters``: one per Mooncake case, ``backend/layout`` (a master places objects on any
    segment mounted with it: cases sharing one wrote into each other's segments, measured as
    loopback traffic in a GET that should have stayed in its process)."""
    import ray

    from rl.runtime import Runtime
    from transfer.data.base import columns_nbytes

    nbytes = {n: columns_nbytes(make_payload(n)) for n in args.sizes}
    segment = 4 * max(nbytes.values()) + (256 << 20)
    cases = [(b, lay) for b in args.backends for lay in layouts_of(b, args)]
    actors, ceilings = {}, ["python-socket"] + (["iperf3"] if args.iperf3_server else [])
    try:
        for backend, layout in cases:
            transfer = transfer_config(backend, args.chunk_bytes, segment, masters.get(f"{backend}/{layout}"))
            # the driver's side of train.py: check the environment, resolve the master
            services, stop = data_path(transfer).start_services(
                Runtime("bench", "/tmp/transfer_bench", "/unused"), num_nodes=num_nodes,
                partition_bytes=max(nbytes.values()))
            assert stop is None, "the benchmark starts the master itself"
            runtime = Runtime("bench", "/tmp/transfer_bench", "/unused", transfer=services)
            lend_prod = layout == "producer-lends"
            prod = ray.remote(Producer).options(**place_a).remote(
                transfer, runtime, lend_prod, args.calls, args.sizes, args.pickle_layout)
            cons = ray.remote(Consumer).options(**place_b).remote(
                transfer, runtime, layout == "training", args.calls)
            # the manager puts a rank's partition near it (its segment), as in train.py
            near = ray.get(cons.location.remote()) if layout == "training" else None
            actors[(backend, layout)] = (prod, cons, near)
            ray.get([prod.ready.remote(), cons.ready.remote()])
        socket_pair = actors[cases[0]]
        samples = {c: {"put": [], "get": [], "sum": [], "put_calls": [], "get_calls": []}
                   for c in cases}
        ceil = {c: [] for c in ceilings}
        rows = []
        for n in args.sizes:
            for s in samples.values():
                for v in s.values():
                    v.clear()
            for v in ceil.values():
                v.clear()
            order = cases + ceilings
            for i in range(args.warmup + args.runs):
                k = i % len(order)
                for case in order[k:] + order[:k]:
                    if case == "python-socket":
                        host, port = ray.get(socket_pair[0].serve_tcp.remote(nbytes[n]))
                        v = ray.get(socket_pair[1].fetch_tcp.remote(host, port, nbytes[n]))
                    elif case == "iperf3":
                        v = iperf3(args.iperf3_server)
                    else:
                        prod, cons, near = actors[case]
                        ref, put_ms, want, put_calls = ray.get(
                            prod.put.remote(n, f"bench/{case[0]}/{case[1]}/{n}/{i}", near))
                        get_ms, get_calls = ray.get(cons.get.remote(ref, want))
                        ray.get(prod.remove.remote(ref))
                        del ref
                    if i < args.warmup:
                        continue
                    if case in ceil:
                        ceil[case].append(v)
                    else:
                        s = samples[case]
                        s["put"].append(put_ms)
                        s["get"].append(get_ms)
                        s["sum"].append(put_ms + get_ms)
                        s["put_calls"].append(put_calls)
                        s["get_calls"].append(get_calls)
            mb = nbytes[n] / 1e6
            for (backend, layout), s in samples.items():
                rows.append({"backend": backend, "layout": layout, "n": n, "mb": mb,
                             "put_ms": statistics.median(s["put"]),
                             "get_ms": statistics.median(s["get"]),
                             "sum_ms": statistics.median(s["sum"]),
                             "put_all": s["put"][:], "get_all": s["get"][:],
                             "put_calls_ms": _median_calls(s["put_calls"]),
                             "get_calls_ms": _median_calls(s["get_calls"]),
                             "put_calls_all": s["put_calls"][:], "get_calls_all": s["get_calls"][:]})
                r = rows[-1]
                print(f"  {backend:16s} {layout:15s} N={n:5d} {mb:6.1f} MB  PUT {r['put_ms']:7.1f}"
                      f"  GET {r['get_ms']:7.1f}  PUT+GET {r['sum_ms']:7.1f} ms", flush=True)
            if ceil["python-socket"]:
                t = statistics.median(ceil["python-socket"])
                rows.append({"backend": "python-socket", "layout": "-", "n": n, "mb": mb,
                             "sum_ms": t, "gbps": mb / 1e3 / (t / 1e3),
                             "all": ceil["python-socket"][:]})
            if ceil.get("iperf3"):
                g = statistics.median(ceil["iperf3"])
                rows.append({"backend": "iperf3", "layout": "-", "n": n, "mb": mb,
                             "sum_ms": mb / 1e3 / g * 1e3, "gbps": g, "all": ceil["iperf3"][:]})
            for r in rows:
                if r["n"] == n and "gbps" in r:
                    print(f"  {r['backend']:32s} N={n:5d} {mb:6.1f} MB  {r['gbps']:.2f} GB/s "
                          f"({r['sum_ms']:.1f} ms for the payload's bytes)", flush=True)
    finally:
        for prod, cons, _ in actors.values():
            for a in (prod, cons):  # consumers last in training layout: they hold the data
                try:
                    ray.get(a.close.remote())
                finally:
                    ray.kill(a)
    return rows


def ratio(rows: list[dict], r: dict) -> tuple[float | None, float | None]:
    """(Ray's PUT+GET / this PUT+GET, this throughput / iperf3's) for a row."""
    ray_row = next((x for x in rows if x["backend"] == "ray-pickle" and x["n"] == r["n"]), None)
    ip = next((x for x in rows if x["backend"] == "iperf3" and x["n"] == r["n"]), None)
    speed = ray_row["sum_ms"] / r["sum_ms"] if ray_row else None
    link = (r["mb"] / r["sum_ms"]) / (ip["mb"] / ip["sum_ms"]) if ip else None
    return speed, link


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}\n")
    print("| layout | backend | N | MB | PUT ms | GET ms | PUT+GET ms | GB/s | Ray / this | of iperf3 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted((r for r in rows if "put_ms" in r),
                    key=lambda r: (r["layout"] != "training", r["layout"], r["backend"], r["n"])):
        speed, link = ratio(rows, r)
        print(f"| {r['layout']} | {r['backend']} | {r['n']} | {r['mb']:.1f} | {r['put_ms']:.1f} | "
              f"{r['get_ms']:.1f} | {r['sum_ms']:.1f} | {r['mb'] / r['sum_ms']:.2f} | "
              f"{'-' if speed is None else f'{speed:.2f}x'} | "
              f"{'-' if link is None else f'{link:.0%}'} |")
    for r in (r for r in rows if "gbps" in r):
        print(f"| ceiling | {r['backend']} | {r['n']} | {r['mb']:.1f} | | | {r['sum_ms']:.1f} | "
              f"{r['gbps']:.2f} | | |")
    timed = [r for r in rows if r.get("put_calls_ms")]
    if timed:
        print("\nwhere the packed codec's time goes (ms, medians of each part; other = the rest "
              "of the call; MB sent/received per interface of the caller's host during the call)\n")
        print("| layout | N | PUT | " + " | ".join(PUT_PARTS) + " | other | MB tx/rx (PUT) | GET | "
              + " | ".join(GET_PARTS) + " | other | MB tx/rx (GET) |")
        print("|---" * (8 + len(PUT_PARTS) + len(GET_PARTS)) + "|")
        for r in timed:
            p, g = r["put_calls_ms"], r["get_calls_ms"]

            def sent(c):
                ifs = sorted({k[6:] for k in c if k[:6] in ("rx_mb_", "tx_mb_")})
                return ", ".join(f"{i} {c.get('tx_mb_' + i, 0):.1f}/{c.get('rx_mb_' + i, 0):.1f}"
                                 for i in ifs if max(c.get("tx_mb_" + i, 0),
                                                     c.get("rx_mb_" + i, 0)) >= 0.05) or "-"
            print(f"| {r['layout']} | {r['n']} | {r['put_ms']:.1f} | "
                  + " | ".join(f"{p.get(k, 0.0):.1f}" for k in (*PUT_PARTS, "other"))
                  + f" | {sent(p)} | {r['get_ms']:.1f} | "
                  + " | ".join(f"{g.get(k, 0.0):.1f}" for k in (*GET_PARTS, "other"))
                  + f" | {sent(g)} |")


def _iperf3_server(host: str, netns: str | None = None) -> subprocess.Popen:
    """An iperf3 server on ``host`` (inside ``netns`` when given), up when this returns."""
    pre = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.Popen([*pre, "iperf3", "-s", "-B", host, "-p", str(IPERF3_PORT)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and proc.poll() is None:
        # ss, not a test connection: iperf3 would take a probe for a client
        if "LISTEN" in subprocess.run([*pre, "ss", "-Hltn", f"sport = :{IPERF3_PORT}"],
                                      capture_output=True, text=True).stdout:
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"iperf3 -s on {host}:{IPERF3_PORT} did not start "
                       "(apt-get install -y iperf3; is the port taken?)")


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def layouts_of(backend: str, args) -> list[str]:
    """Who lends the segment matters to Mooncake only; the Ray store has one layout, ``-``."""
    return args.layouts if backend.startswith("mooncake") else ["-"]


def _alive_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"])


def start_masters(host: str, args, log: str) -> dict:
    """One Mooncake master per Mooncake case on ``host`` (free ports), keyed ``backend/layout``."""
    from transfer.data.mooncake.master import MooncakeMaster

    masters = {}
    try:
        for case in (f"{b}/{lay}" for b in args.backends for lay in layouts_of(b, args) if lay != "-"):
            masters[case] = MooncakeMaster(host, log_path=f"{log}_{case.replace('/', '_')}.log").start()
    except BaseException:
        stop_masters(masters)
        raise
    return masters


def stop_masters(masters: dict) -> None:
    for m in masters.values():
        m.stop()


def _addresses(masters: dict) -> dict[str, dict]:
    return {c: {"address": m.address, "metadata": m.metadata_server} for c, m in masters.items()}


def same_host(args) -> None:
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    load = os.getloadavg()
    server = _iperf3_server("127.0.0.1") if args.iperf3 else None
    args.iperf3_server = f"127.0.0.1:{IPERF3_PORT}" if server else None
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "MC_LOG_LEVEL": "WARNING"}})
    masters = start_masters("127.0.0.1", args, "/tmp/transfer_bench_master")
    try:
        rows = run_bench(args, {"num_cpus": 0}, {"num_cpus": 0}, _addresses(masters),
                         _alive_nodes())
    finally:
        stop_masters(masters)
        ray.shutdown()
        _stop(server)
    finish(args, rows, "same host (one Ray node, loopback)", load)


@contextlib.contextmanager
def _attached(args, master_log: str):
    """Inside namespace A: attach to the cluster's Ray and start the masters on A; yields
    their addresses."""
    import ray

    ray.init(address=args.ray_address, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "MC_LOG_LEVEL": "WARNING"}})
    masters = start_masters(args.host_a, args, master_log)
    try:
        yield _addresses(masters)
    finally:
        stop_masters(masters)
        ray.shutdown()


def inner_two_hosts(args) -> None:
    """Runs inside namespace A as the Ray driver (started by ``on_hosts``)."""
    load = os.getloadavg()
    with _attached(args, "/tmp/transfer_bench_master_2h") as masters:
        rows = run_bench(args, {"num_cpus": 0, "resources": {"hostA": 0.01}},
                         {"num_cpus": 0, "resources": {"hostB": 0.01}}, masters, _alive_nodes())
    finish(args, rows, "two hosts (network namespaces joined by a veth pair)", load)


def inner_three_hosts(args) -> None:
    """Runs inside namespace A as the Ray driver (started by ``on_hosts``)."""
    # imported here: it imports ray (about 1 s), which only this driver needs
    from benchmarks import transfer_three_hosts as three

    load = os.getloadavg()
    ceiling = (lambda: iperf3(args.iperf3_server)) if args.iperf3_server else None
    with _attached(args, "/tmp/transfer_bench_master_3h") as masters:
        rows = three.run_bench(args, masters, _alive_nodes(), ceiling)
    three.print_table(rows, three.TITLE)
    write_json(args, rows, three.TITLE, load, three.ABOUT)


def finish(args, rows: list[dict], title: str, load: tuple) -> None:
    print_table(rows, title)
    write_json(args, rows, title, load, {"layouts": {
        "training": "consumer (learner) lends the segment, as train.py",
        "producer-lends": "producer lends the segment (earlier benchmark layout)"}})


def write_json(args, rows: list[dict], title: str, load: tuple, about: dict) -> None:
    """The rows and how they were measured, to ``args.out``; ``about``: the mode's layout."""
    out = {"title": title, "command": os.environ.get("BENCH_COMMAND", " ".join(sys.argv)),
           "machine": platform.platform(), "cpus": os.cpu_count(),
           "loadavg_start": load, "loadavg_end": os.getloadavg(),
           "runs": args.runs, "warmup": args.warmup, "chunk_bytes": args.chunk_bytes,
           "pickle_layout": args.pickle_layout,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("MC_", "RL_"))},
           **about, "rows": rows, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.out}")


def on_hosts(args, net: Netns, mode: str) -> None:
    """Create the hosts (``net``), a Ray head on the first and a worker on each other one
    (resource ``host<letter>``), an iperf3 server on the second, then run this script again
    inside the first as the driver (``--inner`` and ``mode``); remove everything at the end."""
    if os.geteuid() != 0:
        sys.exit(f"{mode} needs root (it creates network namespaces)")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": REPO}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # makes `ray start --address` abort
    port = 6390
    server = None
    try:
        net.create()
        for i, (host, ns, ip) in enumerate(zip(net.hosts, net.names, net.ips)):
            res = f"host{host}"
            extra = ["--head", f"--port={port}", "--include-dashboard=false"] if i == 0 \
                else [f"--address={net.ip_a}:{port}"]
            tmp = f"/tmp/ray_{ns}"
            os.makedirs(tmp, exist_ok=True)
            subprocess.run(["ip", "netns", "exec", ns, ray_bin, "start", *extra,
                            f"--node-ip-address={ip}", "--num-cpus=2",
                            f"--resources={json.dumps({res: 1})}", f"--temp-dir={tmp}",
                            "--disable-usage-stats"],
                           env={**env, "RAY_TMPDIR": tmp}, check=True, stdout=subprocess.DEVNULL)
        if args.iperf3:
            server = _iperf3_server(net.ip_b, netns=net.b)
        cmd = ["ip", "netns", "exec", net.a, sys.executable, os.path.abspath(__file__), "--inner", mode,
               f"--ray-address={net.ip_a}:{port}", f"--host-a={net.ip_a}", f"--out={args.out}",
               f"--runs={args.runs}", f"--warmup={args.warmup}", f"--chunk-bytes={args.chunk_bytes}",
               "--sizes", *map(str, args.sizes), "--backends", *args.backends,
               "--layouts", *args.layouts, f"--pickle-layout={args.pickle_layout}",
               *([] if args.calls else ["--no-calls"]),
               *([f"--iperf3-server={net.ip_b}:{IPERF3_PORT}"] if server else [])]
        subprocess.run(cmd, env={**env, "RAY_TMPDIR": f"/tmp/ray_{net.a}",
                                 "BENCH_COMMAND": " ".join(["python", *sys.argv])}, check=True)
    finally:
        _stop(server)
        net.remove()


def two_hosts(args) -> None:
    on_hosts(args, Netns(), "--two-hosts")


def three_hosts(args) -> None:
    # a prefix and subnet of its own: a two-host run (rlbA, rlbB) may be up at the same time
    on_hosts(args, Netns(prefix="rl3", subnet="10.231.8", hosts=("A", "B", "C")), "--three-hosts")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--two-hosts", action="store_true", help="two network namespaces (root)")
    p.add_argument("--three-hosts", action="store_true",
                   help="a rollout host and two learner hosts of two ranks each (root)")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 512, 2048])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS,
                   help="who lends the Mooncake segment (training: the consumer, as train.py)")
    p.add_argument("--pickle-layout", choices=("per-sample", "flat"), default="per-sample",
                   help="what the pickle codec moves: the per-sample dict (one array per sample, "
                        "as a trainer that keeps per-sample arrays has it) or the flat columns "
                        "the rollout manager builds (what transfer.codec=pickle stores in training)")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None,
                   help="where the JSON goes (default: transfer_same_host.json, "
                        "transfer_two_hosts.json or transfer_three_hosts.json under "
                        f"{tempfile.gettempdir()}/rl-benchmarks; "
                        "benchmarks/results/<that name> updates the tracked results)")
    p.add_argument("--chunk-bytes", type=int, default=4 << 20,
                   help="Mooncake chunk size (transfer.chunk_bytes)")
    p.add_argument("--no-iperf3", dest="iperf3", action="store_false",
                   help="skip the iperf3 ceiling (apt-get install -y iperf3)")
    p.add_argument("--no-calls", dest="calls", action="store_false",
                   help="do not time each Mooncake client call")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ray-address", help=argparse.SUPPRESS)
    p.add_argument("--host-a", help=argparse.SUPPRESS)
    p.add_argument("--iperf3-server", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.two_hosts and args.three_hosts:
        p.error("--two-hosts and --three-hosts: pick one")
    if args.three_hosts:
        args.layouts = ["training"]  # every learner rank lends its segment
    mode = "three_hosts" if args.three_hosts else \
        "two_hosts" if args.two_hosts or args.inner else "same_host"
    args.out = args.out or os.path.join(tempfile.gettempdir(), "rl-benchmarks",
                                        f"transfer_{mode}.json")
    return args


def main() -> None:
    args = parse_args()
    if args.iperf3 and not args.inner and not shutil.which("iperf3"):
        sys.exit("iperf3 is not installed: apt-get install -y iperf3 (or pass --no-iperf3)")
    if args.inner:
        (inner_three_hosts if args.three_hosts else inner_two_hosts)(args)
    elif args.three_hosts:
        three_hosts(args)
    elif args.two_hosts:
        two_hosts(args)
    else:
        same_host(args)


if __name__ == "__main__":
    main()
