"""``transfer_bench.py --three-hosts``: the rollout-data path in the layout users run, one
rollout host (A) and two learner hosts (B, C) with two learner ranks each.

Each case (a backend) has one producer actor on A and four consumer actors, two on B and
two on C, each building its store with ``contribute_segment=True`` as every learner rank
does. A step: the producer puts the step's batch of N samples as four partitions of N/4
samples, each ``near`` its rank (``store.location``: the segment that rank lends; Ray
ignores it), one after the other as the rollout manager does; then the four ranks GET their
partition at once. Recorded per step: PUT ms (the four puts, timed in the producer), GET ms
(the slowest rank) and the bytes every host's interfaces moved during PUT and during GET
(read from /proc/self/net/dev by one actor per host: each actor is in its host's namespace).

The checks, per case: the batch crosses the network once (A sends about the payload's bytes
over PUT and GET together: on PUT for Mooncake, on GET for Ray), and for Mooncake no GET
byte goes over ``lo`` or the network on a learner host (a rank copies its partition from
its own segment). Keys are removed after each step; cases run interleaved, run by run, with
the iperf3 ceiling (A -> B) in the same rounds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

import ray

from benchmarks.transfer_sides import Consumer, Producer, make_payload, transfer_config
from rl.backends import data_path
from rl.runtime import Runtime
from transfer.data.base import columns_nbytes

LEARNER_HOSTS = ("B", "C")
RANKS_PER_HOST = 2
RANKS = len(LEARNER_HOSTS) * RANKS_PER_HOST
TITLE = "three hosts (network namespaces on a bridge): rollout on A, two learner ranks on B and on C"
ABOUT = {"layout": "producer on host A; 4 learner ranks (2 on B, 2 on C), each lends its segment "
                   "and reads the partition put near it"}
LOCAL_TOLERANCE = 0.01
"""A Mooncake GET counts as local when its hosts moved under 1 % of the payload's bytes
over ``lo`` and the network (the rest is control traffic: master lookups, Ray calls)."""
ONCE = (0.9, 1.2)
"""A's link bytes (PUT + GET) over the payload's: about 1 when the batch crosses once
(TCP/IP headers and Ray's control traffic add a few percent)."""


@dataclass
class Case:
    backend: str
    producer: Any
    """The producer actor, on host A."""
    ranks: list
    """The consumer actors, rank order: B's two, then C's two."""
    nears: list
    """Each rank's ``store.location`` (None on Ray)."""

    def per_host(self) -> dict[str, Any]:
        """One actor per host, to read that host's interface counters."""
        return {"A": self.producer,
                **{h: self.ranks[i * RANKS_PER_HOST] for i, h in enumerate(LEARNER_HOSTS)}}

    def actors(self) -> list:
        """Producer first: the rollout manager closes before the learners (they hold the data)."""
        return [self.producer, *self.ranks]


def _place(host: str) -> dict:
    return {"num_cpus": 0, "resources": {f"host{host}": 0.01}}


def open_case(backend: str, args, master: dict | None, segment: int, part_bytes: int,
              num_nodes: int) -> Case:
    """A case's actors, their stores built as train.py builds them (driver's ``start_services``
    first, then ``build`` in each process, every rank lending a segment)."""
    transfer = transfer_config(backend, args.chunk_bytes, segment, master)
    services, stop = data_path(transfer).start_services(
        Runtime("bench", "/tmp/transfer_bench", "/unused"), num_nodes=num_nodes,
        partition_bytes=part_bytes)
    assert stop is None, "the benchmark starts the master itself"
    runtime = Runtime("bench", "/tmp/transfer_bench", "/unused", transfer=services)
    prod = ray.remote(Producer).options(**_place("A")).remote(
        transfer, runtime, False, False, [n // RANKS for n in args.sizes], args.pickle_layout)
    ranks = [ray.remote(Consumer).options(**_place(h)).remote(transfer, runtime, True, False)
             for h in LEARNER_HOSTS for _ in range(RANKS_PER_HOST)]
    ray.get([a.ready.remote() for a in (prod, *ranks)])
    return Case(backend, prod, ranks, ray.get([r.location.remote() for r in ranks]))


def counters(case: Case) -> dict[str, dict[str, int]]:
    hosts = case.per_host()
    return dict(zip(hosts, ray.get([a.net_bytes.remote() for a in hosts.values()])))


def traffic(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """MB per host between two ``counters``: ``lo`` (stayed on the host), ``tx`` and ``rx``
    (over its link to the bridge)."""
    out = {}
    for host, b in before.items():
        d = {k: (v - b.get(k, 0)) / 1e6 for k, v in after[host].items()}
        link = [k[6:] for k in d if k.startswith("tx_mb_") and k != "tx_mb_lo"]
        out[host] = {"lo": d.get("rx_mb_lo", 0.0), "tx": sum(d[f"tx_mb_{i}"] for i in link),
                     "rx": sum(d[f"rx_mb_{i}"] for i in link)}
    return out


def step(case: Case, n: int, run: int) -> dict:
    """One step: four puts near their ranks, four concurrent GETs, the keys removed."""
    keys = [f"bench3/{case.backend}/{n}/{run}/rank-{r}" for r in range(RANKS)]
    before = counters(case)
    puts = ray.get([case.producer.put.remote(n // RANKS, k, near)
                    for k, near in zip(keys, case.nears)])
    mid = counters(case)
    gets = ray.get([rank.get.remote(ref, want) for rank, (ref, _, want, _) in zip(case.ranks, puts)])
    after = counters(case)
    ray.get([case.producer.remove.remote(ref) for ref, *_ in puts])
    return {"put_ms": sum(p[1] for p in puts), "get_ms": max(g[0] for g in gets),
            "put_net": traffic(before, mid), "get_net": traffic(mid, after)}


def _median_net(steps: list[dict], phase: str) -> dict[str, dict[str, float]]:
    hosts = steps[0][phase]
    return {h: {k: statistics.median(s[phase][h][k] for s in steps) for k in hosts[h]}
            for h in hosts}


def checks(put_net: dict, get_net: dict, mb: float, mooncake: bool) -> dict[str, Any]:
    """Did the batch cross the network once, and (Mooncake) did every GET stay local?"""
    a_sent = put_net["A"]["tx"] + get_net["A"]["tx"]
    lo_get = max(get_net[h]["lo"] for h in LEARNER_HOSTS)
    link_get = sum(v["tx"] for v in get_net.values())
    out = {"a_sent_over_payload": a_sent / mb, "lo_get_mb": lo_get, "link_get_mb": link_get,
           "link_put_mb": sum(v["tx"] for v in put_net.values())}
    out["crosses_once"] = ONCE[0] <= out["a_sent_over_payload"] <= ONCE[1]
    if mooncake:
        out["put_crosses_once"] = ONCE[0] <= put_net["A"]["tx"] / mb <= ONCE[1]
        out["get_local"] = max(lo_get, link_get) < LOCAL_TOLERANCE * mb
    return out


def summarize(backend: str, n: int, mb: float, steps: list[dict]) -> dict:
    put_net, get_net = _median_net(steps, "put_net"), _median_net(steps, "get_net")
    row = {"backend": backend, "n": n, "mb": mb,
           "put_ms": statistics.median(s["put_ms"] for s in steps),
           "get_ms": statistics.median(s["get_ms"] for s in steps),
           "sum_ms": statistics.median(s["put_ms"] + s["get_ms"] for s in steps),
           "put_net_mb": put_net, "get_net_mb": get_net, "steps": steps}
    return row | checks(put_net, get_net, mb, backend.startswith("mooncake"))


def run_bench(args, masters: dict[str, dict], num_nodes: int,
              ceiling: Callable[[], float] | None) -> list[dict]:
    """Every case and the ceiling (iperf3 A -> B, GB/s), interleaved: for each N and run,
    each once, in an order that rotates from run to run."""
    part_bytes = {n: columns_nbytes(make_payload(n // RANKS)) for n in args.sizes}
    segment = 4 * max(part_bytes.values()) + (256 << 20)
    cases: list[Case] = []
    rows = []
    try:
        for b in args.backends:
            cases.append(open_case(b, args, masters.get(f"{b}/training"), segment,
                                   max(part_bytes.values()), num_nodes))
        order = cases + (["iperf3"] if ceiling else [])
        for n in args.sizes:
            steps: dict[str, list] = {c.backend: [] for c in cases}
            link: list[float] = []
            for i in range(args.warmup + args.runs):
                k = i % len(order)
                for case in order[k:] + order[:k]:
                    v = ceiling() if case == "iperf3" else step(case, n, i)
                    if i >= args.warmup:
                        (link if case == "iperf3" else steps[case.backend]).append(v)
            mb = RANKS * part_bytes[n] / 1e6
            rows += [summarize(b, n, mb, s) for b, s in steps.items()]
            if link:
                g = statistics.median(link)
                rows.append({"backend": "iperf3", "n": n, "mb": mb, "sum_ms": mb / g, "gbps": g,
                             "all": link})
            for r in rows[-len(order):]:
                print(f"  {r['backend']:16s} N={n:5d} {mb:6.1f} MB  PUT+GET {r['sum_ms']:7.1f} ms",
                      flush=True)
    finally:
        for c in cases:
            for a in c.actors():
                try:
                    ray.get(a.close.remote())
                finally:
                    ray.kill(a)
    return rows


def _verdict(r: dict) -> str:
    out = ["once" if r["crosses_once"] else f"NOT once ({r['a_sent_over_payload']:.2f}x)"]
    if "get_local" in r:
        out.append("local GET" if r["get_local"] else "GET NOT local")
    return ", ".join(out)


def print_table(rows: list[dict], title: str) -> None:
    ip = {r["n"]: r for r in rows if r["backend"] == "iperf3"}
    print(f"\n{title}\n")
    print("| backend | N | MB | PUT ms | GET ms | PUT+GET ms | GB/s | of iperf3 | MB over lo on GET "
          "(max over learner hosts) | MB over the link on GET | MB over the link on PUT | "
          "A sent / payload | check |")
    print("|---" * 13 + "|")
    for r in sorted((r for r in rows if "put_ms" in r), key=lambda r: (r["backend"], r["n"])):
        gbps = r["mb"] / r["sum_ms"]
        of = f"{gbps / ip[r['n']]['gbps']:.0%}" if r["n"] in ip else "-"
        print(f"| {r['backend']} | {r['n']} | {r['mb']:.1f} | {r['put_ms']:.1f} | {r['get_ms']:.1f} | "
              f"{r['sum_ms']:.1f} | {gbps:.2f} | {of} | {r['lo_get_mb']:.2f} | "
              f"{r['link_get_mb']:.2f} | {r['link_put_mb']:.2f} | "
              f"{r['a_sent_over_payload']:.2f} | {_verdict(r)} |")
    for r in ip.values():
        print(f"| iperf3 A -> B | {r['n']} | {r['mb']:.1f} | | | {r['sum_ms']:.1f} | "
              f"{r['gbps']:.2f} | | | | | | |")
    print("\nMB per host (medians; lo, then sent/received over the host's link)\n")
    print("| backend | N | phase | A lo | A tx/rx | B lo | B tx/rx | C lo | C tx/rx |")
    print("|---" * 9 + "|")
    for r in sorted((r for r in rows if "put_ms" in r), key=lambda r: (r["backend"], r["n"])):
        for phase in ("put", "get"):
            net = r[f"{phase}_net_mb"]
            print(f"| {r['backend']} | {r['n']} | {phase.upper()} | " + " | ".join(
                f"{net[h]['lo']:.2f} | {net[h]['tx']:.2f}/{net[h]['rx']:.2f}" for h in net) + " |")
