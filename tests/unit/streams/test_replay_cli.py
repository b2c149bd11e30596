"""``boltstream replay``'s flags and configuration, without a broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from boltstream.broker.log_range import LogRangeError
from boltstream.config import knobs
from boltstream.errors import ConfigError
from boltstream.streams.config import StreamConfig
from boltstream.streams.replay_cli import NOT_REPLAYED, config_from_args, parser

ENV = {"BOLTSTREAM_STATE_FILE": "/nonexistent/stack.json"}


def resolve(*argv: str, env: dict[str, str] | None = None):
    args = vars(parser().parse_args(list(argv)))
    args.pop("loglevel"), args.pop("json")
    return config_from_args(args, {**ENV, **(env or {})})


def test_every_stage_setting_of_the_worker_is_a_flag_and_faust_only_ones_are_not() -> None:
    options = {o for action in parser()._actions for o in action.option_strings}
    stage = {k.flag for k in knobs(StreamConfig) if k.name not in NOT_REPLAYED}
    assert stage <= options
    assert {"--gamma", "--air-rules-file", "--call-credit", "--std-normalize", "--agent-match", "--group-size"} <= stage
    assert not {"--app-id", "--store", "--fast-consumer", "--commit-interval-s", "--profile"} & options


def test_flags_resolve_into_the_stage_config_and_the_namespaces(tmp_path: Path) -> None:
    rules = tmp_path / "air.yaml"
    rules.write_text("air:\n  defaults: true\n  rules: []\n")
    config = resolve("--namespace", "exp1.", "--from", "0:5", "--to", "2026-11-24T10:00:00Z", "--gamma", "0.5",
                     "--std-normalize", "--air-rules-file", str(rules), "--group-size", "8", "--live-namespace", "prod.")
    assert (config.namespace, config.start, config.end, config.overwrite) == ("exp1.", "0:5", "2026-11-24T10:00:00Z",
                                                                              False)
    assert config.stream.settings.namespace == "prod."
    stages = config.stage_config()
    assert stages.settings.namespace == "exp1." and stages.group_size == 8
    assert stages.credit.gamma == 0.5 and stages.credit.std_normalize and stages.air_rules_file == str(rules)
    assert resolve("--namespace", "exp1.", "--overwrite").overwrite


def test_overwrite_only_ever_comes_from_the_flag() -> None:
    assert not resolve("--namespace", "exp1.", env={"BOLTSTREAM_REPLAY_OVERWRITE": "true"}).overwrite


@pytest.mark.parametrize(("argv", "needle"), [
    ((), "a replay needs --namespace"),
    (("--namespace", "boltstream."), "is the live pipeline's namespace"),
    (("--namespace", "a b"), "letters, digits"),
    (("--namespace", "x.", "--gamma", "2"), "gamma"),
    (("--namespace", "x.", "--air-rules-file", "/nonexistent.yaml"), "no such file"),
    (("--namespace", "x.", "--group-size", "0"), "group_size"),
])
def test_bad_configurations_name_what_is_wrong(argv: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        resolve(*argv)


def test_a_malformed_range_fails_before_any_broker_is_asked() -> None:
    with pytest.raises(LogRangeError, match="--from 'yesterday'"):
        resolve("--namespace", "x.", "--from", "yesterday")
