"""``boltstream serve`` configuration and the optional vLLM engine's import guard."""

from __future__ import annotations

import sys

import pytest

from boltstream.config import load
from boltstream.errors import BoltstreamError, ConfigError
from boltstream.inference.cli import ServeConfig, parser


def _cfg(argv: list[str], env: dict[str, str] | None = None) -> ServeConfig:
    return load(ServeConfig, explicit=vars(parser().parse_args(argv)), env=env or {}, state_file="/nonexistent")


def test_flags_env_and_defaults() -> None:
    cfg = _cfg(["--model", "tiny", "--port", "0", "--no-capture"], env={"BOLTSTREAM_SERVE_MAX_BATCH_SIZE": "4",
                                                                    "BOLTSTREAM_BOOTSTRAP_SERVERS": "h:1"})
    assert (cfg.model, cfg.port, cfg.capture, cfg.reload, cfg.max_batch_size) == ("tiny", 0, False, True, 4)
    assert cfg.settings.bootstrap_servers == "h:1" and cfg.name == "tiny"
    assert _cfg([]).model == "smollm2" and _cfg([]).backend == "transformers"
    assert _cfg(["--model", "/models/SmolLM2-360M.gguf"]).name == "SmolLM2-360M"
    assert _cfg(["--model", "/models/qwen", "--served-model-name", "policy"]).name == "policy"


def test_invalid_config_is_refused() -> None:
    with pytest.raises(ConfigError):
        _cfg(["--port", "70000"])
    with pytest.raises(ConfigError):
        _cfg([], env={"BOLTSTREAM_SERVE_BACKEND": "tensorrt"})


def test_vllm_backend_missing_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from boltstream.inference.vllm_backend import VllmBackend

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(BoltstreamError, match=r"boltstream\[vllm\]"):
        VllmBackend.create(_cfg(["--backend", "vllm", "--model", "tiny"]))


def test_adapters_from_flags_or_env() -> None:
    cfg = _cfg(["--model", "tiny", "--adapters", "writer=sql-writer,checker", "--adapter-agents", "checker=^chk"])
    assert [(a.name, a.checkpoint_model, a.agents.pattern) for a in cfg.adapter_specs] == [
        ("writer", "sql-writer", "^writer$"), ("checker", "checker", "^chk")]
    env = _cfg(["--model", "tiny"], env={"BOLTSTREAM_SERVE_ADAPTERS": "a,b"})
    assert [a.name for a in env.adapter_specs] == ["a", "b"] and _cfg([]).adapter_specs == ()


@pytest.mark.parametrize(("argv", "env", "names"), [
    (["--adapters", "a", "--backend", "vllm"], {}, "transformers backend only"),
    (["--adapters", "a", "--checkpoint-model", "m"], {}, "each adapter names its checkpoint model"),
    (["--adapter-agents", "a=x"], {}, "needs --adapters"),
    ([], {"BOLTSTREAM_SERVE_ADAPTERS": "a,a"}, "named twice"),
])
def test_bad_adapter_configs_are_refused(argv: list[str], env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        _cfg(argv, env)


def test_prefix_cache_budget_flag_env_default_and_refusal() -> None:
    assert _cfg([]).prefix_cache_mib == 256
    assert _cfg(["--prefix-cache-mib", "0"]).prefix_cache_mib == 0
    assert _cfg([], env={"BOLTSTREAM_SERVE_PREFIX_CACHE_MIB": "64"}).prefix_cache_mib == 64
    with pytest.raises(ConfigError, match="prefix_cache_mib"):
        _cfg(["--prefix-cache-mib", "-1"])


def test_rollout_temperature_flag_env_and_refusal() -> None:
    assert _cfg([]).rollout_temperature is None
    assert _cfg(["--rollout-temperature", "1.0"]).rollout_temperature == 1.0
    assert _cfg([], env={"BOLTSTREAM_SERVE_ROLLOUT_TEMPERATURE": "0.9"}).rollout_temperature == 0.9
    for bad in ("0", "-1", "3", "nan"):
        with pytest.raises(ConfigError, match="rollout_temperature.*must be in \\(0, 2\\]"):
            _cfg(["--rollout-temperature", bad])


def test_dtype_flag_env_and_refusal() -> None:
    assert _cfg([]).dtype is None and _cfg(["--dtype", "auto"]).dtype == "auto"
    assert _cfg([], env={"BOLTSTREAM_SERVE_DTYPE": "bfloat16"}).dtype == "bfloat16"
    with pytest.raises(ConfigError, match="BOLTSTREAM_SERVE_DTYPE='bf16': one of auto, float32"):
        _cfg([], env={"BOLTSTREAM_SERVE_DTYPE": "bf16"})
    with pytest.raises(ConfigError, match="dtype"):
        ServeConfig(dtype="bf16")
    with pytest.raises(SystemExit):  # argparse names the choices
        _cfg(["--dtype", "int8"])
