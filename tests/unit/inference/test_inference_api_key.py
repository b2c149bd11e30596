"""The worker's API key: /v1/... refused without it (401, OpenAI's body), health and metrics open."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from boltstream.config import load
from boltstream.errors import ConfigError
from boltstream.inference.auth import bearer_token
from boltstream.inference.cli import ServeConfig, parser
from boltstream.inference.server import create_app

KEY = "sk-test-4f1c9e"


@pytest.fixture
def guarded(backend: Any, sink: Any) -> Iterator[TestClient]:
    app = create_app(backend, sink=sink, served_names=("tiny",), default_max_tokens=4, api_key=KEY)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_a_request_without_the_key_is_refused_the_way_openai_refuses_it(guarded: TestClient, chat: Any,
                                                                         headers: dict[str, str]) -> None:
    for path in ("/v1/chat/completions", "/rollout/r1/r1:0/~/v1/chat/completions"):
        resp = guarded.post(path, json=chat(), headers=headers)
        assert resp.status_code == 401
        assert resp.json() == {"error": {"message": resp.json()["error"]["message"], "type": "invalid_request_error",
                                         "param": None, "code": "invalid_api_key"}}
        assert KEY not in resp.text
    assert guarded.get("/v1/models", headers=headers).status_code == 401


def test_the_key_opens_the_api_and_health_needs_none(guarded: TestClient, chat: Any) -> None:
    assert guarded.post("/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {KEY}"}).status_code \
        == 200
    assert guarded.get("/v1/models", headers={"api-key": KEY}).status_code == 200
    assert guarded.get("/health").status_code == 200
    assert guarded.get("/metrics").status_code == 200


def test_the_openai_sdk_raises_its_authentication_error(guarded: TestClient) -> None:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=guarded, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        client.models.list()
    assert openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=guarded).models.list().data


def test_bearer_token_parsing() -> None:
    assert bearer_token([(b"Authorization", b"Bearer abc ")]) == "abc"
    assert bearer_token([(b"authorization", b"Bearer ")]) is None
    assert bearer_token([]) is None


def resolve(argv: list[str], env: dict[str, str]) -> ServeConfig:
    return load(ServeConfig, vars(parser().parse_args(argv)), env=env, state_file=os.devnull)


def test_the_key_comes_from_env_or_a_file_never_argv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert resolve([], {"BOLTSTREAM_SERVE_API_KEY": KEY}).api_key == KEY
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    assert resolve(["--api-key-file", str(key_file)], {}).api_key == KEY
    with pytest.raises(SystemExit):
        parser().parse_args(["--api-key", KEY])
    err = capsys.readouterr().err
    assert "BOLTSTREAM_SERVE_API_KEY" in err and KEY not in err
    with pytest.raises(ConfigError, match="not both"):
        resolve(["--api-key-file", str(key_file)], {"BOLTSTREAM_SERVE_API_KEY": KEY})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        resolve(["--api-key-file", str(tmp_path / "empty")], {})
    assert KEY not in repr(resolve([], {"BOLTSTREAM_SERVE_API_KEY": KEY}))
