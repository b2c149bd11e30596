"""A component runs with the same settings however it is started: by ``boltstream train``, by hand
(its CLI), from ``BOLTSTREAM_*`` variables, or by the compose file.

Each comparison resolves the component's config with the component's own parser and
:func:`boltstream.config.load`, from the very command line ``boltstream train`` would start it with
(:meth:`PipelineConfig.argv`) or the compose file declares. That every variable and flag of the compose
file exists at all is checked, for every service, by tests/unit/test_compose_file.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from boltstream.compose_check import load_compose
from boltstream.config import Knob, knobs, load
from boltstream.errors import BoltstreamError
from boltstream.inference.cli import ServeConfig
from boltstream.inference.cli import parser as serve_parser
from boltstream.learner.cli import parser as learner_parser
from boltstream.learner.config import LearnerConfig
from boltstream.runs.pipeline import HOLD_FILE, RUN_GRACE_S, PipelineConfig
from boltstream.runs.train import LEARNER_SETTINGS, STREAM_SETTINGS, add_arguments, config_from_args
from boltstream.streams.cli import parser as stream_parser
from boltstream.streams.config import StreamConfig
from boltstream.weights.models import resolve_dtype

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "infra" / "docker-compose.yml"
# What a run decides for itself (names, lengths, where metrics go): not a training setting.
RUN_SPECIFIC = {"model_name", "max_steps", "checkpoint_every", "metrics_path", "metrics_port", "metrics_host",
                "worker_metrics",
                "served_model_name", "port", "host", "spool_dir"}
COMPONENTS: dict[str, tuple[type, Any, list[str]]] = {
    # config class, its parser, the argv words before the options
    "learn": (LearnerConfig, learner_parser, []),
    "stream": (StreamConfig, stream_parser, ["worker"]),
    "serve": (ServeConfig, serve_parser, []),
}


def resolve(component: str, argv: list[str], env: dict[str, str] | None = None) -> Any:
    cls, parser, lead = COMPONENTS[component]
    args = vars(parser().parse_args([*lead, *argv]))
    return load(cls, args, env=env or {}, state_file=os.devnull)


def values(config: Any, skip: set[str] = RUN_SPECIFIC) -> dict[str, Any]:
    """Every leaf setting of a resolved config, the broker/S3 settings aside."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "settings" or f.name in skip:
            continue
        out.update(values(value, skip) if dataclasses.is_dataclass(value) else {f.name: value})
    return out


@pytest.fixture
def run_cfg(tmp_path: Path) -> PipelineConfig:
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text('{"id": "t1"}\n')
    return PipelineConfig(agent="boltstream.examples.calc.agent:solve", train=tmp_path / "train.jsonl",
                          test=tmp_path / "test.jsonl", out=tmp_path / "out")


def train_started(run_cfg: PipelineConfig, component: str, **changes: Any) -> Any:
    """The config ``component`` resolves from the command line ``boltstream train`` gives it."""
    argv = dataclasses.replace(run_cfg, **changes).argv()[{"learn": "learner", "serve": "worker"}.get(component,
                                                                                                       component)]
    return resolve(component, argv[2:] if component == "stream" else argv[1:])


def test_train_passes_no_setting_it_was_not_given(run_cfg: PipelineConfig) -> None:
    # Everything but what a run decides itself is the component's own default, the one a hand-run
    # component gets: nothing is copied, so nothing can drift.
    # ...but the hold while the run scores the base policy (HOLD_FILE)
    hold = str(run_cfg.out / HOLD_FILE)
    assert values(train_started(run_cfg, "learn")) == values(resolve("learn", ["--lora", "--hold-file", hold]))
    # ...but the wait for late spans: a run's rollouts log their spans before their root (RUN_GRACE_S)
    assert values(train_started(run_cfg, "stream")) == values(resolve("stream", ["--grace-s", str(RUN_GRACE_S)]))
    # ...and the worker's float32 and training temperature (docs/learner.md, Defaults)
    assert values(train_started(run_cfg, "serve")) == values(resolve("serve", [
        "--lora", "--dtype", "float32", "--rollout-temperature", "1.0"]))


@pytest.mark.parametrize(("given", "worker"), [([], 1.0), (["--train-temperature", "0.8"], 0.8),
                                               (["--train-temperature", "agent"], None)])
def test_train_temperature_reaches_the_worker(run_cfg: PipelineConfig, given: list[str],
                                              worker: float | None) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(given), run_cfg.out, agent=run_cfg.agent, train=run_cfg.train,
                           test=run_cfg.test)
    assert cfg.train_temperature == worker
    assert resolve("serve", cfg.argv()["worker"][1:]).rollout_temperature == worker


def test_a_train_temperature_out_of_range_is_refused(run_cfg: PipelineConfig,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    for bad in ("0", "2.5"):
        with pytest.raises(BoltstreamError, match=f"--train-temperature must be in \\(0, 2\\] or 'agent', got {bad}"):
            config_from_args(p.parse_args(["--train-temperature", bad]), run_cfg.out, agent=run_cfg.agent,
                             train=run_cfg.train, test=run_cfg.test)
    with pytest.raises(SystemExit):
        p.parse_args(["--train-temperature", "warm"])
    assert "a temperature or 'agent', got 'warm'" in capsys.readouterr().err


@pytest.mark.parametrize(("serve_dtype", "lora", "learner_dtype"), [
    ("bfloat16", True, "bfloat16"), ("bfloat16", False, None), ("float32", True, None), (None, True, None)])
def test_a_lora_learner_computes_in_bfloat16_where_the_worker_serves_it(
        run_cfg: PipelineConfig, serve_dtype: str | None, lora: bool, learner_dtype: str | None) -> None:
    learner = train_started(run_cfg, "learn", serve_dtype=serve_dtype, lora=lora)
    assert learner.dtype == learner_dtype
    # "auto" follows what the worker resolves it to on this machine
    auto = train_started(run_cfg, "learn", serve_dtype="auto")
    assert auto.dtype == ("bfloat16" if resolve_dtype("auto") == "bfloat16" else None)


def another_value(knob: Knob, tmp_path: Path) -> Any:
    """A valid value other than the default, per setting."""
    special = {"agent_match": "^solver$", "air_rules_file": tmp_path / "air.yaml",
               "lora_targets": ("q_proj", "v_proj"), "seed": 7, "groups_per_step": 3, "lr": 3e-4,
               "lr_warmup_steps": 5, "kl_coef": 0.05, "call_credit": "return", "std_normalize": True,
               "report_to": ("tensorboard", "mlflow")}
    (tmp_path / "air.yaml").write_text("rules: []\n")
    return special[knob.name]


def text(value: Any) -> str:
    return ",".join(value) if isinstance(value, tuple) else str(value)


SHARED = [("learn", name) for name in LEARNER_SETTINGS] + [("stream", name) for name in STREAM_SETTINGS]


@pytest.mark.parametrize(("component", "name"), SHARED)
def test_a_shared_setting_resolves_the_same_from_train_the_cli_and_env(
        run_cfg: PipelineConfig, tmp_path: Path, component: str, name: str) -> None:
    cls = COMPONENTS[component][0]
    knob = next(k for k in knobs(cls) if k.name == name)
    value = another_value(knob, tmp_path)
    assert value != knob.default
    overrides = {"learner" if component == "learn" else "stream": {name: value}}
    from_train = values(train_started(run_cfg, component, **overrides))[name]
    flag = [knob.flag] if value is True else [knob.flag, text(value)]
    from_cli = values(resolve(component, flag))[name]
    from_env = values(resolve(component, [], env={knob.env: text(value)}))[name]
    expected = str(value) if isinstance(value, Path) else value
    assert from_train == from_cli == from_env == expected


def test_train_offers_each_shared_setting_as_the_components_own_flag(run_cfg: PipelineConfig,
                                                                     tmp_path: Path) -> None:
    # `boltstream train --lr 3e-4 --no-std-normalize ...`: the flags, parsed as a user types them,
    # reach the components as given.
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--lr", "3e-4", "--std-normalize", "--agent-match", "^solver$", "--group-size", "6"])
    cfg = config_from_args(args, tmp_path / "out", agent=run_cfg.agent, train=run_cfg.train, test=run_cfg.test)
    learner, stream = cfg.learner_config(), cfg.stream_config()
    assert (learner.lr, stream.credit.std_normalize, stream.agent_match, stream.group_size) == (
        3e-4, True, "^solver$", 6)
    assert cfg.argv()["runner"][cfg.argv()["runner"].index("--group-size") + 1] == "6"


def test_a_bad_override_fails_when_the_run_is_configured(run_cfg: PipelineConfig) -> None:
    with pytest.raises(Exception, match="lr_warmup"):
        dataclasses.replace(run_cfg, learner={"lr_warmup": 2})
    with pytest.raises(Exception, match="gamma"):
        dataclasses.replace(run_cfg, stream={"gamma": 2.0})
    with pytest.raises(Exception, match="call-credit tokens"):
        dataclasses.replace(run_cfg, stream={"call_credit": "tokens"})


# --------------------------------------------------------------------------- compose


def compose_services() -> dict[str, dict[str, Any]]:
    return load_compose([COMPOSE])["services"]


def compose_started(service: str) -> tuple[str, Any, dict[str, str]]:
    spec = compose_services()[service]
    command = spec["command"] if isinstance(spec["command"], list) else shlex.split(spec["command"])
    assert command[0] == "boltstream", f"{service}: {command}"
    component = command[1]
    argv = command[2:]
    if component == "stream":
        assert argv[0] == "worker"
        argv = argv[1:]
    env = {k: str(v) for k, v in (spec.get("environment") or {}).items()}
    return component, resolve(component, argv, env=env), env


@pytest.mark.parametrize("service", ["stream", "learner", "inference"])
def test_compose_services_run_with_the_settings_train_gives_them(run_cfg: PipelineConfig, service: str) -> None:
    component, config, _ = compose_started(service)
    expected = values(train_started(run_cfg, component))
    if component == "stream":  # compose's stream app serves any exporter: it keeps its own wait for late spans
        expected["grace_s"] = values(resolve("stream", []))["grace_s"]
    if component == "learn":  # nothing holds compose's learner: no run scores the base policy first
        expected["hold_file"] = None
    assert values(config) == expected


def test_a_zero_code_run_starts_the_agent_program_under_opentelemetry_instrument(run_cfg: PipelineConfig) -> None:
    cfg = dataclasses.replace(run_cfg, agent_program=("-m", "agent_module", "--base-url", "{base_url}"))
    argv = cfg.argv(base_url="http://127.0.0.1:9999/v1")["agent"]
    assert Path(argv[0]).name == "opentelemetry-instrument" and argv[1] == sys.executable
    assert argv[2:] == ["-m", "agent_module", "--base-url", "http://127.0.0.1:9999/v1"]
