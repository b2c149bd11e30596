"""The secure embedded stack's certificate, and how its settings reach every process."""

from __future__ import annotations

import dataclasses
import os
import ssl
import stat
from pathlib import Path

from boltstream.config import Settings, load
from boltstream.stack import settings_env, settings_from_state
from boltstream.stack.tls import write_self_signed


def test_the_certificate_verifies_for_loopback_and_its_key_is_private(tmp_path: Path) -> None:
    cert, key = write_self_signed(tmp_path / "tls")
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)  # the pair matches
    client = ssl.create_default_context(cafile=str(cert))
    assert client.check_hostname and client.verify_mode == ssl.CERT_REQUIRED
    # the SAN names 127.0.0.1 and localhost, the addresses the stack advertises
    decoded = ssl._ssl._test_decode_cert(str(cert))  # type: ignore[attr-defined]
    assert ("IP Address", "127.0.0.1") in decoded["subjectAltName"]
    assert ("DNS", "localhost") in decoded["subjectAltName"]


def test_a_secure_state_reaches_processes_by_state_file_and_by_env(tmp_path: Path) -> None:
    state = {"bootstrap_servers": "127.0.0.1:1234", "security_protocol": "SSL", "ssl_cafile": "/ca.pem",
             "s3_endpoint": "http://127.0.0.1:9", "namespace": "x.", "partitions": 2}
    settings = settings_from_state(state)
    assert (settings.security_protocol, settings.ssl_cafile) == ("SSL", "/ca.pem")
    env = settings_env(settings)
    assert env["BOLTSTREAM_SECURITY_PROTOCOL"] == "SSL" and env["BOLTSTREAM_SSL_CAFILE"] == "/ca.pem"
    assert dataclasses.replace(load(Settings, env=env, state_file=os.devnull), state_file=settings.state_file) == settings
    # a plaintext stack exports no CA line
    assert "BOLTSTREAM_SSL_CAFILE" not in settings_env(settings_from_state({**state, "security_protocol": "PLAINTEXT",
                                                                              "ssl_cafile": None}))
