"""Configuration: one frozen dataclass per process, resolved the same way everywhere.

Precedence, highest first: an explicit argument, a ``BOLTSTREAM_*`` environment
variable, the state file of a running embedded stack, the dataclass default.
The state file sits below env vars so ``eval "$(boltstream stack env)"`` and an
explicit ``BOLTSTREAM_BOOTSTRAP_SERVERS`` both beat whatever stack happens to
be running in the current directory.

Every process config embeds :class:`Settings` (how to reach the broker, the
object store and the schema registry) and adds its own knobs; :func:`load`
resolves both levels.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from boltstream.errors import ConfigError

log = logging.getLogger(__name__)

ENV_PREFIX = "BOLTSTREAM_"
DEFAULT_STATE_FILE = ".boltstream/stack.json"
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")

# Topic short names; the namespace is prefixed at use (design.md, "Topics").
TOPICS = ("tasks", "spans", "trajectories", "batches", "checkpoints", "dlq")


@dataclasses.dataclass(frozen=True)
class Settings:
    """How every process reaches the log, the object store and the schema registry."""

    env_prefix: ClassVar[str] = ENV_PREFIX
    # Fields the embedded stack's state file may supply.
    from_state: ClassVar[tuple[str, ...]] = (
        "bootstrap_servers",
        "s3_endpoint",
        "s3_bucket",
        "s3_access_key",
        "s3_secret_key",
        "s3_region",
        "namespace",
        "partitions",
    )

    bootstrap_servers: str = "127.0.0.1:9092"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    namespace: str = "boltstream."
    partitions: int = 4
    replication_factor: int = 1
    max_message_bytes: int = 1_000_000
    schema_registry_url: str | None = None
    s3_endpoint: str = "http://127.0.0.1:9000"
    s3_bucket: str = "boltstream"
    s3_access_key: str = "boltstream"
    s3_secret_key: str = "boltstream-secret"
    s3_region: str = "us-east-1"
    state_file: str = DEFAULT_STATE_FILE

    def __post_init__(self) -> None:
        if not self.bootstrap_servers.strip():
            raise ConfigError("bootstrap_servers", self.bootstrap_servers, "must name at least one host:port")
        for hostport in self.bootstrap_servers.split(","):
            host, _, port = hostport.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError("bootstrap_servers", self.bootstrap_servers, "expected host:port[,host:port]")
        if self.security_protocol not in SECURITY_PROTOCOLS:
            raise ConfigError("security_protocol", self.security_protocol, f"one of {', '.join(SECURITY_PROTOCOLS)}")
        if self.security_protocol.startswith("SASL"):
            if self.sasl_mechanism not in SASL_MECHANISMS:
                raise ConfigError("sasl_mechanism", self.sasl_mechanism, f"one of {', '.join(SASL_MECHANISMS)}")
            if not self.sasl_username or self.sasl_password is None:
                raise ConfigError("sasl_username", self.sasl_username, "SASL needs a username and a password")
        if self.partitions < 1:
            raise ConfigError("partitions", self.partitions, "must be >= 1")
        if self.replication_factor < 1:
            raise ConfigError("replication_factor", self.replication_factor, "must be >= 1")
        if self.max_message_bytes < 1024:
            raise ConfigError("max_message_bytes", self.max_message_bytes, "must be >= 1024")
        if not self.s3_endpoint.startswith(("http://", "https://")):
            raise ConfigError("s3_endpoint", self.s3_endpoint, "must start with http:// or https://")
        if not self.s3_bucket:
            raise ConfigError("s3_bucket", self.s3_bucket, "must not be empty")

    def topic(self, name: str) -> str:
        """Full topic name for a short name such as ``spans``."""
        return f"{self.namespace}{name}"

    @property
    def s3_secure(self) -> bool:
        return self.s3_endpoint.startswith("https://")

    @property
    def s3_host(self) -> str:
        """host:port form the minio SDK wants."""
        return self.s3_endpoint.split("://", 1)[1].rstrip("/")


C = TypeVar("C")


def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The running embedded stack's state, or {} when there is none."""
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        state = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("state_file", str(p), f"unreadable stack state: {exc}") from exc
    if not isinstance(state, dict):
        raise ConfigError("state_file", str(p), "stack state must be a JSON object")
    return state


def load(
    cls: type[C],
    explicit: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    state_file: str | None = None,
) -> C:
    """Resolve ``cls`` (a frozen dataclass) by explicit > env > stack state > default.

    Explicit values that are ``None`` count as "not given", so CLI flags can be
    passed straight through. A nested ``settings: Settings`` field is resolved
    with the same explicit mapping (keys of either level may appear in it).
    """
    explicit = {k: v for k, v in (explicit or {}).items() if v is not None}
    env = os.environ if env is None else env
    state_path = (
        state_file
        or explicit.get("state_file")
        or env.get(f"{ENV_PREFIX}STATE_FILE")
        or DEFAULT_STATE_FILE
    )
    state = read_state(state_path)
    return _resolve(cls, explicit, env, state, str(state_path))


def _resolve(cls: type[C], explicit: Mapping[str, Any], env: Mapping[str, str], state: Mapping[str, Any], state_path: str) -> C:
    hints = typing.get_type_hints(cls)
    prefix = getattr(cls, "env_prefix", ENV_PREFIX)
    from_state = getattr(cls, "from_state", ())
    kwargs: dict[str, Any] = {}
    # Where each field's value came from, so a validation error names what the user must change
    # (the env var, the state file entry, or the explicit argument) rather than the field.
    sources: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            nested = explicit.get(f.name)
            kwargs[f.name] = nested if nested is not None else _resolve(typ, explicit, env, state, state_path)
            continue
        var = f"{prefix}{f.name.upper()}"
        sources[f.name] = var  # a default that fails validation is fixed by setting the env var
        if f.name in explicit:
            sources[f.name] = f.name
            kwargs[f.name] = _coerce(f.name, explicit[f.name], typ, f.name)
        elif var in env:
            kwargs[f.name] = _coerce(f.name, env[var], typ, var)
        elif f.name == "state_file":
            kwargs[f.name] = state_path
        elif f.name in from_state and f.name in state:
            sources[f.name] = f"{state_path}:{f.name}"
            kwargs[f.name] = _coerce(f.name, state[f.name], typ, sources[f.name])
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        source = sources.get(exc.name)
        if source is None or source == exc.name:
            raise
        raise ConfigError(source, exc.value, exc.reason) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(cls.__name__, kwargs, str(exc)) from exc


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, value: Any, typ: Any, source: str) -> Any:
    """Convert an env/state/explicit value to the field's type, naming the source on failure."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
            return None
        typ = non_none[0]
        origin, args = typing.get_origin(typ), typing.get_args(typ)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in _TRUE:
                return True
            if s in _FALSE:
                return False
            raise ValueError("expected true/false")
        if typ is int:
            if isinstance(value, bool):
                raise ValueError("expected an integer")
            return int(str(value).strip().replace("_", "")) if isinstance(value, str) else int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return str(value)
        if origin is tuple:
            items = value if isinstance(value, list | tuple) else [v for v in str(value).split(",") if v.strip()]
            return tuple(_coerce(name, v.strip() if isinstance(v, str) else v, args[0], source) for v in items)
    except (TypeError, ValueError) as exc:
        raise ConfigError(source, value, f"invalid value for {name}: {exc}") from exc
    return value
