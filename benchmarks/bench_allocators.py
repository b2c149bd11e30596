"""Allocators and malloc settings: the learner's step time, a worker-style prefill and peak RSS, same run.

    .venv/bin/python benchmarks/bench_allocators.py [--rounds 3] [--steps 3] [--samples 16]
        [--settings glibc,pin128k,...]

Why: glibc's defaults let its mmap threshold rise, so the learner's freed activations stay in a
fragmented heap (4.2 GB peak, learner/memory.py); pinning the threshold or setting the trim
threshold (the worker's, boltstream/allocator.py) turns that off but makes every allocation above the
threshold a fresh ``mmap`` that the kernel zero-fills, which costs compute. This benchmark prices
each setting against glibc's defaults.

Each setting runs in a fresh process of its own (an allocator's state is per process), one after
the other, and the settings are interleaved over ``--rounds`` (round 1 runs every setting once,
then round 2, ...) so machine drift lands on all of them alike. In each process:

* the demo's learner (SmolLM2-135M + LoRA on every linear layer, the pipeline's own
  ``learner_config()``, benchmarks/bench_learner_memory.py) takes ``--steps`` real
  ``trainer.step`` calls on demo-shaped samples (16 x 150-230 tokens) on one model thread as the
  learner loop does; the forward+backward time is the median of the steps after the first
  (the heap's steady state), the learner's peak RSS the process's high-water mark after them;
* then a batched prefill as the transformers worker runs it (left-padded prompts, causal mask,
  ``use_cache=True``, logits of the last position only; inference/decoding.py ``prefill``) of
  ``--prefill-rows`` prompts of 300-500 tokens, without gradients, median of ``--prefill-repeats``.

Settings: ``glibc`` (defaults: the baseline), ``pin128k`` (the learner's former 128 KiB mmap
threshold), ``trimpad`` (the worker's 64 MiB trim threshold + 4 MiB top pad), ``pin1m``,
``pin4m``, ``pin32m`` (higher pinned thresholds), ``arena2`` (``MALLOC_ARENA_MAX=2`` with the
defaults otherwise), ``jemalloc`` and ``tcmalloc`` (preloaded with ``LD_PRELOAD``; a library that
is not installed is reported as absent and only its row is skipped). Ratios are medians over the
rounds of each round's setting / glibc (same round, so the same drift). JSON goes to
benchmarks/results/allocators.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results"
GOAL_LEARNER_PEAK_MB = 4096.0
WITHIN = 1.05  # a setting is "free" when both times are within 5 % of glibc's defaults
# name: (mallopt calls [(param name, bytes)], extra environment, library to preload)
SETTINGS: dict[str, tuple[list[tuple[str, int]], dict[str, str], str | None]] = {
    "glibc": ([], {}, None),
    "pin128k": ([("M_MMAP_THRESHOLD", 128 << 10)], {}, None),
    "trimpad": ([("M_TRIM_THRESHOLD", 64 << 20), ("M_TOP_PAD", 4 << 20)], {}, None),
    "pin1m": ([("M_MMAP_THRESHOLD", 1 << 20)], {}, None),
    "pin4m": ([("M_MMAP_THRESHOLD", 4 << 20)], {}, None),
    "pin32m": ([("M_MMAP_THRESHOLD", 32 << 20)], {}, None),
    "arena2": ([], {"MALLOC_ARENA_MAX": "2"}, None),
    "jemalloc": ([], {}, "jemalloc"),
    "tcmalloc": ([], {}, "tcmalloc"),
}
DEFAULT_SETTINGS = ("glibc", "pin128k", "trimpad", "pin1m", "pin4m", "pin32m", "jemalloc", "tcmalloc")


def library_path(kind: str) -> str | None:
    """The preloadable shared object for ``jemalloc`` or ``tcmalloc`` on this machine, or None."""
    from boltstream.allocator import find_library

    return find_library(kind)


def prefill_inputs(vocab: int, rows: int, seed: int) -> tuple[Any, Any, Any]:
    """Left-padded prompts of 300-500 tokens, as the worker batches them (inference/decoding.py)."""
    import torch

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(300, 500))] for _ in range(rows)]
    width = max(map(len, prompts))
    ids = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One setting, in this process: learner steps, then prefills; times and peaks."""
    from boltstream import allocator

    calls, _, lib = SETTINGS[args.child]
    for param, value in calls:  # before the model exists, as `boltstream learn` / `serve` do
        allocator.mallopt(getattr(allocator, param), value)

    import torch
    from bench_learner_memory import demo_learner_config, demo_like_step

    from boltstream.learner.memory import memory_status
    from boltstream.learner.model_setup import vocab_size
    from boltstream.learner.trainer import make_trainer

    cfg = demo_learner_config(args.model, pinned=False)  # the allocator setting is this benchmark's
    model_thread = ThreadPoolExecutor(1)  # the learner loop's single model thread
    trainer = model_thread.submit(make_trainer, cfg).result()
    vocab = vocab_size(trainer.model)
    step_s: list[float] = []
    step_cpu: list[float] = []
    for step in range(args.steps):
        samples = demo_like_step(vocab, step, args.samples)
        t0, c0 = time.perf_counter(), time.process_time()
        model_thread.submit(trainer.step, samples, cfg.lr).result()
        step_s.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - c0)
    learner = memory_status()
    model = trainer.model
    model.eval()
    ids, mask, positions = prefill_inputs(vocab, args.prefill_rows, 7)
    prefill_s: list[float] = []
    prefill_cpu: list[float] = []
    with torch.inference_mode():
        for _ in range(args.prefill_repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
            out.logits[:, -1, :].float()
            prefill_s.append(time.perf_counter() - t0)
            prefill_cpu.append(time.process_time() - c0)
            del out
    model_thread.shutdown()
    maps = Path("/proc/self/maps").read_text() if lib else ""
    return {"setting": args.child, "step_seconds": [round(s, 2) for s in step_s],
            "fwd_bwd_s": round(statistics.median(step_s[1:] or step_s), 2),
            "fwd_bwd_cpu_s": round(statistics.median(step_cpu[1:] or step_cpu), 2),
            "prefill_s": round(statistics.median(prefill_s), 2), "prefill_seconds": [round(s, 2) for s in prefill_s],
            "prefill_cpu_s": round(statistics.median(prefill_cpu), 2),
            "learner_peak_mb": learner.get("peak_rss_mb"), "peak_mb": memory_status().get("peak_rss_mb"),
            "preloaded": bool(lib) and (f"lib{lib}" in maps), "torch_threads": torch.get_num_threads()}


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    _, extra_env, lib = SETTINGS[name]
    env = {**os.environ, **extra_env, "BOLTSTREAM_ALLOCATOR": "glibc"}  # the setting alone, nothing else preloaded
    env.pop("LD_PRELOAD", None)
    if lib:
        path = library_path(lib)
        if path is None:
            return {"setting": name, "absent": f"lib{lib} not installed"}
        env["LD_PRELOAD"] = path
    cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps), "--samples", str(args.samples),
           "--model", args.model, "--prefill-rows", str(args.prefill_rows),
           "--prefill-repeats", str(args.prefill_repeats)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:  # one slow setting must not lose the others' rows
        return {"setting": name, "failed": f"timed out after {args.timeout:.0f} s"}
    if proc.returncode != 0:
        return {"setting": name, "failed": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if lib and not row["preloaded"]:
        return {"setting": name, "failed": f"{env['LD_PRELOAD']} was preloaded but is not in the process's maps"}
    return row


def summarise(rounds: list[dict[str, dict[str, Any]]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per setting: medians over rounds, and the median of each round's ratio to that round's glibc row."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        rows = [r[name] for r in rounds if name in r]
        absent = [row["absent"] for row in rows if "absent" in row]
        if absent:
            out[name] = {"absent": absent[0]}
            continue
        good = [r for r in rounds if "failed" not in r.get(name, {"failed": 1}) and "failed" not in r["glibc"]]
        if not good:
            out[name] = {"absent": "no round measured it and glibc both"}
            continue
        s: dict[str, Any] = {"rounds": len(good)}
        for key in ("fwd_bwd_cpu_s", "prefill_cpu_s", "fwd_bwd_s", "prefill_s", "learner_peak_mb", "peak_mb"):
            s[key] = round(statistics.median(r[name][key] for r in good), 2)
            s[f"{key}_ratio"] = round(statistics.median(r[name][key] / r["glibc"][key] for r in good), 3)
        s["within_5pct_and_peak_ok"] = (s["fwd_bwd_cpu_s_ratio"] <= WITHIN and s["prefill_cpu_s_ratio"] <= WITHIN
                                        and s["learner_peak_mb"] <= GOAL_LEARNER_PEAK_MB)
        out[name] = s
    return out


def write_json(args: argparse.Namespace, names: list[str], rounds: list[dict[str, dict[str, Any]]]) -> Path:
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "loadavg": os.getloadavg(),
                               "args": {k: str(v) for k, v in vars(args).items() if k not in ("child", "out")},
                               "settings": {n: {"mallopt": SETTINGS[n][0], "env": SETTINGS[n][1],
                                                "preload": SETTINGS[n][2]} for n in names},
                               "summary": summarise(rounds, names), "rounds": rounds}, indent=2) + "\n")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="learner steps per process (the first is not timed)")
    p.add_argument("--samples", type=int, default=16, help="samples per step (the demo: 4 groups x 4)")
    p.add_argument("--prefill-rows", type=int, default=8)
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), help=f"any of {', '.join(SETTINGS)}")
    p.add_argument("--parallel", type=int, default=1, help="settings run at once (CPU times compare under load)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one setting's process may take")
    p.add_argument("--out", type=Path, default=RESULTS / "allocators.json", help="where the JSON goes")
    p.add_argument("--child", choices=tuple(SETTINGS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    if "glibc" not in names:
        names.insert(0, "glibc")
    for lib in ("jemalloc", "tcmalloc"):
        if any(SETTINGS[n][2] == lib for n in names):
            print(f"{lib}: {library_path(lib) or 'ABSENT (not installed): its rows are skipped'}", flush=True)
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # each round starts with another setting
        done: dict[str, dict[str, Any]] = {}
        with ThreadPoolExecutor(args.parallel) as pool:
            futures = {pool.submit(run_one, n, args): n for n in order}
            for fut in as_completed(futures):  # each row as it comes: a run cut short keeps them
                done[futures[fut]] = res = fut.result()
                print(f"round {r + 1} {futures[fut]}: {json.dumps(res)}", file=sys.stderr, flush=True)
        for name in order:
            res = done[name]
            if "absent" in res or "failed" in res:
                print(f"round {r + 1} {name:<9} skipped: {res.get('absent') or res['failed']}", flush=True)
                continue
            print(f"round {r + 1} {name:<9} fwd+bwd {res['fwd_bwd_cpu_s']:6.1f} CPU s ({res['fwd_bwd_s']:6.1f} wall, "
                  f"steps {res['step_seconds']})  prefill {res['prefill_cpu_s']:5.1f} CPU s "
                  f"({res['prefill_s']:5.1f} wall)  learner peak {res['learner_peak_mb']:5.0f} MiB  "
                  f"process peak {res['peak_mb']:5.0f} MiB", flush=True)
        print(f"round {r + 1} done, load {os.getloadavg()[0]:.1f}", flush=True)
        rounds.append({n: done[n] for n in names})
        write_json(args, names, rounds)  # after every round: a run cut short keeps what it measured
    summary = summarise(rounds, names)
    print(f"\nmedians over {args.rounds} rounds; ratios = median of same-round setting / glibc; CPU s = user + "
          f"system time of the process (ok: both CPU times within {WITHIN - 1:.0%} and learner peak <= {GOAL_LEARNER_PEAK_MB:.0f} MiB)")
    for name, s in summary.items():
        if "absent" in s:
            print(f"{name:<17} skipped: {s['absent']}")
            continue
        print(f"{name:<9} fwd+bwd {s['fwd_bwd_cpu_s']:6.1f} CPU s ({s['fwd_bwd_cpu_s_ratio']:.2f}x; wall "
              f"{s['fwd_bwd_s_ratio']:.2f}x)  prefill {s['prefill_cpu_s']:5.1f} CPU s ({s['prefill_cpu_s_ratio']:.2f}x; "
              f"wall {s['prefill_s_ratio']:.2f}x)  learner peak {s['learner_peak_mb']:5.0f} MiB "
              f"({s['learner_peak_mb_ratio']:.2f}x)  process peak {s['peak_mb']:5.0f} MiB  "
              f"{'ok' if s['within_5pct_and_peak_ok'] else '-'}")
    print(f"wrote {write_json(args, names, rounds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
