"""Shared by the learner's integration tests: GRPO groups as TrainingBatch records, producing and
reading them on the real broker, and a ``boltstream learn`` subprocess that reports its progress."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from boltstream.broker.kafka import producer_kwargs
from boltstream.config import Settings
from boltstream.learner.tiny import random_samples
from boltstream.schemas import Codec
from tests.integration.conftest import boltstream_argv, read_keyed

TOKENS = 256  # the tiny model's byte vocabulary (259 with its special tokens)


def group(name: str, *, size: int = 4, seed: int = 0, parts: int = 1, policy_version: int = 0) -> list[dict]:
    """One GRPO group of ``size`` samples as ``parts`` TrainingBatch records (a split group when > 1)."""
    samples = random_samples(size, TOKENS, seed=seed, min_len=8, max_len=24, policy_version=policy_version)
    for i, s in enumerate(samples):
        s.update(sample_id=f"{name}-{i}:0", attempt_id=f"{name}-{i}", rollout_id=f"r-{name}-{i}", task_id=name,
                 reward=float(i % 2))
    chunks = [samples[i::parts] for i in range(parts)]
    return [{"batch_id": name, "task_id": name, "part": p, "num_parts": parts, "samples": chunk,
             "group_size": size, "num_rollouts": size, "reward_mean": 0.5, "reward_std": 0.5,
             "rollout_ids": [s["rollout_id"] for s in samples], "complete": True, "created_ns": 0}
            for p, chunk in enumerate(chunks)]


def sample_ids(records: Iterable[dict]) -> list[str]:
    return [s["sample_id"] for r in records for s in r["samples"]]


async def produce(settings: Settings, records: Iterable[dict], partition: int | None = None,
                  first_timestamp_ms: int | None = None) -> None:
    """TrainingBatch records to the batches topic (keyed by task id), acknowledged by the broker; with
    ``first_timestamp_ms``, record i is stamped that + i ms (a log time order with no ties)."""
    topic = settings.topic("batches")
    codec = Codec()
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    try:
        for i, r in enumerate(records):
            value = r if isinstance(r, bytes) else codec.encode("TrainingBatch", r, topic=topic)
            key = b"junk" if isinstance(r, bytes) else r["task_id"].encode()
            stamp = None if first_timestamp_ms is None else first_timestamp_ms + i
            await producer.send_and_wait(topic, value, key=key, partition=partition, timestamp_ms=stamp)
    finally:
        await producer.stop()


async def read_topic(settings: Settings, short: str, expected: int, record: str,
                     timeout: float = 20.0) -> list[tuple[bytes | None, dict[str, Any]]]:
    """(key, value) of the first ``expected`` records of a topic, all partitions, within ``timeout``."""
    return await read_keyed(settings, short, record, expected, timeout)


class Learner:
    """A ``boltstream learn`` child whose stdout progress lines can be awaited (no sleeps)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(boltstream_argv("learn", *args), env=env, stdout=subprocess.PIPE,
                                         stderr=err, stdin=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Block until a progress line matches ``pattern``; fail with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout}s; seen {self.seen[-5:]}"
                                     f"\n{self.tail()}") from None
            if line is None:
                raise AssertionError(f"learner exited ({self.proc.wait()}) before {pattern!r}\n{self.tail()}")
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"learner did not exit within {timeout}s\n{self.tail()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, a bounded wait, then SIGKILL: never leaves the process behind."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
