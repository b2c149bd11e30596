"""``boltstream train > log`` says why a run is not learning: an agent whose attempts all score alike gets
the hint, printed in the piped output and kept in summary.json; one whose rewards spread gets none.

The agents are a user's own file (``--agent path/agents.py:function``), calling the worker once per
rollout with the plain openai SDK; the tiny model, 3 steps of one group of 2 attempts. The spreading
agent's training file holds 2 tasks for the run's 3 groups: the run takes it twice and ends on time.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from boltstream.runs.pipeline import read_jsonl

AGENTS = '''
import os
from openai import OpenAI


def _call(ctx):
    client = OpenAI(base_url=ctx.base_url, api_key="unused", default_headers=ctx.headers, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   temperature=1.0)


def alike(task, ctx):
    _call(ctx)
    return 1.0


def spread(task, ctx):
    _call(ctx)
    return float(ctx.attempt % 2)
'''


@pytest.mark.parametrize("agent", ["alike", "spread"])
def test_a_run_whose_groups_score_alike_is_told_why_and_one_that_spreads_is_not(
        tmp_path: Path, boltstream_cmd: list[str], agent: str) -> None:
    (tmp_path / "agents.py").write_text(AGENTS)
    for name, n in (("train", 8 if agent == "alike" else 2), ("test", 2)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"id": f"{name}-{i}"}) + "\n" for i in range(n)))
    out = tmp_path / "out"
    argv = [*boltstream_cmd, "train", "--agent", f"{tmp_path / 'agents.py'}:{agent}", "--train",
            str(tmp_path / "train.jsonl"), "--test", str(tmp_path / "test.jsonl"), "--model", "tiny", "--steps", "3",
            "--group-size", "2", "--groups-per-step", "1", "--eval-samples", "1", "--time-budget", "300",
            "--out", str(out)]
    with open(tmp_path / "stdout.txt", "w") as stdout:
        done = subprocess.run(argv, stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                              timeout=420, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = (tmp_path / "stdout.txt").read_text()
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("event") == "step"]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    if agent == "alike":
        assert [r["groups_without_spread"] for r in rows] == [1.0] * 3
        assert [r["reward_spread_mean"] for r in rows] == [0.0] * 3
        assert [(r["alike_reward_mean"], r["group_reward_min"], r["group_reward_max"]) for r in rows] == [(1, 1, 1)] * 3
        (hint,) = summary["hints"]
        assert hint.startswith("100% of the groups in the last 3 steps scored alike") and summary["hints"][hint] == 3
        assert f"not learning? {hint}" in said, said[-3000:]
    else:
        assert [r["groups_without_spread"] for r in rows] == [0.0] * 3
        # rewards 0 and 1: the sample standard deviation (n - 1), as the stream app's baseline uses
        assert all(r["reward_spread_mean"] == pytest.approx(0.5 ** 0.5) for r in rows), rows
        assert [(r["alike_reward_mean"], r["group_reward_min"], r["group_reward_max"]) for r in rows] == \
            [(None, 0.5, 0.5)] * 3
        assert summary["hints"] == {} and "not learning?" not in said
        # the short file: its second pass has ids of its own, and the steps trained from both passes
        repeated = (out / "data" / "train-repeated.jsonl").read_text().splitlines()
        taken = [json.loads(line)["id"] for line in repeated]
        assert taken == ["train-0", "train-1", "train-0~1", "train-1~1"]
        trained = [b.split(":")[0] for r in rows for b in r["batch_ids"]]
        assert len(trained) == 3 and set(trained) <= set(taken) and any("~1" in t for t in trained), trained
