"""The compose files against the code (boltstream.compose_check), without a Docker engine.

The breakage tests show the checker can fail: each copy of the real file, broken one way, must be
reported with a sentence naming what is wrong.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from boltstream import config
from boltstream.compose_check import (
    check_command,
    check_compose,
    check_env_example,
    command_lines,
    interpolate,
    load_compose,
    main,
)

INFRA = Path(__file__).resolve().parents[2] / "infra"
BASE = INFRA / "docker-compose.yml"
GPU = INFRA / "docker-compose.gpu.yml"


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    return load_compose([BASE])


def test_the_compose_files_have_no_problem() -> None:
    assert check_compose(load_compose([BASE])) == []
    assert check_compose(load_compose([BASE, GPU])) == []


def test_env_example_lists_exactly_the_variables_the_compose_files_use() -> None:
    texts = [BASE.read_text(), GPU.read_text()]
    assert check_env_example(texts, (INFRA / ".env.example").read_text()) == []
    assert check_env_example(texts, "S3_ACCESS_KEY=x\nUNUSED=1\n")[-1] == ".env.example lists UNUSED, which no " \
                                                                           "compose file uses"


def test_every_role_is_present_and_the_stream_app_can_scale(model: dict[str, Any]) -> None:
    commands = {name: [a[1] for a in command_lines(spec) if a[0] == "boltstream"]
                for name, spec in model["services"].items()}
    for role in ("topics", "stream", "learn", "serve", "runner", "tasks"):
        assert any(role in c for c in commands.values()), f"no service runs boltstream {role}"
    assert not model["services"]["stream"].get("ports"), "published ports would stop --scale stream=N"
    assert "container_name" not in model["services"]["stream"]


def test_the_runner_trains_the_calculator_agent_against_the_served_policy(model: dict[str, Any]) -> None:
    runner = command_lines(model["services"]["runner"])[0]
    serve = command_lines(model["services"]["inference"])[0]
    learn = command_lines(model["services"]["learner"])[0]
    assert runner[runner.index("--agent") + 1] == "boltstream.examples.calc.agent:solve"
    assert runner[runner.index("--base-url") + 1] == "http://inference:8000/v1"
    # the agent asks for "policy"; the worker serves it and the learner publishes checkpoints of it
    assert serve[serve.index("--served-model-name") + 1] == learn[learn.index("--model-name") + 1] == "policy"


def test_interpolation_follows_compose() -> None:
    assert interpolate("${A:-x} ${B} ${C-y}", {"A": "1"}) == "1  y"


def _cmd(model: dict[str, Any], service: str, command: list[str]) -> None:
    model["services"][service]["command"] = command


BREAKAGES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "unknown variable": (lambda m: m["services"]["learner"]["environment"].update(BOLTSTREAM_LEARN_TEMPERATURE="1"),
                         "learner: sets ['BOLTSTREAM_LEARN_TEMPERATURE']"),
    "variable of another component": (
        lambda m: m["services"]["stream"]["environment"].update(BOLTSTREAM_SERVE_PORT="1"),
        "stream: sets ['BOLTSTREAM_SERVE_PORT']"),
    "bad value": (lambda m: m["services"]["stream"]["environment"].update(BOLTSTREAM_STREAM_GAMMA="two"),
                  "stream: its environment is refused by boltstream stream: BOLTSTREAM_STREAM_GAMMA"),
    "unknown command": (lambda m: _cmd(m, "learner", ["boltstream", "lern"]), "unknown boltstream command ['lern']"),
    "unknown sub-command": (lambda m: _cmd(m, "stream", ["boltstream", "stream", "wroker"]),
                            "invalid choice: 'wroker'"),
    "unknown flag": (lambda m: _cmd(m, "inference", ["boltstream", "serve", "--temperature", "1"]),
                     "unrecognized arguments: --temperature 1"),
    "secret in argv": (lambda m: _cmd(m, "inference", ["boltstream", "serve", "--api-key", "k"]),
                       "--api-key is not accepted on the command line, where every user of the machine can read "
                       "it: set BOLTSTREAM_SERVE_API_KEY instead"),
    "missing module": (lambda m: _cmd(m, "tasks", ["sh", "-c", "python -m boltstream.examples.calc.taks && true"]),
                       "no module 'boltstream.examples.calc.taks'"),
    "no topic init": (lambda m: m["services"].pop("topics") and [s.get("depends_on", {}).pop("topics", None)
                                                                 for s in m["services"].values()],
                      "no service runs 'boltstream topics create'"),
    "some topics only": (lambda m: _cmd(m, "topics", ["boltstream", "topics", "create", "spans", "batches"]),
                         "creates only ['spans', 'batches']"),
    "partitions differ": (lambda m: m["services"]["stream"]["environment"].update(BOLTSTREAM_PARTITIONS="3"),
                          "stream: BOLTSTREAM_PARTITIONS='3' differs"),
    "not waiting for topics": (lambda m: m["services"]["runner"]["depends_on"].pop("topics"),
                               "runner: does not wait for topics"),
    "latest image": (lambda m: m["services"]["minio"].update(image="quay.io/minio/minio:latest"),
                     "minio: image 'quay.io/minio/minio:latest' is not pinned"),
    "untagged image": (lambda m: m["services"]["console"].update(image="docker.redpanda.com/redpandadata/console"),
                       "console: image 'docker.redpanda.com/redpandadata/console' is not pinned"),
    "port clash": (lambda m: m["services"]["inference"].update(ports=["9000:8000"]),
                   "host port 9000 is already published by"),
    "healthy without healthcheck": (lambda m: m["services"]["redpanda"].pop("healthcheck"),
                                    "waits for redpanda to be healthy, but redpanda has no healthcheck"),
    "missing dependency": (lambda m: m["services"]["runner"]["depends_on"].update(agent={}),
                           "runner: depends on 'agent', which is not a service"),
    "cycle": (lambda m: m["services"]["redpanda"].update(depends_on={"topics": {"condition": "service_started"}}),
              "depends_on cycle: redpanda -> topics -> redpanda"),
    "one-shot that restarts": (lambda m: m["services"]["topics"].update(restart="always"),
                               "waits for topics to complete, but topics restarts forever"),
    "scraped on another port": (
        lambda m: m["services"]["stream"]["environment"].update(BOLTSTREAM_STREAM_METRICS_PORT="9200"),
        "job stream scrapes stream:9100, but stream serves /metrics on [9200]"),
    "metrics on loopback": (
        lambda m: m["services"]["stream"]["environment"].update(BOLTSTREAM_STREAM_METRICS_HOST="127.0.0.1"),
        "job stream scrapes stream:9100, but stream binds it to loopback only"),
    "scraped without a metrics port": (
        lambda m: _cmd(m, "learner", ["boltstream", "learn", "--model", "smollm2", "--model-name", "policy"]),
        "job learner scrapes learner:9101, but learner serves no /metrics"),
    "mounted file missing": (lambda m: m["services"]["grafana"]["volumes"].append("./grafana/nothing:/x:ro"),
                             "grafana: mounts ./grafana/nothing, which does not exist next to the compose file"),
    "undeclared volume": (lambda m: m["services"]["prometheus"]["volumes"].append("prom-data:/prometheus"),
                          "prometheus: uses volume 'prom-data', which the top-level volumes do not declare"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_each_breakage_is_reported(model: dict[str, Any], breakage: str) -> None:
    broken = copy.deepcopy(model)
    mutate, expected = BREAKAGES[breakage]
    mutate(broken)
    problems = check_compose(broken)
    assert any(expected in p for p in problems), problems


def test_a_copy_broken_many_ways_reports_every_breakage(model: dict[str, Any]) -> None:
    broken = copy.deepcopy(model)
    chosen = ["unknown variable", "unknown flag", "latest image", "port clash", "cycle", "partitions differ"]
    for name in chosen:
        BREAKAGES[name][0](broken)
    problems = check_compose(broken)
    for name in chosen:
        assert any(BREAKAGES[name][1] in p for p in problems), (name, problems)


def test_the_command_line_check_exits_1_on_a_broken_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(BASE.read_text().replace("BOLTSTREAM_PARTITIONS:", "BOLTSTREAM_PARTITION:"))
    assert main([str(broken)]) == 1
    assert "BOLTSTREAM_PARTITION'" in capsys.readouterr().err
    assert main([str(BASE)]) == 0


def test_commands_that_are_not_boltstream_are_left_alone() -> None:
    assert check_command(["rpk", "cluster", "health"]) is None
    assert check_command(["python", "-m", "boltstream.examples.calc.tasks"]) is None


def test_the_code_needs_the_topics_the_init_service_creates() -> None:
    # what `boltstream topics create` (no names) creates is config.TOPICS with TOPIC_CONFIGS
    from boltstream.broker.topics import TOPIC_CONFIGS, parser

    args = parser().parse_args(["create"])
    assert args.names == [] and set(TOPIC_CONFIGS) <= set(config.TOPICS)


def _docker_compose() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


@pytest.mark.skipif(_docker_compose() is None, reason="no docker compose client installed: this checks the "
                    "tool's own parsing of the file, which the tests above do not replace")
def test_docker_compose_config_accepts_the_files() -> None:
    cmd = _docker_compose()
    assert cmd is not None
    for files in ([BASE], [BASE, GPU]):
        args = [a for f in files for a in ("-f", str(f))]
        done = subprocess.run([*cmd, *args, "config", "--quiet"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr


def _readme_production_lines() -> list[str]:
    readme = (INFRA.parent / "README.md").read_text()
    section = readme.split("### Production: docker compose")[1].split("\n## ")[0]
    blocks = section.split("```bash\n")[1:]
    return [line.split("  #")[0].strip() for block in blocks for line in block.split("```")[0].splitlines()
            if line.strip()]


def test_the_readme_production_section_matches_the_compose_file(model: dict[str, Any]) -> None:
    lines = _readme_production_lines()
    published = {_host(p) for spec in model["services"].values() for p in spec.get("ports") or []}
    env_example = (INFRA / ".env.example").read_text()
    ran_check = False
    for line in lines:
        words = line.split()
        if words[:2] == ["docker", "compose"]:
            files = [words[i + 1] for i, w in enumerate(words) if w == "-f"]
            assert files and all((INFRA.parent / f).is_file() for f in files), line
            if "up" in words:  # every service named exists
                named = [w for w in words[words.index("up") + 1:] if not w.startswith("-") and "=" not in w]
                assert set(named) <= set(model["services"]), line
            for scale in [w.split("=")[0] for w in words if "=" in w and words[words.index(w) - 1] == "--scale"]:
                assert scale in model["services"], line
        elif words[0] == "export":
            name, value = words[1].split("=", 1)
            if "localhost:" in value:  # a published host port of the compose file
                assert value.split("localhost:")[1].split("/")[0] in published, line
            if name == "BOLTSTREAM_S3_SECRET_KEY":
                assert f"S3_SECRET_KEY={value}" in env_example, line
        elif words[:3] == ["python", "-m", "boltstream.compose_check"]:
            assert main(words[3:]) == 0  # runs as written (from the repository root)
            ran_check = True
        elif words[0] == "boltstream":
            assert check_command(words) is None, line
        else:
            assert words[0] in ("cp", "python"), f"README command nobody checks: {line}"
            if words[0] == "cp":
                assert (INFRA.parent / words[1]).is_file(), line
            else:
                assert check_command(words) is None, line
    assert ran_check


def _host(mapping: Any) -> str:
    return str(mapping).split(":")[0]


def test_the_scrape_config_names_only_services_and_every_metrics_port(model: dict[str, Any], tmp_path: Path) -> None:
    import yaml

    from boltstream.compose_check import prometheus_config_file, scrape_targets

    service, path = prometheus_config_file(model) or ("", Path())
    assert service == "prometheus" and path == INFRA / "prometheus" / "prometheus.yml"
    jobs = {job for job, *_ in scrape_targets(yaml.safe_load(path.read_text()))}
    assert jobs == {"stream", "learner", "inference", "runner"}
    # a copy of the scrape config that forgets the runner and scrapes a host that is no service
    scrape = yaml.safe_load(path.read_text())
    scrape["scrape_configs"] = [j for j in scrape["scrape_configs"] if j["job_name"] != "runner"]
    scrape["scrape_configs"].append({"job_name": "agent", "static_configs": [{"targets": ["agent:9464"]}]})
    copy_path = tmp_path / "prometheus.yml"
    copy_path.write_text(yaml.safe_dump(scrape))
    broken = copy.deepcopy(model)
    broken["services"]["prometheus"]["volumes"][0] = f"{copy_path}:/etc/prometheus/prometheus.yml:ro"
    problems = check_compose(broken)
    assert "prometheus: job agent scrapes agent:9464, and agent is not a service" in problems, problems
    assert "runner: serves /metrics on [9102], but no job of prometheus scrapes it" in problems, problems


def test_the_dashboard_is_provisioned_on_the_provisioned_data_source() -> None:
    import json

    import yaml

    dash = json.loads((INFRA / "grafana" / "dashboards" / "boltstream.json").read_text())
    source = yaml.safe_load((INFRA / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    provider = yaml.safe_load((INFRA / "grafana" / "provisioning" / "dashboards" / "boltstream.yml").read_text())
    uid = source["datasources"][0]["uid"]
    targets = [t for p in dash["panels"] for t in p.get("targets", [])]
    assert targets and all(t["expr"].strip() and t["datasource"]["uid"] == uid for t in targets)
    grafana = load_compose([BASE])["services"]["grafana"]
    mounted = {v.split(":")[1] for v in grafana["volumes"]}
    assert provider["providers"][0]["options"]["path"] in mounted
