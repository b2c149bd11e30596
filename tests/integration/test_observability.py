"""Watching a run: a real Prometheus scrapes a running pipeline (tiny model, every component a real process)
with the compose file's scrape config pointed at loopback, every query of the Grafana dashboard returns data,
and ``boltstream status --json`` agrees with what the components themselves report.

Prometheus is Debian's ``prometheus`` package (``make test`` installs it); without it this test fails, saying so.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from boltstream.config import Settings
from boltstream.examples.calc.tasks import train_test
from boltstream.monitoring.status import metric_values
from boltstream.processes import Processes, free_port, wait_until
from boltstream.runs.demo import CALC_AGENT, CALC_AIR_RULES
from boltstream.runs.pipeline import PipelineConfig, worker_version
from boltstream.stack import run_sync

REPO = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = REPO / "infra" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO / "infra" / "grafana" / "dashboards" / "boltstream.json"
# Grafana's built-in interval variable, as the dashboard's queries use it.
GRAFANA_VARIABLES = {"$__rate_interval": "1m"}
ATTEMPTS = 15
STREAM_ENV = {"BOLTSTREAM_STREAM_TICK_S": "0.2", "BOLTSTREAM_STREAM_GRACE_S": "0.5"}


def loopback_scrape_config(ports: dict[str, int]) -> dict[str, Any]:
    """The compose file's scrape config with each job's targets replaced by its component on loopback."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == set(ports), f"the compose scrape config has jobs {sorted(jobs)}; this test runs {sorted(ports)}"
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    for job in config["scrape_configs"]:
        for kind in ("static_configs", "dns_sd_configs"):
            job.pop(kind, None)
        job["static_configs"] = [{"targets": [f"127.0.0.1:{ports[job['job_name']]}"]}]
    return config


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, Grafana's variables substituted."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], expr))
    return out


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()  # type: ignore[no-any-return]


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    body = get_json(f"{prom}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]  # type: ignore[no-any-return]


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def targets_up(prom: str) -> bool:
    active = get_json(f"{prom}/api/v1/targets")["data"]["activeTargets"]
    return bool(active) and all(t["health"] == "up" for t in active)


async def _send_garbage(settings: Settings) -> None:
    """One undecodable record on the spans topic: the stream app dead-letters it (the dead letters panel)."""
    from aiokafka import AIOKafkaProducer

    from boltstream.broker.kafka import producer_kwargs

    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    try:
        await producer.send_and_wait(settings.topic("spans"), b"not avro", key=b"garbage")
    finally:
        await producer.stop()


def stream_lag(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(get_text(url)) for s in fam.samples
               if s.name == "boltstream_stream_consumer_lag_records")


def status(boltstream_cmd: list[str], env: dict[str, str], *args: str) -> dict[str, Any]:
    done = subprocess.run([*boltstream_cmd, "status", "--json", *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_prometheus_scrapes_the_pipeline_and_status_agrees(stack: dict[str, Any], settings: Settings,
                                                           settings_env: dict[str, str], tmp_path: Path,
                                                           boltstream_cmd: list[str]) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus binary is not installed: `make system` installs it (root + apt-get), "
                    "or apt-get install -y prometheus")
    train, test = train_test(n_train=40, n_test=2, seed=5)
    for name, tasks in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    cfg = PipelineConfig(agent=CALC_AGENT, train=tmp_path / "train.jsonl", test=tmp_path / "test.jsonl",
                         out=tmp_path / "out", model="tiny", group_size=2, steps=1000, runner_workers=4,
                         tasks_per_version=2,  # the worker idles between versions, so it reloads
                         learner={"groups_per_step": 2, "lr_warmup_steps": 0},
                         stream={"air_rules_file": CALC_AIR_RULES})
    ports = {job: free_port() for job in ("stream", "learner", "inference", "runner")}
    prom_port = free_port()
    prom = f"http://127.0.0.1:{prom_port}"
    worker_url = f"http://127.0.0.1:{ports['inference']}"
    argv = cfg.argv(port=ports["inference"], base_url=f"{worker_url}/v1", metrics_path=tmp_path / "metrics.jsonl")
    env = {**settings_env, **STREAM_ENV, "CALC_TEMPERATURE": "1.0",
           "BOLTSTREAM_STREAM_METRICS_PORT": str(ports["stream"]),
           "BOLTSTREAM_RUNNER_METRICS_PORT": str(ports["runner"])}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(loopback_scrape_config(ports)))
    procs = Processes(tmp_path / "logs", env)
    try:
        procs.start_command("prometheus", [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                           f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                           f"--web.listen-address=127.0.0.1:{prom_port}"])
        procs.start("worker", *argv["worker"])
        wait_until(lambda: worker_version(ports["inference"]) is not None, 300, "the inference worker", procs)
        procs.start("stream", *argv["stream"])
        procs.start("learner", *argv["learner"], "--metrics-port", str(ports["learner"]))
        procs.start("tasks", *argv["tasks"])
        procs.start("runner", *argv["runner"])
        run_sync(_send_garbage(settings))

        def up() -> bool:
            try:
                return targets_up(prom)
            except OSError:
                return False

        wait_until(up, 180, "Prometheus to scrape every component", procs)
        wait_until(lambda: (worker_version(ports["inference"]) or 0) >= 1, 300,
                   "a learner step and the worker's reload of it", procs)

        _every_dashboard_query_answers(prom, procs)
        _status_agrees_with_the_components(procs, settings, env, stack, boltstream_cmd, ports, len(train))
    finally:
        procs.stop_all()


def _every_dashboard_query_answers(prom: str, procs: Processes) -> None:
    """Every query of the dashboard returns data (rates need two scrapes with the series present)."""
    queries = dashboard_queries()
    missing: list[tuple[str, str]] = queries

    def all_answer() -> bool:
        nonlocal missing
        missing = [(title, q) for title, q in queries if not has_data(query(prom, q))]
        return not missing

    try:
        wait_until(all_answer, 120, "every dashboard query to return data", procs)
    except Exception:
        pytest.fail(f"dashboard queries without data: {missing}")


def _status_agrees_with_the_components(procs: Processes, settings: Settings, env: dict[str, str], stack: dict[str, Any],
                                       boltstream_cmd: list[str], ports: dict[str, int], tasks: int) -> None:
    """``boltstream status --json`` against the running pipeline, compared with the components' own reports:
    read them, run status, read them again; once nothing moved meanwhile, status must say the same (a step
    or a commit between the readings only means another try, at most ATTEMPTS)."""
    worker_url = f"http://127.0.0.1:{ports['inference']}"
    procs.stop("runner")
    learner_metrics = f"http://127.0.0.1:{ports['learner']}/metrics"
    stream_metrics = f"http://127.0.0.1:{ports['stream']}/metrics"

    def components() -> dict[str, Any]:
        health = get_json(f"{worker_url}/health")
        learner = metric_values(get_text(learner_metrics))
        return {"served": health["policy_version"], "learner_step": learner.get("learner_step"),
                "learner_version": learner.get("learner_version"), "stream_lag": stream_lag(stream_metrics)}

    def says(report: dict[str, Any]) -> dict[str, Any]:
        worker = report["workers"][0]
        return {"served": worker["policy_version"] if worker["healthy"] else None,
                "learner_step": report["learner"]["policy"]["learner_step"],
                "learner_version": report["learner"]["policy"]["version"],
                "stream_lag": report["groups"][f"{settings.namespace}stream"]["lag"]}

    tries = []
    for _ in range(ATTEMPTS):
        before = components()
        report = status(boltstream_cmd, env, "--worker", worker_url, "--metrics", learner_metrics)
        after = components()
        tries.append((before, says(report), after))
        if before == after == says(report):
            break
    else:
        pytest.fail(f"status never matched the components (before, status, after): {tries}")
    assert report["metrics"][0]["learner_step"] == before["learner_step"]
    assert "step_fallbacks" not in report["metrics"][0]  # the tiny model takes every path its config asks for
    assert 'boltstream_learner_step_mode{model="policy",path="prefix_tree",reason=""} 1.0' in get_text(learner_metrics)
    assert before["learner_step"] >= 1 and before["served"] >= 1
    assert report["topics"][settings.topic("spans")]["records_end"] > 0
    # the paced runner left tasks untaken: its group's lag is the tasks its log never names
    started = set(re.findall(r"task (\S+) attempt \d+:", procs.log_path("runner").read_text()))
    assert report["groups"][f"{settings.namespace}runners"]["lag"] == tasks - len(started) > 0
    # The same broker found through the embedded stack's state file alone (no BOLTSTREAM_* variables).
    bare = {k: v for k, v in env.items() if not k.startswith("BOLTSTREAM_")}
    assert stack.get("state_file"), stack
    by_state = status(boltstream_cmd, bare, "--state-file", str(stack["state_file"]), "--namespace",
                      settings.namespace)
    assert by_state["topics"].keys() == report["topics"].keys()
    assert by_state["groups"].keys() == report["groups"].keys()
    # and for people: the same facts as lines
    text = subprocess.run([*boltstream_cmd, "status", "--worker", worker_url], env=env, capture_output=True,
                          text=True, timeout=120)
    assert text.returncode == 0, text.stderr[-3000:]
    assert f"{worker_url}: policy v{before['served']}" in text.stdout, text.stdout
    assert f"policy: version {before['learner_version']:g}, step {before['learner_step']:g}" in text.stdout
    assert f"{settings.namespace}runners: {settings.topic('tasks')} {tasks - len(started)}" in text.stdout
