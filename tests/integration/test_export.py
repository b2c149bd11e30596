"""``boltstream export`` as typed, against the real broker: round trips, loaders, refusals, memory.

The expectations come from decoding the topics here with the codec, never from the export's own
code: each exported row is compared with the record it came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from boltstream.cli import main as cli_main
from boltstream.config import Settings
from boltstream.export.rows import batch_records, record_field_names
from boltstream.export.writers import read_metadata
from boltstream.schemas import Codec
from boltstream.schemas.packed import as_lists
from boltstream.stack import run_sync
from tests.integration.conftest import boltstream_argv, read_topic
from tests.integration.learner.helpers import group
from tests.integration.peak_rss import run_measured
from tests.integration.streams.stream_helpers import produce
from tests.unit.schemas.record_examples import EXAMPLES, MINIMAL

GARBAGE = b"\x00\x00\x00\x00\x07not avro"


def span(i: int, *, llm: bool = True) -> dict[str, Any]:
    s = {**EXAMPLES["Span"], "span_id": f"{i:016x}", "rollout_id": f"r{i % 5}",
         "attributes": {**EXAMPLES["Span"]["attributes"], "i": i, "tags": {"strings": [f"t{i}", "x"]}}}
    if llm:
        s["llm"] = {**EXAMPLES["Span"]["llm"], "prompt_token_ids": [i, i + 1, 40_000 + i],
                    "response_token_ids": list(range(i % 7 + 1)),
                    "response_logprobs": [-(k + 1) / 64 for k in range(i % 7 + 1)], "policy_version": i % 3}
    else:
        s["llm"] = None
    return s


async def produce_records(settings: Settings, short: str, record: str, values: list[Any], key: str) -> None:
    """Encoded ``values`` (raw bytes as they are, keyed ``junk``) in order, each keyed by its ``key`` field."""
    topic, codec = settings.topic(short), Codec()
    await produce(settings, topic, [
        (b"junk", v) if isinstance(v, bytes) else (str(v[key]).encode(), codec.encode(record, v, topic=topic))
        for v in values])


def _decoded(settings: Settings, short: str, record: str) -> dict[tuple[int, int], dict[str, Any]]:
    """Every decodable record of a topic by (partition, offset), decoded here with the codec."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from boltstream.broker.kafka import consumer_kwargs, log_end_offsets

    async def go() -> dict[tuple[int, int], dict[str, Any]]:
        topic, codec, out = settings.topic(short), Codec(), {}
        tps = [TopicPartition(topic, p) for p in range(settings.partitions)]
        ends = await log_end_offsets(settings, tps)
        consumer = AIOKafkaConsumer(**consumer_kwargs(settings, None))
        await consumer.start()
        try:
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            while any([await consumer.position(tp) < ends[tp] for tp in tps]):
                for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                    for r in records:
                        if r.value != GARBAGE:
                            out[(tp.partition, r.offset)] = as_lists(codec.decode(r.value, topic=topic, expect=record))
        finally:
            await consumer.stop()
        return out

    return run_sync(go())


def test_round_trip_of_every_kind_loads_with_pandas_and_datasets(settings, run_cli, tmp_path: Path,
                                                                  monkeypatch) -> None:
    spans = [span(i, llm=i % 4 != 0) for i in range(40)]
    batches = [r for i in range(6) for r in group(f"g{i}", seed=i, parts=2 if i % 2 else 1)]
    trajectories = [{**EXAMPLES["Trajectory"], "attempt_id": f"a{i}", "task_id": f"t{i}"} for i in range(5)]
    for short, record, values, key in (("spans", "Span", spans, "rollout_id"),
                                       ("batches", "TrainingBatch", batches, "task_id"),
                                       ("trajectories", "Trajectory", trajectories, "task_id")):
        run_sync(produce_records(settings, short, record, [*values[:3], GARBAGE, *values[3:]], key))

    # batches: one row per sample; the rows rebuild exactly the records on the topic
    out = tmp_path / "batches.parquet"
    proc = run_cli("export", "batches", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "1 undecodable skipped" in proc.stdout and "undecodable" in proc.stderr
    table = pq.read_table(out)
    assert table.num_rows == sum(len(b["samples"]) for b in batches)
    rows = table.to_pylist()
    assert [(r["partition"], r["offset"]) for r in rows] == sorted((r["partition"], r["offset"]) for r in rows)
    rebuilt = {(p, o): rec for p, o, rec in batch_records(rows, record_field_names("Sample"),
                                                           [f for f in record_field_names("TrainingBatch")
                                                            if f != "samples"])}
    assert rebuilt == _decoded(settings, "batches", "TrainingBatch")
    meta = read_metadata(out)
    assert meta["boltstream"]["kind"] == "batches" and meta["boltstream"]["topic"] == settings.topic("batches")
    assert meta["boltstream"]["range"]["from"] == "earliest"
    assert sum(b - a for a, b in meta["boltstream"]["range"]["offsets"].values()) == len(batches) + 1
    assert meta["avro.schema"]["name"] == "TrainingBatch"
    assert meta["boltstream.stats"] == {"records": len(batches) + 1, "rows": table.num_rows, "undecodable": 1}

    # spans: one row per span, token ids and logprobs as lists, attributes as JSON
    # the other kinds through the same entry point in this process (a subprocess costs seconds of imports)
    out = tmp_path / "spans.parquet"
    assert cli_main(["export", *settings_flags(settings), "spans", "--out", str(out)]) == 0
    rows = pq.read_table(out).to_pylist()
    topic = _decoded(settings, "spans", "Span")
    assert len(rows) == len(topic) == len(spans)
    for row in rows:
        want = topic[(row["partition"], row["offset"])]
        assert row["span_id"] == want["span_id"] and row["key"] == want["rollout_id"]
        llm = want["llm"] or {}
        assert row["llm_prompt_token_ids"] == llm.get("prompt_token_ids")
        assert row["llm_response_token_ids"] == llm.get("response_token_ids")
        assert row["llm_response_logprobs"] == llm.get("response_logprobs")
        attrs = json.loads(row["attributes"])
        assert attrs["i"] == want["attributes"]["i"] and attrs["tags"] == want["attributes"]["tags"]["strings"]
        assert row["status_code"] == want["status"]["code"] and row["scope_name"] == want["scope"]["name"]

    # the same range as JSON lines: the same rows, metadata beside the file
    jsonl = tmp_path / "spans.jsonl"
    assert cli_main(["export", *settings_flags(settings), "spans", "--format", "jsonl", "--out", str(jsonl)]) == 0
    assert [json.loads(line) for line in jsonl.read_text().splitlines()] == rows
    assert read_metadata(jsonl)["boltstream.stats"]["rows"] == len(rows)

    # trajectories: one row per trajectory, turns as a list of structs
    out = tmp_path / "trajectories.parquet"
    assert cli_main(["export", *settings_flags(settings), "trajectories", "--out", str(out)]) == 0
    rows = pq.read_table(out).to_pylist()
    topic = _decoded(settings, "trajectories", "Trajectory")
    assert sorted(r["attempt_id"] for r in rows) == sorted(t["attempt_id"] for t in topic.values())
    for row in rows:
        assert row["turns"] == topic[(row["partition"], row["offset"])]["turns"]

    # loaders as they are
    import pandas as pd

    frame = pd.read_parquet(tmp_path / "batches.parquet")
    assert len(frame) == sum(len(b["samples"]) for b in batches)
    assert list(frame["token_ids"].iloc[0]) == rows_by_sample(batches)[frame["sample_id"].iloc[0]]
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "batches.parquet"), split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == len(frame)
    assert {s["sample_id"]: s["token_ids"] for s in ds} == rows_by_sample(batches)


def settings_flags(settings: Settings) -> list[str]:
    """The flags that point a command run in this process at ``settings`` (no env, no state file)."""
    return ["--bootstrap-servers", settings.bootstrap_servers, "--state-file", "/nonexistent/stack.json",
            "--namespace", settings.namespace]


def rows_by_sample(batches: list[dict[str, Any]]) -> dict[str, list[int]]:
    return {s["sample_id"]: s["token_ids"] for b in batches for s in b["samples"]}


def test_ranges_and_refusals(settings, run_cli, tmp_path: Path, capsys) -> None:
    batches = [r for i in range(8) for r in group(f"g{i}", seed=i)]
    run_sync(produce_records(settings, "batches", "TrainingBatch", batches, "task_id"))
    out = tmp_path / "b.parquet"

    # a range by offsets: partition 0 only, from its first record on
    ends = {p: 0 for p in range(settings.partitions)}
    for p, _, _ in read_topic(settings, "batches", "TrainingBatch", to_end=True):
        ends[p] += 1
    p0 = next(p for p, n in ends.items() if n)
    others = ",".join(f"{p}:{n}" for p, n in ends.items() if p != p0)
    args = ["batches", "--out", str(out), "--from", f"{p0}:0,{others}"]
    assert cli_main(["export", *settings_flags(settings), *args]) == 0
    table = pq.read_table(out, columns=["partition"])
    assert set(table["partition"].to_pylist()) == {p0} and table.num_rows == 4 * ends[p0]

    refusals = [
        (["batches", "--out", str(out)], "the file exists (pass --overwrite"),
        (["batches", "--out", str(tmp_path)], "is a directory"),
        (["batches", "--out", str(tmp_path / "no" / "x.parquet")], "does not exist"),
        (["batches", "--out", str(tmp_path / "c.parquet"), "--from", f"{p0}:999"], "out of range for partition"),
        (["batches", "--out", str(tmp_path / "c.parquet"), "--from", "2090-01-01T00:00:00Z"], "no records of"),
        (["batches", "--out", str(tmp_path / "c.parquet"), "--namespace", "nosuch."], "does not exist"),
        (["batches", "--out", str(tmp_path / "c.parquet"), "--from", "yesterday"], "expected earliest"),
    ]
    for i, (args, needle) in enumerate(refusals):
        if i == 0:  # as typed
            proc = run_cli("export", *args)
            code, err = proc.returncode, proc.stderr
        else:  # the same entry point in this process (a subprocess each costs seconds of imports)
            code = cli_main(["export", *settings_flags(settings), *args])  # args last: theirs win
            err = capsys.readouterr().err
        assert code == 1 and "boltstream export: error: " in err, (args, err)
        assert needle in err, (args, err)
    assert not (tmp_path / "c.parquet").exists() and not list(tmp_path.glob(".*partial*"))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["export", "sessions", "--out", str(tmp_path / "c.parquet")])
    assert exit_.value.code == 2 and "invalid choice: 'sessions'" in capsys.readouterr().err

    assert cli_main(["export", *settings_flags(settings), "batches", "--out", str(out), "--overwrite"]) == 0
    assert pq.read_metadata(out).num_rows == 4 * len(batches)


# --------------------------------------------------------------------------- memory

SPANS = 100_000
DISTINCT = 500
PROMPT_CHARS = 1400  # the prompt text an instrumented agent's span carries: ~180 MiB of rows in Arrow
PEAK_RSS_BOUND_MIB = 320
# Over a 1,000-span export: one 32 MiB row group, the writer's encoding of it and the allocator's slack
# (measured 44 MiB), well under what the range's rows take in Arrow alone.
GROWTH_BOUND_MIB = 100


def small_span(i: int) -> dict[str, Any]:
    return {**MINIMAL["Span"], "span_id": f"{i:016x}", "rollout_id": f"r{i}",
            "attributes": {"gen_ai.prompt": f"{i:08d}" * (PROMPT_CHARS // 8), "i": i},
            "llm": {**EXAMPLES["Span"]["llm"], "prompt_token_ids": list(range(i, i + 20)),
                    "response_token_ids": [i % 97] * 8, "response_logprobs": [-0.25] * 8}}


async def _produce_many(settings: Settings, count: int) -> int:
    """``count`` small spans, pre-encoded, sent without waiting for each ack; returns the bytes produced."""
    codec, topic = Codec(), settings.topic("spans")
    encoded = [(str(i).encode(), codec.encode("Span", small_span(i), topic=topic)) for i in range(DISTINCT)]
    await produce(settings, topic, (encoded[i % DISTINCT] for i in range(count)),
                  linger_ms=20, max_batch_size=1_000_000)
    return sum(len(v) for _, v in encoded) * count // DISTINCT


def test_a_100k_span_export_stays_under_a_memory_bound(settings, settings_env, tmp_path: Path) -> None:
    produced = run_sync(_produce_many(settings, SPANS))
    small, out = tmp_path / "small.parquet", tmp_path / "spans.parquet"
    first = ",".join(f"{p}:{SPANS // 100 // settings.partitions}" for p in range(settings.partitions))
    base = run_measured(boltstream_argv("export", "spans", "--out", str(small), "--to", first), settings_env, 60)
    assert base.code == 0, base.output[-3000:]
    whole = run_measured(boltstream_argv("export", "spans", "--out", str(out)), settings_env, 180)
    assert whole.code == 0, whole.output[-3000:]
    meta = pq.read_metadata(out)
    assert meta.num_rows == SPANS and meta.num_row_groups > 1
    in_arrow = pq.read_table(out).nbytes / 2**20
    assert in_arrow > 1.5 * GROWTH_BOUND_MIB, "the range must be larger than the bound for the bound to mean anything"
    what = (f"peak RSS {whole.peak_mib:.0f} MiB exporting {produced / 2**20:.0f} MiB of spans ({in_arrow:.0f} MiB "
            f"in Arrow); {base.peak_mib:.0f} MiB for 1% of them")
    assert whole.peak_mib < PEAK_RSS_BOUND_MIB and whole.peak_mib - base.peak_mib < GROWTH_BOUND_MIB, what
