"""``learn --role NAME[=REGEX]``: parsing, the config it implies, and the assembler training one role only."""

from __future__ import annotations

from pathlib import Path

import pytest

from boltstream.errors import ConfigError
from boltstream.learner.config import LearnerConfig, load_config
from boltstream.learner.groups import GroupAssembler
from boltstream.learner.roles import OTHER_ROLE, parse_role
from boltstream.learner.tiny import random_samples


def test_a_bare_name_matches_exactly_that_agent_and_a_regex_searches() -> None:
    writer = parse_role("writer")
    assert writer.name == "writer"
    assert [writer.trains({"agent_name": a}) for a in ("writer", "sql_writer", "writer2", None)] == [
        True, False, False, False]
    sql = parse_role(" sql = _(writer|checker)$ ")
    assert sql.name == "sql"
    assert [sql.trains({"agent_name": a}) for a in ("sql_writer", "sql_checker", "checker", "answerer")] == [
        True, True, False, False]
    assert parse_role("any=.*").trains({"agent_name": None}), "no agent name is matched as the empty string"


@pytest.mark.parametrize(("spec", "needle"), [("", "expected NAME"), ("a.b", "expected NAME"),
                                              ("_w=x", "expected NAME"), ("w=", "regex after '=' is empty"),
                                              ("w=(", "invalid regex")])
def test_bad_roles_are_config_errors_naming_the_role(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        parse_role(spec)
    assert err.value.name == "role"
    with pytest.raises(ConfigError, match="role"):
        LearnerConfig(role=spec)


def test_the_role_names_the_model_and_the_run_so_role_learners_never_share_a_prefix(tmp_path: Path) -> None:
    env = {"BOLTSTREAM_LEARN_ROLE": "checker=check", "BOLTSTREAM_NAMESPACE": "exp.",
           "BOLTSTREAM_STATE_FILE": str(tmp_path / "none.json")}
    checker = load_config({}, env=env)
    writer = load_config({"role": "writer"}, env=env)  # the flag beats the variable
    assert (checker.name, checker.run_name, checker.role_spec.agents.pattern) == ("checker", "exp/checker", "check")
    assert (writer.name, writer.run_name) == ("writer", "exp/writer")
    assert writer.to_dict()["model_name"] == "writer" and writer.to_dict()["role"] == "writer"
    named = LearnerConfig(role="writer", model_name="sql-writer")
    assert (named.name, named.run_name) == ("sql-writer", "boltstream/sql-writer")
    assert LearnerConfig().role_spec is None and LearnerConfig().name == "smollm2"


def _group(name: str, agents: list[str | None]) -> dict:
    samples = random_samples(len(agents), 64, seed=len(name))
    for i, (s, agent) in enumerate(zip(samples, agents, strict=True)):
        s.update(sample_id=f"{name}-{i}", agent_name=agent)
    return {"batch_id": name, "task_id": name, "part": 0, "num_parts": 1, "samples": samples,
            "reward_mean": 0.5, "complete": True}


def test_a_role_trains_its_own_samples_and_uses_up_groups_without_any() -> None:
    asm = GroupAssembler(role=parse_role("writer"))
    asm.add(0, 0, _group("mixed", ["writer", "checker", "writer", None]))
    asm.add(0, 1, _group("checker-only", ["checker", "checker"]))
    asm.add(0, 2, _group("writer-only", ["writer"]))
    step = asm.take_step(2, version=0)
    assert step is not None
    assert [g.batch_id for g in step.groups] == ["mixed", "writer-only"]
    assert step.sample_ids == ["mixed-0", "mixed-2", "writer-only-0"]
    assert step.dropped == {OTHER_ROLE: 4} and asm.dropped == {OTHER_ROLE: 4}
    assert asm.tracker.positions() == {0: 0}, "the mixed group's record is pending until its step is committed"
    asm.commit(step)
    assert asm.tracker.positions() == {0: 3}, "every record used, the checker-only one without a step"
    assert asm.take_step(1, version=1) is None


def test_without_a_role_every_sample_trains() -> None:
    asm = GroupAssembler()
    asm.add(0, 0, _group("mixed", ["writer", "checker", None]))
    step = asm.take_step(1, version=0)
    assert step is not None and step.sample_ids == ["mixed-0", "mixed-1", "mixed-2"] and not step.dropped
