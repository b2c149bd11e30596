"""Known secrets set in the environment never show in what boltstream writes: command output, error
messages, the stack's state file and logs. And a broker that requires authentication refuses a
client without credentials (the embedded Tansu with ``--authentication``).

``boltstream stack env`` is the one deliberate exception (it prints the credentials a shell needs)
and is not run here.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from boltstream.broker.kafka import BrokerUnavailableError, wait_for_broker
from boltstream.config import Settings
from boltstream.processes import LOOPBACK, free_port, spawn, terminate
from boltstream.stack.services import broker_bin
from tests.integration.conftest import boltstream_argv

SECRETS = {"BOLTSTREAM_SASL_PASSWORD": "sasl-pw-redact-3c1f", "BOLTSTREAM_S3_SECRET_KEY": "s3-secret-redact-8a2b",
           "BOLTSTREAM_SERVE_API_KEY": "sk-redact-77e0"}
SASL = {"BOLTSTREAM_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "BOLTSTREAM_SASL_MECHANISM": "SCRAM-SHA-512",
        "BOLTSTREAM_SASL_USERNAME": "boltstream"}


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(boltstream_argv(*args), env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def leaks(text: str) -> list[str]:
    return [name for name, secret in SECRETS.items() if secret in text]


def test_no_secret_in_stack_output_state_file_or_logs(settings_env: dict[str, str], tmp_path: Path) -> None:
    env = {**settings_env, **SECRETS}
    state_file = tmp_path / "stack" / "stack.json"
    outputs = []
    try:
        up = run(env, "stack", "up", "--state-file", str(state_file), "--json", "--timeout", "90")
        assert up.returncode == 0, up.stderr
        outputs += [up.stdout, up.stderr, state_file.read_text()]
        for args in (["--json"], []):
            status = run(env, "stack", "status", "--state-file", str(state_file), *args)
            assert status.returncode == 0, status.stderr
            outputs += [status.stdout, status.stderr]
        help_ = run(env, "serve", "--help")
        outputs += [help_.stdout, help_.stderr]
    finally:
        down = run(env, "stack", "down", "--state-file", str(state_file))
        assert down.returncode == 0, down.stderr
    outputs += [p.read_text(errors="replace") for p in state_file.parent.iterdir() if p.is_file()]
    assert len(outputs) >= 9
    assert not leaks("\n".join(outputs))


def test_no_secret_in_the_error_of_a_refused_sasl_connection(settings_env: dict[str, str]) -> None:
    # The test stack's broker does not speak SASL: the command fails and says so, password withheld.
    done = run({**settings_env, **SECRETS, **SASL}, "topics", "list", "--timeout", "60")
    assert done.returncode == 1
    assert "does not accept SASL SCRAM-SHA-512" in done.stderr  # at once, not after 60 s
    assert not leaks(done.stdout + done.stderr)


@pytest.fixture
def authenticating_broker(tmp_path: Path) -> Iterator[str]:
    """A Tansu broker started with ``--authentication``: every client must authenticate."""
    port = free_port()
    url = f"tcp://{LOOPBACK}:{port}"
    proc = spawn("broker (authentication)", [broker_bin(), "broker", "--listener-url", url,
                                             "--advertised-listener-url", url, "--storage-engine", "memory://tansu/",
                                             "--authentication"], tmp_path / "broker.log", {}, die_with_parent=True)
    try:
        yield f"{LOOPBACK}:{port}"
    finally:
        terminate(proc.pid)


def test_a_client_without_credentials_is_refused_by_the_broker(authenticating_broker: str, tmp_path: Path) -> None:
    plain = Settings(bootstrap_servers=authenticating_broker)
    with pytest.raises(BrokerUnavailableError, match="did not answer"):
        asyncio.run(wait_for_broker(plain, timeout=3))
    assert "NotAuthenticated" in (tmp_path / "broker.log").read_text()
    # With credentials the client gets further (SCRAM), and is refused for the user, not the protocol:
    # Tansu 0.6's memory/S3 storage keeps no SCRAM users, so no user can exist (docs/operations.md).
    with_sasl = Settings(bootstrap_servers=authenticating_broker, security_protocol="SASL_PLAINTEXT",
                         sasl_mechanism="SCRAM-SHA-512", sasl_username="boltstream",
                         sasl_password=SECRETS["BOLTSTREAM_SASL_PASSWORD"])
    with pytest.raises(BrokerUnavailableError, match="refused SCRAM authentication: unknown-user") as refused:
        asyncio.run(wait_for_broker(with_sasl, timeout=30))  # refused at once, not at the deadline
    assert not leaks(str(refused.value) + (tmp_path / "broker.log").read_text())
