"""Config resolution: explicit > BOLTSTREAM_* env > embedded stack state file > default, and clear errors."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from boltstream.config import Settings, load
from boltstream.errors import ConfigError

# field, explicit, env, state, expected. None = that layer does not supply the field.
PRECEDENCE = [
    # bootstrap_servers: a str field the state file may supply
    ("bootstrap_servers", None, None, None, "127.0.0.1:9092"),
    ("bootstrap_servers", None, None, "127.0.0.1:1111", "127.0.0.1:1111"),
    ("bootstrap_servers", None, "127.0.0.1:2222", None, "127.0.0.1:2222"),
    ("bootstrap_servers", None, "127.0.0.1:2222", "127.0.0.1:1111", "127.0.0.1:2222"),
    ("bootstrap_servers", "127.0.0.1:3333", None, "127.0.0.1:1111", "127.0.0.1:3333"),
    ("bootstrap_servers", "127.0.0.1:3333", "127.0.0.1:2222", "127.0.0.1:1111", "127.0.0.1:3333"),
    # partitions: an int, coerced from env strings and from JSON numbers
    ("partitions", None, None, None, 4),
    ("partitions", None, None, 7, 7),
    ("partitions", None, "9", 7, 9),
    ("partitions", 11, "9", 7, 11),
    ("partitions", "12", None, None, 12),
    # namespace
    ("namespace", None, None, "stack.", "stack."),
    ("namespace", None, "env.", "stack.", "env."),
    ("namespace", "arg.", "env.", "stack.", "arg."),
    # s3_endpoint
    ("s3_endpoint", None, None, "http://127.0.0.1:5001", "http://127.0.0.1:5001"),
    ("s3_endpoint", None, "http://127.0.0.1:5002", "http://127.0.0.1:5001", "http://127.0.0.1:5002"),
    # a field the state file must NOT supply (not in Settings.from_state): env still wins over default
    ("max_message_bytes", None, None, 2048, 1_000_000),
    ("max_message_bytes", None, "2_000_000", 2048, 2_000_000),
    # optional fields: "none"/empty from env mean unset
    ("schema_registry_url", None, "http://127.0.0.1:8081", None, "http://127.0.0.1:8081"),
    ("schema_registry_url", None, "", None, None),
]


def _write_state(tmp_path: Path, state: dict[str, Any]) -> str:
    path = tmp_path / "stack.json"
    path.write_text(json.dumps(state))
    return str(path)


@pytest.mark.parametrize(("field", "explicit", "env", "state", "expected"), PRECEDENCE)
def test_precedence(tmp_path: Path, field: str, explicit: Any, env: Any, state: Any, expected: Any) -> None:
    state_file = _write_state(tmp_path, {} if state is None else {field: state})
    env_map = {} if env is None else {f"BOLTSTREAM_{field.upper()}": env}
    settings = load(Settings, explicit={field: explicit}, env=env_map, state_file=state_file)
    assert getattr(settings, field) == expected


def test_explicit_none_means_not_given(tmp_path: Path) -> None:
    state_file = _write_state(tmp_path, {"partitions": 5})
    settings = load(
        Settings, explicit={"partitions": None}, env={"BOLTSTREAM_PARTITIONS": "6"}, state_file=state_file
    )
    assert settings.partitions == 6


def test_state_file_location_precedence(tmp_path: Path) -> None:
    """The state file itself: argument > explicit state_file > BOLTSTREAM_STATE_FILE > default."""
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps({"namespace": "a."}))
    b.write_text(json.dumps({"namespace": "b."}))
    env = {"BOLTSTREAM_STATE_FILE": str(b)}
    assert load(Settings, env=env).namespace == "b."
    assert load(Settings, env=env).state_file == str(b)
    assert load(Settings, explicit={"state_file": str(a)}, env=env).namespace == "a."
    assert load(Settings, env=env, state_file=str(a)).namespace == "a."
    missing = load(Settings, env={"BOLTSTREAM_STATE_FILE": str(tmp_path / "none.json")})
    assert missing == dataclasses.replace(Settings(), state_file=str(tmp_path / "none.json"))


BAD = [
    # env, expected ConfigError.name, text in the message
    ({"BOLTSTREAM_PARTITIONS": "abc"}, "BOLTSTREAM_PARTITIONS", "abc"),
    ({"BOLTSTREAM_PARTITIONS": "0"}, "BOLTSTREAM_PARTITIONS", ">= 1"),
    ({"BOLTSTREAM_MAX_MESSAGE_BYTES": "12"}, "BOLTSTREAM_MAX_MESSAGE_BYTES", ">= 1024"),
    ({"BOLTSTREAM_SECURITY_PROTOCOL": "TLS"}, "BOLTSTREAM_SECURITY_PROTOCOL", "SASL_SSL"),
    ({"BOLTSTREAM_BOOTSTRAP_SERVERS": "no-port"}, "BOLTSTREAM_BOOTSTRAP_SERVERS", "host:port"),
    ({"BOLTSTREAM_S3_ENDPOINT": "127.0.0.1:9000"}, "BOLTSTREAM_S3_ENDPOINT", "http://"),
    (
        {"BOLTSTREAM_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "BOLTSTREAM_SASL_MECHANISM": "PLAIN"},
        "BOLTSTREAM_SASL_USERNAME",
        "username",
    ),
    (
        {
            "BOLTSTREAM_SECURITY_PROTOCOL": "SASL_SSL",
            "BOLTSTREAM_SASL_USERNAME": "u",
            "BOLTSTREAM_SASL_PASSWORD": "p",
        },
        "BOLTSTREAM_SASL_MECHANISM",
        "SCRAM-SHA-256",
    ),
]


@pytest.mark.parametrize(("env", "name", "text"), BAD)
def test_bad_env_values_name_the_variable(tmp_path: Path, env: dict[str, str], name: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(Settings, env=env, state_file=str(tmp_path / "none.json"))
    assert info.value.name == name
    assert name in str(info.value) and text in str(info.value)


def test_bad_state_values_name_the_state_file(tmp_path: Path) -> None:
    state_file = _write_state(tmp_path, {"partitions": "many"})
    with pytest.raises(ConfigError) as info:
        load(Settings, env={}, state_file=state_file)
    assert info.value.name == f"{state_file}:partitions"


def test_unreadable_state_file(tmp_path: Path) -> None:
    bad = tmp_path / "stack.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError) as info:
        load(Settings, env={}, state_file=str(bad))
    assert info.value.name == "state_file"


def test_bad_explicit_value_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(Settings, explicit={"partitions": -1}, env={}, state_file=str(tmp_path / "none.json"))
    assert info.value.name == "partitions"


def test_sasl_settings_accepted(tmp_path: Path) -> None:
    env = {
        "BOLTSTREAM_SECURITY_PROTOCOL": "SASL_SSL",
        "BOLTSTREAM_SASL_MECHANISM": "SCRAM-SHA-512",
        "BOLTSTREAM_SASL_USERNAME": "u",
        "BOLTSTREAM_SASL_PASSWORD": "p",
    }
    settings = load(Settings, env=env, state_file=str(tmp_path / "none.json"))
    assert (settings.sasl_mechanism, settings.sasl_username, settings.sasl_password) == (
        "SCRAM-SHA-512",
        "u",
        "p",
    )


def test_kafka_kwargs_follow_settings() -> None:
    """kafka.py turns Settings into aiokafka arguments; no broker needed to check the mapping."""
    from boltstream.broker.kafka import consumer_kwargs, producer_kwargs

    plain = Settings(bootstrap_servers="127.0.0.1:1234", max_message_bytes=2_000_000)
    prod = producer_kwargs(plain, linger_ms=0)
    assert prod["bootstrap_servers"] == "127.0.0.1:1234"
    assert prod["acks"] == "all" and prod["enable_idempotence"] is False and prod["linger_ms"] == 0
    assert prod["max_request_size"] == 2_000_000 and "ssl_context" not in prod
    cons = consumer_kwargs(plain, "g")
    assert cons["group_id"] == "g" and cons["enable_auto_commit"] is False
    assert cons["rebalance_timeout_ms"] == 6000 and cons["heartbeat_interval_ms"] < cons["session_timeout_ms"]
    assert cons["max_partition_fetch_bytes"] >= 2_000_000

    sasl = Settings(
        security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p"
    )
    kw = producer_kwargs(sasl, enable_idempotence=True)
    assert kw["enable_idempotence"] is True
    assert (kw["sasl_mechanism"], kw["sasl_plain_username"], kw["sasl_plain_password"]) == ("PLAIN", "u", "p")
    assert kw["ssl_context"] is not None


def test_a_variable_under_a_components_prefix_that_names_no_setting_is_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    from boltstream.learner.config import LearnerConfig

    with caplog.at_level("WARNING", logger="boltstream.config"):
        cfg = load(LearnerConfig, env={"BOLTSTREAM_LEARN_TEMPERATURE": "0.7", "BOLTSTREAM_LEARN_CLIP_LOW": "0.1",
                                       "BOLTSTREAM_STREAM_GAMMA": "0.5"}, state_file=os.devnull)
    assert cfg.step.clip_low == 0.1  # a nested setting, found under the parent's prefix
    assert [r.getMessage().split()[0] for r in caplog.records] == ["BOLTSTREAM_LEARN_TEMPERATURE"]
