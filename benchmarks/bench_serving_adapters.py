"""Serving throughput with two LoRA adapters loaded (requests alternating between them) vs one, same run.

    .venv/bin/python benchmarks/bench_serving_adapters.py [--model smollm2] [--requests 16] [--max-tokens 48]

Two ``boltstream serve`` workers run side by side on the embedded stack, capture ON
(as in training): the baseline serves one adapter (``--adapters writer``), the
candidate two on the same base (``--adapters writer,checker``). Each adapter gets a
published rank-16 q/k/v/o LoRA checkpoint before timing, so every request really
runs through an adapter. The same seeded chat requests go to both workers from
``--clients`` closed-loop clients: to the baseline all for ``writer``, to the
candidate alternating ``writer`` / ``checker`` by the ``model`` field. The two are
measured in alternation for ``--rounds`` rounds, so a change in machine load hits
both alike. Throughput is generated tokens / wall time; the ratio two / one is
the price of a batch never mixing adapters (the engine decodes one adapter's
requests per batch). Each worker's resident memory is recorded too: the second
adapter adds only its LoRA tensors, not a second base model.
JSON goes to benchmarks/results/serving_adapters.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaProducer
from bench_reload import lora_checkpoints
from bench_serving import concurrent, requests, serving_args, summarise, worker_env

from boltstream import s3
from boltstream.broker.kafka import producer_kwargs
from boltstream.inference.launch import WorkerProcess
from boltstream.schemas import Codec
from boltstream.stack import embedded_stack
from boltstream.weights.checkpoints import announce_checkpoint, publish_checkpoint
from boltstream.weights.models import model_dir

RESULTS = Path(__file__).parent / "results"
ADAPTERS = ("writer", "checker")


def rss_mib(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def publish_adapters(settings: Any, model: str, tmp: Path) -> None:
    """One LoRA checkpoint (v1) per adapter, announced like the learner does."""
    client = s3.make_client(settings)
    producer = AIOKafkaProducer(**producer_kwargs(settings, linger_ms=0))
    await producer.start()
    try:
        for name, local in zip(ADAPTERS, lora_checkpoints(model, tmp, len(ADAPTERS)), strict=True):
            event = await asyncio.to_thread(publish_checkpoint, client, settings.s3_bucket, f"bench-{name}", 1, local,
                                            kind="lora", base_model=model, learner_step=1, model_name=name)
            await announce_checkpoint(producer, Codec(), settings.topic("checkpoints"), event)
    finally:
        await producer.stop()


async def wait_loaded(url: str, adapters: tuple[str, ...]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=200) as http:
        for name in adapters:
            health = (await http.get("/health", params={"adapter": name, "min_version": 1, "timeout": 180})).json()
            if not health["condition_met"]:
                raise RuntimeError(f"adapter {name} never loaded its checkpoint: {health}")


async def run(one: str, two: str, args: argparse.Namespace) -> dict[str, Any]:
    """Alternate the two workers for ``--rounds`` rounds on the same requests."""
    bodies = requests("writer", args.requests, args.max_tokens)
    alternating = [dict(b, model=ADAPTERS[i % 2]) for i, b in enumerate(bodies)]
    totals: dict[str, list[Any]] = {"one": [[], 0.0], "two": [[], 0.0]}
    rounds = []
    async with httpx.AsyncClient(base_url=one, timeout=600) as h1, httpx.AsyncClient(base_url=two, timeout=600) as h2:
        for http, warm in ((h1, bodies[:2]), (h2, alternating[:2])):  # warm-up, both adapters
            await concurrent(http, [dict(b, max_tokens=4) for b in warm], 2)
        for r in range(args.rounds):
            rnd: dict[str, Any] = {}
            for mode, http, batch in (("one", h1, bodies), ("two", h2, alternating)):
                t0 = time.perf_counter()
                res = await concurrent(http, batch, args.clients)
                wall = time.perf_counter() - t0
                totals[mode][0] += res
                totals[mode][1] += wall
                rnd[mode] = summarise(res, wall)
            rnd["ratio"] = rnd["two"]["tokens_per_s"] / rnd["one"]["tokens_per_s"]
            rnd["loadavg"] = os.getloadavg()[0]
            rounds.append(rnd)
            print(f"round {r + 1}: one adapter {rnd['one']['tokens_per_s']:.1f} tok/s, two alternating "
                  f"{rnd['two']['tokens_per_s']:.1f} tok/s -> {rnd['ratio']:.2f}x "
                  f"(load average {rnd['loadavg']:.1f})", flush=True)
    one_s, two_s = summarise(*totals["one"]), summarise(*totals["two"])
    return {"one_adapter": one_s, "two_adapters": two_s, "ratio": two_s["tokens_per_s"] / one_s["tokens_per_s"],
            "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    args = serving_args(__doc__.split("\n\n")[0], "serving_adapters.json").parse_args(argv)
    model_dir(args.model)  # de-quantise once, outside the timings
    with tempfile.TemporaryDirectory(prefix="bench-adapters-") as d, embedded_stack(d) as settings:
        env = worker_env(settings, d)
        common = ["--model", args.model, "--port", "0", "--max-batch-size", str(args.clients)]
        asyncio.run(publish_adapters(settings, args.model, Path(d)))
        with WorkerProcess([*common, "--adapters", ADAPTERS[0]], env=env, log_path=Path(d) / "one.log") as w1, \
                WorkerProcess([*common, "--adapters", ",".join(ADAPTERS)], env=env,
                              log_path=Path(d) / "two.log") as w2:
            assert w1.url is not None and w2.url is not None and w1.proc and w2.proc
            asyncio.run(wait_loaded(w1.url, ADAPTERS[:1]))
            asyncio.run(wait_loaded(w2.url, ADAPTERS))
            results = asyncio.run(run(w1.url, w2.url, args))
            memory = {"one_adapter_rss_mib": rss_mib(w1.proc.pid), "two_adapters_rss_mib": rss_mib(w2.proc.pid)}
    report = {"benchmark": "serving_adapters", "model": args.model, "clients": args.clients,
              "max_tokens": args.max_tokens, "lora": "r=16 q/k/v/o", "cpus": os.cpu_count(),
              "machine": platform.machine(), "python": sys.version.split()[0], "capture": True, **results, **memory}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"resident memory: one adapter {memory['one_adapter_rss_mib']:.0f} MiB, two adapters "
          f"{memory['two_adapters_rss_mib']:.0f} MiB")
    print(f"throughput ratio (two adapters alternating / one adapter): {results['ratio']:.2f}x -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
