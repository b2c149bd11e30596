"""The demo's whole pipeline with a tiny random model, every component a real process, on
``stack up --secure``: every component (runner + exporter, stream app, learner, inference worker,
topics admin) reaches the broker over TLS from its environment alone, the worker requires an API
key, and clients without TLS or without the stack's CA are refused.

The same pipeline on a plaintext embedded stack is ``boltstream demo --zero-code`` in
test_demo_pipeline.py (and every other integration test's stack): one run of it here is enough.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import pytest

from boltstream.broker.kafka import BrokerUnavailableError, wait_for_broker
from boltstream.examples.calc.tasks import train_test
from boltstream.runs.demo import CALC_AGENT, CALC_AIR_RULES
from boltstream.runs.pipeline import PipelineConfig, read_jsonl
from boltstream.runs.train import run
from boltstream.stack import embedded_stack, settings_env

API_KEY = "sk-secure-pipeline-1f9d"


def test_two_learner_steps_over_tls_with_an_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train, test = train_test(n_train=8, n_test=2, seed=3)
    for name, tasks in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    with embedded_stack(tmp_path / "stack", secure=True) as settings:
        assert settings.security_protocol == "SSL" and settings.ssl_cafile
        # no TLS, or TLS without the stack's CA: refused
        for wrong in (dataclasses.replace(settings, security_protocol="PLAINTEXT", ssl_cafile=None),
                      dataclasses.replace(settings, ssl_cafile=None)):
            with pytest.raises(BrokerUnavailableError):
                asyncio.run(wait_for_broker(wrong, timeout=2))
        # every component is configured by env alone, as `eval "$(boltstream stack env)"` would
        for key in [k for k in os.environ if k.startswith("BOLTSTREAM_")]:
            monkeypatch.delenv(key)
        for key, value in settings_env(settings).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("BOLTSTREAM_STATE_FILE", str(tmp_path / "no-stack.json"))
        monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # the in-process evaluation's agent
        cfg = PipelineConfig(
            agent=CALC_AGENT, train=tmp_path / "train.jsonl", test=tmp_path / "test.jsonl",
            out=tmp_path / "out", model="tiny", lora=True, group_size=2, steps=2,
            time_budget_s=400, runner_workers=4, eval_samples=1, tasks_per_version=2,
            learner={"groups_per_step": 2, "lr_warmup_steps": 2},
            stream={"air_rules_file": CALC_AIR_RULES},
            extra_env=(("CALC_TEMPERATURE", "1.0"), ("BOLTSTREAM_SERVE_API_KEY", API_KEY),
                       ("OPENAI_API_KEY", API_KEY)),
        )
        summary = run(cfg, external=True)

    steps = [r for r in read_jsonl(cfg.out / "metrics.jsonl") if r.get("event") == "step"]
    assert [r["step"] for r in steps][:2] == [1, 2]
    assert all(r["samples"] > 0 for r in steps)
    assert steps[0]["lr"] * 2 == steps[1]["lr"] == cfg.learner_config().lr  # --lr-warmup-steps 2 reached it
    # paced runner: 2 tasks per policy version, so each step trained on the version just served
    assert all(set(r["staleness"]) == {"0"} for r in steps)
    # the worker reloaded the learner's checkpoints: the served policy version moved on
    assert summary["policy_version_served"] >= 2 and summary["stopped_by_time_budget"] is False
    # adapters on every linear layer (the learner's default), MLP included
    learner_config = (cfg.out / "logs" / "learner.log").read_text().split("learner config:")[1].splitlines()[0]
    assert "'gate_proj', 'up_proj', 'down_proj'" in learner_config
    assert "std_normalize=False" in (cfg.out / "logs" / "stream.log").read_text()  # the stream app's default
    assert abs(summary["improvement"] - (summary["after"]["score"] - summary["before"]["score"])) < 1e-9
    assert summary["improvement_se"] >= 0
    assert (cfg.out / "curve.png").stat().st_size > 0
    saved = json.loads((cfg.out / "summary.json").read_text())
    assert {"before", "after"} <= saved.keys() and "se" in saved["after"]
    logs = {p.name: p.read_text(errors="replace") for p in (cfg.out / "logs").iterdir()}
    assert all(API_KEY not in text for text in logs.values())
    # The only address any component was given is the TLS listener, which refuses plaintext (above):
    # training batches (stream app), checkpoints (learner -> worker) and spans (runner, worker) all
    # went over TLS.
