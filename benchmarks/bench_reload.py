"""Checkpoint reload latency: publish to S3 + announce -> every worker serving the new version.

Runs on the embedded stack (real Tansu broker, real moto S3 endpoint) with
``boltstream serve`` workers as separate processes, exactly as in production:

    .venv/bin/python benchmarks/bench_reload.py [--model smollm2] [--reloads 10] [--workers 1]

For each reload the clock starts before the upload (``publish_checkpoint``:
hash + upload + manifest) and stops when every worker's ``/health`` reports
the new version (a long-poll, no sleeping). Reported per kind (full weights,
LoRA adapter): median and p95 of the total, of event -> serving, of the
upload alone and of the worker's own download + verify + load time. One
untimed warm-up reload per kind comes first (the first LoRA adapter also
wraps the model in PEFT). Goals on CPU: full <= 3 s, LoRA <= 0.5 s.
Three kinds, in one run: ``full`` (the weights as stored, fp32 for SmolLM2:
the baseline), ``full-bf16`` (the files ``boltstream learn --publish-dtype
bfloat16`` writes, half the bytes; the worker casts them back to its own
dtype) and ``lora``; the ratio full-bf16 / full is printed, and what a cast
copy costs in fidelity (per-token log-probability gap to the trained weights).
JSON goes to benchmarks/results/reload.json.
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
from aiokafka import AIOKafkaProducer

from boltstream import s3
from boltstream.broker.kafka import producer_kwargs
from boltstream.inference.launch import WorkerProcess
from boltstream.schemas import Codec
from boltstream.stack import embedded_stack, settings_env
from boltstream.weights.checkpoints import announce_checkpoint, prune_checkpoints, publish_checkpoint
from boltstream.weights.models import load_model, model_dir

RESULTS = Path(__file__).parent / "results"
GOALS = {"full": 3.0, "full-bf16": 3.0, "lora": 0.5}
FULL_FILES = ("config.json", "generation_config.json", "model.safetensors")


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def full_checkpoint(model: str, out: Path, dtype: str | None = None) -> Path:
    """The model's own weights as a full checkpoint: symlinks, or written cast to ``dtype`` exactly as the
    learner writes its serving copy (``boltstream learn --publish-dtype``)."""
    src = model_dir(model)
    if dtype:
        from boltstream.learner.model_setup import save_weights

        base, tokenizer = load_model(model)
        save_weights(base, tokenizer, out, dtype)
        return out
    out.mkdir(parents=True)
    for name in FULL_FILES:
        if (src / name).exists():
            (out / name).symlink_to(src / name)
    return out


def lora_checkpoints(model: str, out: Path, count: int,
                     targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> list[Path]:
    """``count`` different rank-16 adapters on ``targets`` (random, non-zero: they change the answers)."""
    import torch
    from peft import LoraConfig, get_peft_model

    base, _ = load_model(model)
    peft_model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                                                 target_modules=list(targets)))
    dirs = []
    for i in range(count):
        torch.manual_seed(1000 + i)
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(p, std=0.02)
        peft_model.save_pretrained(out / f"lora-{i}")
        dirs.append(out / f"lora-{i}")
    return dirs


def rounding_gap(model: str, dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> dict[str, dict[str, float]]:
    """What serving a cast copy costs in fidelity: |log p| differences (T=0.7) between the model and
    its weights rounded to each dtype, per token of a fixed calculator-style text."""
    import copy

    import torch

    base, tokenizer = load_model(model)
    text = "Q: What is 37 * 12? Use the calculator. A: CALC: 37*12 = 444. The answer is 444. " * 3
    ids = torch.tensor([tokenizer(text)["input_ids"]])

    def logprobs(m: Any) -> Any:
        with torch.no_grad():
            logits = m(ids).logits[0, :-1].float() / 0.7
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)

    reference, out = logprobs(base), {}
    for name in dtypes:
        rounded = copy.deepcopy(base)
        with torch.no_grad():
            for p in rounded.parameters():
                p.copy_(p.to(getattr(torch, name)).to(p.dtype))
        gap = (logprobs(rounded) - reference).abs()
        out[name] = {"mean_abs_logprob_diff": float(gap.mean()), "max_abs_logprob_diff": float(gap.max()),
                     "tokens": gap.numel()}
    return out


async def wait_all(urls: list[str], version: int, timeout: float = 120.0) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=timeout + 10) as http:
        rs = await asyncio.gather(*(http.get(f"{u}/health", params={"min_version": version, "timeout": timeout})
                                    for u in urls))
    out = [r.json() for r in rs]
    bad = [h for h in out if h["policy_version"] < version]
    if bad:
        raise RuntimeError(f"workers did not reach v{version}: {bad}")
    return out


async def run(args: argparse.Namespace, settings: Any, tmp: Path, urls: list[str]) -> dict[str, Any]:
    client = s3.make_client(settings)
    codec = Codec()
    topic = settings.topic("checkpoints")
    sources = {"full": lambda: [full_checkpoint(args.model, tmp / "full")] * (args.reloads + 1),
               "full-bf16": lambda: [full_checkpoint(args.model, tmp / "bf16", "bfloat16")] * (args.reloads + 1),
               "lora": lambda: lora_checkpoints(args.model, tmp, args.reloads + 1)}
    producer = AIOKafkaProducer(**producer_kwargs(settings, linger_ms=0))
    await producer.start()
    version, results = 0, {}
    try:
        for kind in args.kinds:
            rows = []
            for i, local in enumerate(sources[kind]()):
                version += 1
                t0 = time.perf_counter()
                event = await asyncio.to_thread(
                    publish_checkpoint, client, settings.s3_bucket, "bench", version, local, kind=kind.split("-")[0],
                    base_model=args.model, learner_step=version, model_name=args.model)
                t1 = time.perf_counter()
                await announce_checkpoint(producer, codec, topic, event)
                t2 = time.perf_counter()
                health = await wait_all(urls, version)
                t3 = time.perf_counter()
                row = {"version": version, "warmup": i == 0, "total_s": t3 - t0, "upload_s": t1 - t0,
                       "announce_s": t2 - t1, "event_to_serving_s": t3 - t1,
                       "worker_reload_s": max(h["last_reload_seconds"] for h in health),
                       "worker_fetch_s": max(h["last_fetch_seconds"] for h in health),
                       "bytes": sum(f["size"] for f in event["files"])}
                rows.append(row)
                # what a learner does (keep_last): the embedded S3 keeps objects in memory and slows as it fills
                await asyncio.to_thread(prune_checkpoints, client, settings.s3_bucket, "bench", keep_last=2)
                print(f"{kind:9s} v{version:<3d} total {row['total_s']:.3f}s  upload {row['upload_s']:.3f}s  "
                      f"event->serving {row['event_to_serving_s']:.3f}s  worker {row['worker_reload_s']:.3f}s "
                      f"(fetch {row['worker_fetch_s']:.3f}s)"
                      + ("  (warm-up)" if i == 0 else ""), flush=True)
            timed = [r for r in rows if not r["warmup"]]
            summary = {f"{m}_{stat}": fn([r[m] for r in timed])
                       for m in ("total_s", "event_to_serving_s", "upload_s", "worker_reload_s", "worker_fetch_s")
                       for stat, fn in (("median", statistics.median), ("p95", lambda xs: percentile(xs, 95)))}
            summary.update(goal_s=GOALS[kind], meets_goal=summary["total_s_median"] <= GOALS[kind],
                           bytes=timed[0]["bytes"], reloads=len(timed))
            results[kind] = {"summary": summary, "runs": rows}
    finally:
        await producer.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--reloads", type=int, default=10)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--kinds", default=",".join(GOALS), help=f"comma-separated, of {', '.join(GOALS)}")
    p.add_argument("--out", default=str(RESULTS / "reload.json"))
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(args.kinds) - set(GOALS))
    if unknown:
        p.error(f"unknown kind(s) {', '.join(unknown)}: choose from {', '.join(GOALS)}")
    model_dir(args.model)  # de-quantise once, outside the timings
    with tempfile.TemporaryDirectory(prefix="bench-reload-") as d, embedded_stack(d) as settings:
        tmp = Path(d)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
        env.update(settings_env(settings), BOLTSTREAM_STATE_FILE=str(tmp / "none.json"))
        workers = [WorkerProcess(["--model", args.model, "--port", "0", "--lora"], env=env,
                                 log_path=tmp / f"worker-{i}.log") for i in range(args.workers)]
        try:
            urls = [w.start(timeout=300) for w in workers]
            results = asyncio.run(run(args, settings, tmp, urls))
        finally:
            for w in workers:
                w.stop()
    gap = rounding_gap(args.model) if "full-bf16" in args.kinds else {}
    report = {"benchmark": "reload", "model": args.model, "workers": args.workers, "cpus": os.cpu_count(),
              "machine": platform.machine(), "python": sys.version.split()[0], "results": results,
              "rounding_gap": gap}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\n{'kind':9s} {'median':>8s} {'p95':>8s} {'event->serving med':>19s} {'upload med':>11s} {'goal':>6s}")
    for kind, r in results.items():
        s = r["summary"]
        print(f"{kind:9s} {s['total_s_median']:7.3f}s {s['total_s_p95']:7.3f}s {s['event_to_serving_s_median']:18.3f}s "
              f"{s['upload_s_median']:10.3f}s {s['goal_s']:5.1f}s {'OK' if s['meets_goal'] else 'MISSED'}")
    if {"full", "full-bf16"} <= results.keys():
        ratio = results["full-bf16"]["summary"]["total_s_median"] / results["full"]["summary"]["total_s_median"]
        print(f"ratio full-bf16 / full (median publish -> serving): {ratio:.2f}x")
    for name, g in gap.items():
        print(f"served {name} copy vs the trained weights: |log p| differs by {g['mean_abs_logprob_diff']:.4f} "
              f"on average, {g['max_abs_logprob_diff']:.4f} at most ({g['tokens']} tokens, T=0.7)")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
