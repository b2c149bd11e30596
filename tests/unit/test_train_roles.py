"""``boltstream train --roles ... --frozen-roles ...``: what each component of a per-role run is told."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import pytest

from boltstream.config import load
from boltstream.errors import BoltstreamError
from boltstream.inference.cli import ServeConfig
from boltstream.inference.cli import parser as serve_parser
from boltstream.learner.config import LearnerConfig
from boltstream.runs.pipeline import PipelineConfig
from boltstream.runs.train import add_arguments, config_from_args


@pytest.fixture
def run_cfg(tmp_path: Path) -> PipelineConfig:
    for name in ("train", "test"):
        (tmp_path / f"{name}.jsonl").write_text('{"id": "t1"}\n')
    return PipelineConfig(agent="boltstream.examples.sql.agent:solve", train=tmp_path / "train.jsonl",
                          test=tmp_path / "test.jsonl", out=tmp_path / "out", model="tiny")


def test_each_trained_role_gets_a_learner_every_role_an_adapter_and_the_stream_the_trained_agents(
        run_cfg: PipelineConfig, tmp_path: Path) -> None:
    cfg = dataclasses.replace(run_cfg, roles=("writer=^sql_writer$", "checker"), frozen_roles=("answerer",))
    argv = cfg.argv(metrics_path=tmp_path / "metrics.jsonl")
    assert [k for k in argv if k.startswith("learner")] == cfg.learner_names() == ["learner-writer",
                                                                                    "learner-checker"]
    learners = cfg.learner_configs()
    assert {n: (c.role, c.name, c.lora, c.max_steps) for n, c in learners.items()} == {
        "learner-writer": ("writer=^sql_writer$", "writer", True, 8),
        "learner-checker": ("checker=^checker$", "checker", True, 8)}
    assert {n: argv[n][argv[n].index("--metrics-path") + 1] for n in learners} == {
        n: str(tmp_path / f"metrics-{role}.jsonl") for n, role in (("learner-writer", "writer"),
                                                                   ("learner-checker", "checker"))}
    assert cfg.stream_config().agent_match == "(?:^sql_writer$)|(?:^checker$)"
    serve = load(ServeConfig, vars(serve_parser().parse_args(argv["worker"][1:])), env={}, state_file=os.devnull)
    assert [(a.name, a.checkpoint_model, a.agents.pattern) for a in serve.adapter_specs] == [
        ("writer", "writer", "^sql_writer$"), ("checker", "checker", "^checker$"), ("answerer", "answerer", "^answerer$")]


def test_without_roles_the_run_is_unchanged(run_cfg: PipelineConfig, tmp_path: Path) -> None:
    argv = run_cfg.argv(metrics_path=tmp_path / "metrics.jsonl")
    assert run_cfg.learner_names() == ["learner"] and "--adapters" not in argv["worker"]
    assert argv["learner"][:5] == ["learn", "--model", "tiny", "--model-name", "policy"]
    assert run_cfg.learner_config().role is None and run_cfg.stream_config().agent_match is None


@pytest.mark.parametrize(("changes", "needle"), [
    ({"roles": ("w", "w=x")}, "named twice"), ({"roles": ("w",), "frozen_roles": ("w",)}, "named twice"),
    ({"frozen_roles": ("f",)}, "--frozen-roles needs --roles"),
    ({"roles": ("w",), "stream": {"agent_match": "^w$"}}, "--agent-match with --roles"),
    ({"roles": ("w",), "lora": False}, "not with --full"), ({"roles": ("w=(",)}, "role='w=\\(': invalid regex")])
def test_bad_role_settings_fail_when_the_run_is_configured(run_cfg: PipelineConfig, changes: dict,
                                                           needle: str) -> None:
    with pytest.raises(BoltstreamError, match=needle):
        dataclasses.replace(run_cfg, **changes)


def test_the_flags_reach_the_run(run_cfg: PipelineConfig, tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--roles", "writer=^sql_writer$, checker", "--frozen-roles", "answerer"])
    cfg = config_from_args(args, tmp_path / "out", agent=run_cfg.agent, train=run_cfg.train, test=run_cfg.test)
    assert (cfg.roles, cfg.frozen_roles) == (("writer=^sql_writer$", "checker"), ("answerer",))


def test_an_agent_program_replaces_the_runner_and_groups_attempts_by_prompt(tmp_path: Path) -> None:
    """``boltstream train --agent-program``: the program runs under opentelemetry-instrument with the run's
    endpoint, training tasks and pacing filled in, no runner or task publisher starts, and the stream app groups the
    attempts by their first prompt for as long as a run."""
    from boltstream.runs.pipeline import INSTRUMENT, ZERO_CODE_PROMPT_WINDOW_S
    from boltstream.runs.train import parser, zero_code

    train, test = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
    for path in (train, test):
        path.write_text('{"question": "1 + 1?", "answer": 2}\n')
    args = parser().parse_args(["--agent", "boltstream.examples.calc.agent:solve", "--train", str(train), "--test",
                                str(test), "--agent-program", "-m boltstream.examples.calc.standalone --tasks "
                                "{train} --base-url {base_url} --tasks-per-version {tasks_per_version}",
                                "--groups-per-step", "3"])
    cfg = config_from_args(args, tmp_path, agent=args.agent, train=args.train, test=args.test,
                           **zero_code(args.agent_program, args.train))
    argv = cfg.argv(port=8000, base_url="http://127.0.0.1:8000/v1", metrics_path=tmp_path / "m.jsonl")
    assert argv["agent"][0] == INSTRUMENT and argv["agent"][2:] == [
        "-m", "boltstream.examples.calc.standalone", "--tasks", str(train), "--base-url", "http://127.0.0.1:8000/v1",
        "--tasks-per-version", "3"]  # the run's pacing: the learner's groups a step
    assert cfg.stream_config().prompt_window_s == ZERO_CODE_PROMPT_WINDOW_S
    assert zero_code(None, args.train) == {}


def test_the_runner_is_paced_to_the_learners_groups_a_step_by_default(run_cfg: PipelineConfig, tmp_path: Path) -> None:
    """Unpaced, a fast agent's rollouts ran ahead and the learner trained samples 4 versions old."""

    def pacing(**changes) -> list[str]:
        argv = dataclasses.replace(run_cfg, **changes).argv(port=1, base_url="u", metrics_path=tmp_path / "m")
        runner = argv["runner"]
        return runner[runner.index("--tasks-per-version"):][:2] if "--tasks-per-version" in runner else []

    assert pacing() == ["--tasks-per-version", str(LearnerConfig().groups_per_step)]
    assert pacing(learner={"groups_per_step": 3}) == ["--tasks-per-version", "3"]
    assert pacing(tasks_per_version=2) == ["--tasks-per-version", "2"]
    assert pacing(tasks_per_version=0) == []
