"""Bytes per multi-turn rollout on the log, with and without prefix sharing (measured before building it).

    .venv/bin/python benchmarks/bench_prefix_sharing.py [--turns 10] [--prompt 2000] [--response 200] [--inserted 100]

A multi-turn agent's call k sends the whole conversation so far: its prompt is call k-1's
prompt + response + the new tool output. Every LLM span carries its full prompt ids, so the
bytes of a rollout grow with the square of its turns. Prefix sharing would let a call whose
prompt extends the previous call's carry only the new ids plus a reference (the previous
call's span id and the prefix length) for assembly to restore. This measures what that would
save, with today's codec (packed int32 ids, Span v2): each LLM span encoded as it is, and
encoded again with the prompt cut to the new tokens and the reference added as two
attributes. Also the Trajectory record the stream app writes (its turns carry full prompts
too). Prints bytes per rollout for 1..``--turns`` turns and the ratio; writes
benchmarks/results/prefix_sharing.json. Nothing is sent to a broker: sizes are exact.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from boltstream.schemas import Codec  # noqa: E402
from boltstream.streams import AssemblyConfig, assemble_trajectory  # noqa: E402
from tests.integration.streams.stream_workload import Shape, make_rollout  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def shared(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spans as prefix sharing would send them: a prompt that extends the previous call's
    prompt + response keeps only its new ids, plus the previous span id and the prefix length."""
    out, previous = [], None
    for span in spans:
        llm = span.get("llm")
        if not llm:
            out.append(span)
            continue
        prompt = list(llm["prompt_token_ids"])
        if previous is not None and prompt[: len(previous[1])] == previous[1]:
            cut = len(previous[1])
            attrs = {**span["attributes"], "boltstream.prefix_span_id": previous[0], "boltstream.prefix_tokens": cut}
            span = {**span, "attributes": attrs, "llm": {**llm, "prompt_token_ids": prompt[cut:]}}
        out.append(span)
        previous = (span["span_id"], prompt + list(llm["response_token_ids"]))
    return out


def trajectory_bytes(codec: Codec, spans: list[dict[str, Any]]) -> int:
    """The Trajectory record the stream app assembles from these spans (full prompts per turn)."""
    trajectory = assemble_trajectory(spans, AssemblyConfig())
    return len(codec.encode("Trajectory", trajectory, topic="boltstream.trajectories"))


def measure(codec: Codec, turns: int, args: argparse.Namespace) -> dict[str, Any]:
    shape = Shape(calls=turns, prompt=args.prompt, response=args.response, shared_prefix=True, inserted=args.inserted)
    rollout = make_rollout(random.Random(turns), "t", 0, "bench", shape=shape)
    full = sum(len(codec.encode("Span", s, topic="boltstream.spans")) for s in rollout.spans)
    cut = sum(len(codec.encode("Span", s, topic="boltstream.spans")) for s in shared(rollout.spans))
    return {"turns": turns, "span_bytes": full, "span_bytes_shared": cut, "ratio": round(full / cut, 2),
            "trajectory_bytes": trajectory_bytes(codec, rollout.spans),
            "prompt_tokens": sum(len(p) for p, _ in rollout.calls)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=2000, help="first call's prompt tokens")
    ap.add_argument("--response", type=int, default=200, help="response tokens per call")
    ap.add_argument("--inserted", type=int, default=100, help="tool output tokens added per turn")
    args = ap.parse_args()
    codec = Codec()
    rows = [measure(codec, n, args) for n in range(1, args.turns + 1)]
    for r in rows:
        print(f"{r['turns']:2d} turns: spans {r['span_bytes'] / 1024:8.1f} KiB today, "
              f"{r['span_bytes_shared'] / 1024:7.1f} KiB with prefix sharing ({r['ratio']:.2f}x); "
              f"trajectory record {r['trajectory_bytes'] / 1024:8.1f} KiB")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix_sharing.json").write_text(json.dumps(
        {"benchmark": "prefix_sharing", "machine": platform.node(), "args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
