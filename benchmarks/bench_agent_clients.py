"""A step's rollouts starting at once: an OpenAI client per rollout against one shared client, same run.

    .venv/bin/python benchmarks/bench_agent_clients.py [--rollouts 32] [--calls 2] [--rounds 5]

What the worker waits for at the start of every step: ``--rollouts`` agent threads (the runner's) start
together, each makes its client and ``--calls`` chat completions. The endpoint is a local HTTP server
that answers at once, so the wall time is the agents' own cost: ``per_rollout`` builds ``OpenAI()`` in
every rollout (what the example agents did), ``shared`` takes the endpoint's one client with the
rollout's headers (``examples/endpoint.py``). Both send the same requests; prints the best wall time of
each over ``--rounds`` (alternating), their ratio and the CPU's facts, and writes
benchmarks/results/agent_clients.json.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from machine import cpu_facts, describe_cpu, write_report
from openai import OpenAI

from boltstream.examples import endpoint

RESULTS = Path(__file__).resolve().parent / "results"
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "policy",
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": "CALC: 4 * 9"}}]}).encode()


class _Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def log_message(self, *args: object) -> None:
        pass


def _client(kind: str, ctx: Any) -> OpenAI:
    if kind == "per_rollout":
        return OpenAI(base_url=ctx.base_url, api_key="unused", default_headers=ctx.headers, max_retries=0)
    return endpoint.client(ctx)


def wave(kind: str, base_url: str, rollouts: int, calls: int) -> float:
    """Seconds until every rollout of one step has made its client and its calls."""
    def rollout(i: int) -> None:
        client = _client(kind, SimpleNamespace(base_url=base_url, headers={"X-Boltstream-Rollout-Id": f"r{i}"}))
        for _ in range(calls):
            endpoint.reply(client, [{"role": "user", "content": "A farmer plants 4 rows of 9."}], "policy", 1.0, 24)

    with ThreadPoolExecutor(rollouts) as pool:
        t0 = time.perf_counter()
        list(pool.map(rollout, range(rollouts)))
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=32)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "agent_clients.json"))
    args = p.parse_args(argv)
    facts = cpu_facts(with_torch=False)
    print(f"machine: {describe_cpu(facts)}; {args.rollouts} rollouts x {args.calls} calls")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer, bind_and_activate=False)
    server.request_queue_size = 4 * args.rollouts  # a step's connections at once (uvicorn's backlog: 2048)
    server.server_bind()
    server.server_activate()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    runs: dict[str, list[float]] = {"per_rollout": [], "shared": []}
    try:
        wave("shared", base_url, args.rollouts, 1)  # imports and the shared client, before any timing
        for r in range(args.rounds):
            for kind in runs:
                runs[kind].append(wave(kind, base_url, args.rollouts, args.calls))
                print(f"round {r + 1} {kind:11s}: {runs[kind][-1]:.3f} s", flush=True)
    finally:
        server.shutdown()
        server.server_close()
    best = {kind: min(times) for kind, times in runs.items()}
    print(f"best of {args.rounds}: per_rollout {best['per_rollout']:.3f} s, shared {best['shared']:.3f} s; "
          f"shared is {best['per_rollout'] / best['shared']:.2f}x faster to get a step's rollouts through "
          f"their calls")
    write_report(args.out, {"benchmark": "agent_clients", "machine": facts, "rollouts": args.rollouts,
                            "calls": args.calls, "runs": runs, "best_s": best})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
