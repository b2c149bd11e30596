"""Acceptance (spool): the broker is down while an agent process emits N spans and exits; the next
process started with the broker up delivers all N, keyed and in order per rollout. Without the spool
the documented loss: the agent says "shut down with N spans undelivered" and nothing arrives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from boltstream.stack import settings_env

AGENT = str(Path(__file__).with_name("spool_agent.py"))
N, ROLLOUTS = 3000, 12


def _agent(broker: Any, tmp_path: Path, n: int, spool: str, flush_ms: int) -> tuple[dict[str, Any], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
    env.update(settings_env(broker.settings), BOLTSTREAM_STATE_FILE=str(tmp_path / "no-stack.json"),
               BOLTSTREAM_EXPORTER_SPOOL_DIR=spool, BOLTSTREAM_EXPORTER_FLUSH_TIMEOUT_MS=str(flush_ms),
               BOLTSTREAM_EXPORTER_REQUEST_TIMEOUT_MS="2000", BOLTSTREAM_EXPORTER_RETRY_BACKOFF_MAX_MS="500",
               BOLTSTREAM_EXPORTER_BUFFER_SIZE="1000")  # smaller than N: memory alone cannot hold the outage
    pace = "1" if spool != "off" else "0"
    proc = subprocess.run([sys.executable, AGENT, str(n), str(ROLLOUTS), pace], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("spool", ["on", "off"])
def test_agent_outage_then_next_start_delivers(private_broker: Any, helpers: Any, tmp_path: Path,
                                               spool: str) -> None:
    spool_dir = str(tmp_path / "spool") if spool == "on" else "off"
    private_broker.start()  # creates the topics
    private_broker.kill()

    m, stderr = _agent(private_broker, tmp_path, N, spool_dir, flush_ms=500)
    assert m["acked"] == 0 and m["received"] == N
    if spool == "off":
        left = N - m["dropped_buffer_full"]  # the buffer (1,000) is full; the rest is lost at exit
        assert m["dropped"] == N and f"shut down with {left} spans undelivered" in stderr
    else:
        assert (m["dropped"], m["spooled"], m["spool_pending"]) == (0, N, N), m
        assert f"shut down with {N} spans in the spool" in stderr

    private_broker.start()
    m2, _ = _agent(private_broker, tmp_path, 0, spool_dir, flush_ms=60_000)
    recs = helpers.read_topic(private_broker.settings, "spans", "Span", to_end=True, timeout=30)
    if spool == "off":
        assert recs == [] and m2["acked"] == 0
        return
    assert (m2["acked"], m2["replayed"], m2["spool_pending"]) == (N, N, 0), m2
    assert len(recs) == N
    by_key: dict[bytes, list[str]] = defaultdict(list)
    for _, key, rec in recs:  # per partition in offset order
        assert key == rec["rollout_id"].encode()
        by_key[key].append(rec["name"])
    assert sorted(by_key) == sorted(f"r{r}".encode() for r in range(ROLLOUTS))
    for key, names in by_key.items():
        assert names == [f"{key.decode()}-{i:05d}" for i in range(N // ROLLOUTS)], f"order of {key!r}"
    assert not list((tmp_path / "spool").glob("lane-*/*.seg")), "every segment deleted once acked"
