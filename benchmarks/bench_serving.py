"""Serving speed against the machine: the engine at batch 1/8/16/32, then the worker over HTTP.

    .venv/bin/python benchmarks/bench_serving.py [--model smollm2] [--serve-dtype auto|float32|bfloat16]
        [--batches 1,8,16,32] [--prompt-tokens 256] [--decode-steps 16] [--requests 16] [--max-tokens 48]

Part 1, the engine (in this process, the worker's own decoding code): for each
batch size, a prefill of that many ``--prompt-tokens`` prompts (prefill
tokens/s) and ``--decode-steps`` decode steps (generated tokens/s), with the
plain-torch decode step over a KV buffer (inference/llama_step.py), the same
step multiplying by the weights themselves instead of their packed copies, in
float32 the step on the packing this CPU does not pick (MKL's or oneDNN's), and
the model's own forward, alternating. Printed next to them, from
the same run (benchmarks/machine.py): the memory bound of a decode step
(the weights' bytes in the serving dtype over a large copy's GB/s, and over a
large read's GB/s) and the compute bound of the prefill (2 FLOPs per weight per
token over a large matmul's GFLOP/s in the serving dtype), with the ratio to each; and the
CPU's flags, dtype and thread settings.

Part 2, the workers (``--rounds`` > 0), per ``--backends`` (transformers, and
vLLM's CPU build from the virtualenv ``make vllm-env`` builds): a ``boltstream
serve`` process on the embedded stack with token capture ON (every answer waits
for its span's broker ack), as in training; the same seeded chat requests sent
one at a time, then by ``--clients`` closed-loop clients, alternating for
``--rounds`` rounds; the ratio shows what continuous batching buys.
JSON goes to benchmarks/results/serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from machine import as_command, bounds, cpu_facts, describe_cpu, write_report

from boltstream.inference.launch import WorkerProcess
from boltstream.stack import embedded_stack, settings_env
from boltstream.weights.models import load_model, model_dir, resolve_dtype

RESULTS = Path(__file__).parent / "results"
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
TOPICS = ["the ocean", "a robot learning to paint", "prime numbers", "a rainy day in Lisbon", "compilers",
          "honeybees", "the moon landing", "sourdough bread"]


# ------------------------------------------------------------------ part 1: the engine against the machine

def _engine_once(model: Any, batch: int, prompt_tokens: int, steps: int, step: Any) -> dict[str, float]:
    """One prefill of ``batch`` prompts and ``steps`` decode steps, as the worker's generation thread runs
    them, decoding with ``step`` (a :class:`~boltstream.inference.llama_step.LlamaStep`; None: through the
    model's own forward)."""
    from array import array
    from types import SimpleNamespace

    import torch

    from boltstream.inference import decoding, llama_step
    from boltstream.inference.backend import SamplingParams

    real_step_for = llama_step.step_for
    llama_step.step_for = lambda m: step  # type: ignore[assignment]
    try:
        gen = torch.Generator().manual_seed(batch)
        reqs = [SimpleNamespace(prompt_ids=array("i", torch.randint(100, 20000, (prompt_tokens - i % 7,),
                                                                    generator=gen).tolist()),
                                params=SamplingParams(temperature=1.0, max_tokens=steps + 1, seed=i))
                for i in range(batch)]  # lengths differ a little: rows are left-padded, as in serving
        rows = decoding.make_rows(reqs)
        with torch.inference_mode():
            t0 = time.perf_counter()
            state = decoding.prefill(model, rows, 0, "cpu")
            t1 = time.perf_counter()
            for _ in range(steps):
                tokens, lps = decoding.sample(state)
                for row, tok, lp in zip(state.rows, tokens, lps, strict=True):
                    row.ids.append(tok)
                    row.logprobs.append(lp)
                decoding.advance(model, state)
            t2 = time.perf_counter()
    finally:
        llama_step.step_for = real_step_for  # type: ignore[assignment]
    prefilled = sum(len(r.prompt_ids) for r in reqs)
    return {"prefill_s": t1 - t0, "prefill_tokens_per_s": prefilled / (t1 - t0),
            "step_ms": (t2 - t1) / steps * 1000, "decode_tokens_per_s": batch * steps / (t2 - t1)}


def engine(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: every batch size, the plain-torch step (on packed weights, and on the weights themselves) and
    the model's forward alternating, against the bounds."""
    dtype = resolve_dtype(args.serve_dtype)
    model, _ = load_model(args.model, dtype=dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    flops_per_token = 2 * sum(p.numel() for p in model.parameters())
    facts = cpu_facts()
    dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")
    machine = bounds(dtype=dtype_name)
    print(f"machine: {describe_cpu(facts)}")
    print(f"bounds (same run): copy {machine['copy_gb_s']:.1f} GB/s, read {machine['read_gb_s']:.1f} GB/s, "
          f"{dtype_name} matmul {machine['matmul_gflop_s']:.0f} GFLOP/s; weights {weight_bytes / 1e6:.0f} MB in "
          f"{dtype_name} -> a decode step >= {weight_bytes / machine['copy_gb_s'] / 1e6:.1f} ms (copy rate), "
          f">= {weight_bytes / machine['read_gb_s'] / 1e6:.1f} ms (read rate)", flush=True)
    import torch

    from boltstream.inference import llama_step, torch_internals

    with torch.inference_mode():
        if problem := llama_step.probe(model):
            raise SystemExit(f"the plain-torch step does not reproduce {args.model}: {problem}")
        steps = {"step": llama_step.LlamaStep(model), "unpacked": llama_step.LlamaStep(model, packing=False),
                 "forward": None}
        packing = steps["step"].packing
        # float32 has two packings; the one this CPU does not pick runs beside it (the choice, measured)
        other = {"mkl": "onednn", "onednn": "mkl"}.get(packing or "") if dtype_name == "float32" else None
        if other and torch_internals.can_pack(other, "float32"):
            steps["other packing"] = llama_step.LlamaStep(model, packing=other)
    print(f"products on {f'{packing}-packed' if packing else 'unpacked'} weights; beside them: "
          f"{', '.join(m if m != 'other packing' else f'{other}-packed' for m in steps if m != 'step')}", flush=True)
    for step in steps.values():  # warm-up: first-call allocations, packing
        _engine_once(model, 2, 32, 2, step)
    out = []
    for batch in args.batches:
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in steps}
        for _ in range(args.engine_rounds):
            for mode, step in steps.items():
                runs[mode].append(_engine_once(model, batch, args.prompt_tokens, args.decode_steps, step))
        row: dict[str, Any] = {"batch": batch}
        for mode, rs in runs.items():
            best = min(rs, key=lambda r: r["step_ms"])
            step_s = best["step_ms"] / 1000
            row[mode] = dict(best, memory_bound_copy=weight_bytes / machine["copy_gb_s"] / 1e9 / step_s,
                             memory_bound_read=weight_bytes / machine["read_gb_s"] / 1e9 / step_s,
                             prefill_compute_bound=max(r["prefill_tokens_per_s"] for r in rs) * flops_per_token
                             / (machine["matmul_gflop_s"] * 1e9))
        row["step_speedup"] = row["forward"]["step_ms"] / row["step"]["step_ms"]
        row["packing_speedup"] = row["unpacked"]["step_ms"] / row["step"]["step_ms"]
        row["packing"] = packing
        versus = ""
        if "other packing" in row:
            row["other_packing"] = other
            row["other_packing_ratio"] = row["other packing"]["step_ms"] / row["step"]["step_ms"]
            versus = f"; {other}-packed {row['other packing']['step_ms']:.1f} ms/step -> {row['other_packing_ratio']:.2f}x"
        s, f = row["step"], row["forward"]
        print(f"batch {batch:2d}: decode {s['decode_tokens_per_s']:6.1f} tok/s ({s['step_ms']:.1f} ms/step; "
              f"{s['memory_bound_copy']:.0%} of the copy-rate bound, {s['memory_bound_read']:.0%} of the read-rate "
              f"bound) vs own forward {f['decode_tokens_per_s']:6.1f} tok/s ({f['step_ms']:.1f} ms/step, "
              f"{f['memory_bound_copy']:.0%}) -> {row['step_speedup']:.2f}x; unpacked weights "
              f"{row['unpacked']['step_ms']:.1f} ms/step -> packing {row['packing_speedup']:.2f}x{versus}; prefill "
              f"{s['prefill_tokens_per_s']:.0f} tok/s ({s['prefill_compute_bound']:.0%} of the matmul bound)",
              flush=True)
        out.append(row)
    return {"machine": facts, "bounds": machine, "dtype": dtype_name, "weight_bytes": weight_bytes,
            "prompt_tokens": args.prompt_tokens, "decode_steps": args.decode_steps, "batches": out}


# ------------------------------------------------------------------ part 2: the worker over HTTP


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


def serving_args(description: str, out: str) -> argparse.ArgumentParser:
    """The options both serving benchmarks take (this one and bench_serving_adapters.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve-dtype", default="auto", help="the worker's dtype (auto: bfloat16 on a CPU with native "
                   "bf16, else the checkpoint's float32)")
    p.add_argument("--out", default=str(RESULTS / out))
    return p


def main(argv: list[str] | None = None) -> int:
    as_command("serve")  # the engine below runs with the worker's thread settings
    p = serving_args(__doc__.split("\n\n")[0], "serving.json")
    p.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8, 16, 32])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--engine-rounds", type=int, default=3,
                   help="alternations of the decode paths per batch; each path's best is kept, as the bounds keep theirs")
    p.add_argument("--backends", type=lambda v: v.split(","), default=["transformers", "vllm"],
                   help="the workers part 2 measures (vllm: in the virtualenv `make vllm-env` builds)")
    args = p.parse_args(argv)
    model_dir(args.model)  # de-quantise once, outside the timings
    report: dict[str, Any] = {"benchmark": "serving", "model": args.model, "serve_dtype": args.serve_dtype,
                              "cpus": os.cpu_count(), "machine": platform.machine(), "python": sys.version.split()[0],
                              "engine": engine(args)}
    report["workers"] = {}
    for backend in args.backends if args.rounds > 0 else []:
        python = None
        if backend == "vllm":
            python = str(VLLM_PYTHON)
            if not VLLM_PYTHON.exists():
                print(f"vllm: not measured ({VLLM_PYTHON} is missing: make vllm-env)")
                continue
        with tempfile.TemporaryDirectory(prefix="bench-serving-") as d, embedded_stack(d) as settings:
            env = worker_env(settings, d)
            argv = ["--model", args.model, "--port", "0", "--max-batch-size", str(args.clients), "--dtype",
                    args.serve_dtype, "--backend", backend]
            with WorkerProcess(argv, env=env, log_path=Path(d) / "worker.log", python=python) as worker:
                assert worker.url is not None
                print(f"worker, {backend} backend:", flush=True)
                results = asyncio.run(run(worker.url, args))
        report["workers"][backend] = results
        print(f"{backend}: {results['concurrent']['tokens_per_s']:.1f} tok/s with {args.clients} concurrent clients, "
              f"{results['sequential']['tokens_per_s']:.1f} one at a time ({results['speedup']:.2f}x)")
    report.update(clients=args.clients, max_tokens=args.max_tokens, capture=True)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
