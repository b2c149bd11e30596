"""``boltstream serve`` with BOLTSTREAM_SERVE_API_KEY on the real stack: refuses requests without the key,
serves (and captures) those with it, and never writes the key (or the S3 secret) to its log."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from boltstream.inference.launch import WorkerProcess
from tests.integration.inference.conftest import START_TIMEOUT

KEY = "sk-worker-key-5e0a1d"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_the_worker_refuses_a_request_without_the_api_key(settings_env: dict[str, str], tmp_path: Path) -> None:
    env = {**settings_env, "BOLTSTREAM_SERVE_API_KEY": KEY}
    log_path = tmp_path / "worker.log"
    worker = WorkerProcess(["--model", "tiny", "--port", "0", "--max-context", "1024", "--log-level", "debug"],
                           env=env, log_path=log_path)
    worker.start(START_TIMEOUT)
    with worker:
        for key in ("unused", KEY[:-1]):
            client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key=key, max_retries=0, timeout=30)
            with pytest.raises(openai.AuthenticationError) as refused:
                client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
            assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key=KEY, max_retries=0, timeout=60,
                               default_headers={"X-Boltstream-Capture": "off"})
        assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4).choices
    log = log_path.read_text()
    assert "refused POST /v1/chat/completions" in log  # the log was written, at debug level
    assert KEY not in log and KEY[:-1] not in log
    assert settings_env["BOLTSTREAM_S3_SECRET_KEY"] not in log
