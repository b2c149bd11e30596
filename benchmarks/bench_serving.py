"""Serving throughput: 8 concurrent clients vs one request at a time, same worker, same requests, same run.

    .venv/bin/python benchmarks/bench_serving.py [--model smollm2] [--requests 16] [--max-tokens 48]

A ``boltstream serve`` worker runs as its own process on the embedded stack
with token capture ON (every answer waits for its span's broker ack), as in
training. The same seeded chat requests are sent sequentially, then by
``--clients`` closed-loop clients sharing one queue, alternating for
``--rounds`` rounds (so load from other processes hits both modes alike).
Throughput is generated tokens / wall time; the ratio shows what the
continuous batching buys.
JSON goes to benchmarks/results/serving.json.
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
from pathlib import Path
from typing import Any

import httpx

from boltstream.inference.launch import WorkerProcess
from boltstream.stack import embedded_stack, settings_env
from boltstream.weights.models import model_dir

RESULTS = Path(__file__).parent / "results"
TOPICS = ["the ocean", "a robot learning to paint", "prime numbers", "a rainy day in Lisbon", "compilers",
          "honeybees", "the moon landing", "sourdough bread"]


def requests(model: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    return [{"model": model, "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
             "messages": [{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}."}]}
            for i in range(n)]


async def _one(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = await http.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"], time.perf_counter() - t0


async def sequential(http: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [await _one(http, b) for b in bodies]


async def concurrent(http: httpx.AsyncClient, bodies: list[dict[str, Any]], clients: int) -> list[tuple[int, float]]:
    todo: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for b in bodies:
        todo.put_nowait(b)
    out: list[tuple[int, float]] = []

    async def client() -> None:
        while not todo.empty():
            out.append(await _one(http, todo.get_nowait()))

    await asyncio.gather(*(client() for _ in range(clients)))
    return out


def summarise(results: list[tuple[int, float]], wall: float) -> dict[str, Any]:
    tokens = sum(t for t, _ in results)
    lat = sorted(s for _, s in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "latency_median_s": statistics.median(lat), "latency_max_s": lat[-1]}


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Alternate the two modes for ``--rounds`` rounds, so a change in machine load hits both alike."""
    bodies = requests(args.model, args.requests, args.max_tokens)
    seq_all: list[tuple[int, float]] = []
    conc_all: list[tuple[int, float]] = []
    seq_wall = conc_wall = 0.0
    rounds = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await _one(http, dict(bodies[0], max_tokens=4))  # warm-up
        for r in range(args.rounds):
            t0 = time.perf_counter()
            seq = await sequential(http, bodies)
            t1 = time.perf_counter()
            conc = await concurrent(http, bodies, args.clients)
            t2 = time.perf_counter()
            seq_all += seq
            conc_all += conc
            seq_wall += t1 - t0
            conc_wall += t2 - t1
            rnd = {"sequential": summarise(seq, t1 - t0), "concurrent": summarise(conc, t2 - t1),
                   "loadavg": os.getloadavg()[0]}
            rnd["speedup"] = rnd["concurrent"]["tokens_per_s"] / rnd["sequential"]["tokens_per_s"]
            rounds.append(rnd)
            print(f"round {r + 1}: one at a time {rnd['sequential']['tokens_per_s']:.1f} tok/s, {args.clients} "
                  f"concurrent {rnd['concurrent']['tokens_per_s']:.1f} tok/s -> {rnd['speedup']:.2f}x "
                  f"(load average {rnd['loadavg']:.1f})", flush=True)
    seq_s, conc_s = summarise(seq_all, seq_wall), summarise(conc_all, conc_wall)
    return {"sequential": seq_s, "concurrent": conc_s, "speedup": conc_s["tokens_per_s"] / seq_s["tokens_per_s"],
            "rounds": rounds}


def worker_env(settings: Any, folder: str) -> dict[str, str]:
    """This process's environment pointed at ``settings``' stack only (no BOLTSTREAM_* of the caller's,
    no state file of a user's own stack)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
    env.update(settings_env(settings), BOLTSTREAM_STATE_FILE=str(Path(folder) / "none.json"))
    return env


def serving_args(description: str, out: str, argv: list[str] | None) -> argparse.Namespace:
    """The options both serving benchmarks take (this one and bench_serving_adapters.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / out))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = serving_args(__doc__.split("\n\n")[0], "serving.json", argv)
    model_dir(args.model)  # de-quantise once, outside the timings
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as d, embedded_stack(d) as settings:
        env = worker_env(settings, d)
        with WorkerProcess(["--model", args.model, "--port", "0", "--max-batch-size", str(args.clients)],
                           env=env, log_path=Path(d) / "worker.log") as worker:
            assert worker.url is not None
            results = asyncio.run(run(worker.url, args))
    report = {"benchmark": "serving", "model": args.model, "clients": args.clients, "max_tokens": args.max_tokens,
              "cpus": os.cpu_count(), "machine": platform.machine(), "python": sys.version.split()[0],
              "capture": True, **results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"throughput ratio ({args.clients} concurrent / one at a time): {results['speedup']:.2f}x -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
