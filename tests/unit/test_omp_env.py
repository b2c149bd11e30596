"""Which OpenMP settings each ``boltstream`` command starts with (read by the runtime when torch loads)."""

from __future__ import annotations

import pytest

from boltstream.cli import SERVE_SPINCOUNT, omp_env


def test_only_the_transformers_worker_spins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BOLTSTREAM_SERVE_BACKEND", raising=False)
    assert omp_env("learn", ["--model", "smollm2"]) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert omp_env("serve", ["--model", "tiny"]) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": SERVE_SPINCOUNT}
    assert "GOMP_SPINCOUNT" not in omp_env("serve", ["--backend", "vllm"])
    assert "GOMP_SPINCOUNT" not in omp_env("serve", ["--port", "0", "--backend=vllm"])
    monkeypatch.setenv("BOLTSTREAM_SERVE_BACKEND", "vllm")
    assert "GOMP_SPINCOUNT" not in omp_env("serve", [])
    assert "GOMP_SPINCOUNT" in omp_env("serve", ["--backend", "transformers"])  # the flag beats the env
