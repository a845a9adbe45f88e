"""Weight-sync benchmark: weights=broadcast vs weights=p2p on CPU with gloo.

R sender processes (learner ranks, each holding the whole model as plain tensors, so FSDP's
gather is not part of the timing) push random bf16 weights into E receiver processes. A
receiver is a small HTTP server with the weight-update endpoints of SGLang's protocol (the
same ones the CPU engine serves) that receives every tensor into a fresh buffer and drops
it; the senders reach it through the project's ``EngineClient``, so the measured path is the
production code in ``transfer/weights``.

    python benchmarks/weight_sync_bench.py                       # default grid
    python benchmarks/weight_sync_bench.py --params 25e6 --engines 4 --learners 1 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def serve_receiver(port: int) -> None:
    """A weights-only engine: SGLang's weight-update endpoints, no model."""
    import torch
    from aiohttp import web

    from transfer.weights.group import init_side_group

    torch.set_num_threads(1)
    state = {"version": "default", "groups": {}}

    async def blocking(fn):
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    async def init(request):
        b = await request.json()
        await blocking(lambda: state["groups"].__setitem__(b["group_name"], init_side_group(
            backend=b["backend"], master_address=b["master_address"], master_port=b["master_port"],
            rank=b["rank_offset"], world_size=b["world_size"], group_name=b["group_name"],
            timeout_s=300)))
        return web.json_response({"success": True, "message": ""})

    async def update(request):
        b = await request.json()
        group = state["groups"][b["group_name"]]

        def recv():
            for dtype, shape in zip(b["dtypes"], b["shapes"]):
                group.broadcast(torch.empty(shape, dtype=getattr(torch, dtype)), src=0)
        await blocking(recv)
        state["version"] = b["weight_version"]
        return web.json_response({"success": True, "message": ""})

    async def destroy(request):
        b = await request.json()
        state["groups"].pop(b["group_name"]).destroy()
        return web.json_response({"success": True, "message": ""})

    async def model_info(_):
        return web.json_response({"weight_version": state["version"]})

    async def ok(_):  # session open/close and the cache flush: nothing to do without a model
        return web.json_response({"success": True, "message": ""})

    async def health(_):
        return web.Response(text="")

    app = web.Application()
    app.add_routes([web.post("/init_weights_update_group", init),
                    web.post("/update_weights_from_distributed", update),
                    web.post("/destroy_weights_update_group", destroy),
                    web.post("/begin_weight_update", ok), web.post("/end_weight_update", ok),
                    web.post("/flush_cache", ok), web.get("/model_info", model_info),
                    web.get("/health", health)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def model_tensors(num_params: int, seed: int = 0):
    """Random bf16 tensors shaped like a transformer's: 1/8 embedding, the rest in 56 matrices."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = 64
    while hidden * hidden * 64 < num_params and hidden < 4096:
        hidden *= 2
    emb_rows = max(1, num_params // 8 // hidden)
    tensors = [("embed", torch.randn(emb_rows, hidden, generator=g, dtype=torch.bfloat16))]
    per = max(1, (num_params - emb_rows * hidden) // 56 // hidden)
    tensors += [(f"layer.{i}", torch.randn(per, hidden, generator=g, dtype=torch.bfloat16))
                for i in range(56)]
    return tensors


def sender(rank: int, world: int, port: int, urls: list[str], path: str, num_params: int,
           bucket_bytes: int, runs: int, warmup: int, out_q) -> None:
    import torch
    import torch.distributed as dist

    from rl.rollout.client import EngineClient
    from transfer.weights.broadcast import BroadcastSync
    from transfer.weights.p2p import P2PSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensors = model_tensors(num_params)
    clients = [EngineClient(u, f"engine-{i}", timeout_s=600) for i, u in enumerate(urls)]
    kw = dict(rank=rank, master_address="127.0.0.1", bucket_bytes=bucket_bytes, backend="gloo",
              timeout_s=600)
    sync = P2PSync(world_size=world, **kw) if path == "p2p" else BroadcastSync(**kw)
    sync.connect(clients)
    times, sent = [], 0.0
    for i in range(warmup + runs):
        dist.barrier()
        t0 = time.perf_counter()
        m = sync.push(tensors, version=i + 1)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        sent = m["weights/sender_bytes"]
    busiest = torch.tensor([sent])
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    if rank == 0:
        out_q.put({"seconds": statistics.median(times), "all": times,
                   "busiest_sender_bytes": float(busiest)})
    sync.close()
    dist.destroy_process_group()


def start_receivers(count: int):
    """``count`` receiver servers, reused by every configuration of the grid."""
    import multiprocessing as mp

    import requests

    from transfer.net import free_port

    ctx = mp.get_context("spawn")
    ports = [free_port() for _ in range(count)]
    procs = [ctx.Process(target=serve_receiver, args=(p,), daemon=True) for p in ports]
    for p in procs:
        p.start()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    deadline = time.monotonic() + 120
    for u in urls:
        while True:
            try:
                requests.get(u + "/health", timeout=1)
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    return procs, urls


def run_one(path: str, urls: list[str], learners: int, num_params: int, bucket_bytes: int,
            runs: int, warmup: int) -> dict:
    import multiprocessing as mp

    from transfer.net import free_port

    ctx = mp.get_context("spawn")
    engines = len(urls)
    q = ctx.Queue()
    port = free_port()
    senders = [ctx.Process(target=sender, args=(r, learners, port, urls, path, num_params,
                                                bucket_bytes, runs, warmup, q))
               for r in range(learners)]
    for p in senders:
        p.start()
    result = q.get(timeout=3600)
    for p in senders:
        p.join(60)
    model_bytes = sum(t.numel() * 2 for _, t in model_tensors(num_params))
    return {"path": path, "engines": engines, "learners": learners, "params": num_params,
            "model_bytes": model_bytes, **result,
            "busiest_sender_models": result["busiest_sender_bytes"] / model_bytes,
            "gbps": model_bytes * engines / 1e9 / result["seconds"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, nargs="+", default=[1.3e5, 25e6, 125e6, 500e6])
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--learners", type=int, nargs="+", default=[1, 2])
    p.add_argument("--bucket-bytes", type=int, default=512 << 20)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "rl-benchmarks", "weight_sync.json"),
                   help="where the JSON goes (default: %(default)s; "
                        "benchmarks/results/weight_sync.json updates the tracked results)")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    rows = []
    procs, urls = start_receivers(max(args.engines))
    print("| params | E | R | path | s/sync | busiest sender (models) | GB/s delivered |")
    print("|---|---|---|---|---|---|---|")
    for n in args.params:
        for e in args.engines:
            for r in args.learners:
                for path in ("broadcast", "p2p"):
                    row = run_one(path, urls[:e], r, int(n), args.bucket_bytes, args.runs,
                                  args.warmup)
                    rows.append(row)
                    print(f"| {n:.3g} | {e} | {r} | {path} | {row['seconds']:.3f} | "
                          f"{row['busiest_sender_models']:.0f} | {row['gbps']:.2f} |", flush=True)
    for p in procs:
        p.terminate()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "machine": platform.platform(),
                   "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
