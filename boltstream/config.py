"""Configuration: one frozen dataclass per process, resolved the same way everywhere.

Precedence, highest first: an explicit argument, a ``BOLTSTREAM_*`` environment
variable, the state file of a running embedded stack, the dataclass default.
The state file sits below env vars so ``eval "$(boltstream stack env)"`` and an
explicit ``BOLTSTREAM_BOOTSTRAP_SERVERS`` both beat whatever stack happens to
be running in the current directory.

Every process config embeds :class:`Settings` (how to reach the broker, the
object store and the schema registry) and adds its own knobs; :func:`load`
resolves every level.

Names are derived, never written twice. A field ``gamma`` of a config whose
``env_prefix`` is ``BOLTSTREAM_STREAM_`` is the variable ``BOLTSTREAM_STREAM_GAMMA``
and the flag ``--gamma`` (:func:`flags_from_dataclass`); a nested config with its
own ``env_prefix`` (:class:`Settings`) keeps it, one without (the stream app's
``CreditConfig``, the learner's ``StepConfig``) contributes its fields under the
parent's prefix. So a default, its help text (:func:`opt`) and its names live in
one place, and ``boltstream train`` passes a setting to a component with
:func:`to_argv`, the inverse of the component's own parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from boltstream.errors import ConfigError

log = logging.getLogger(__name__)

ENV_PREFIX = "BOLTSTREAM_"
DEFAULT_STATE_FILE = ".boltstream/stack.json"
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
# Token payloads compress well (each turn's prompt repeats the previous one, prompt logprobs are zeros):
# zstd level 1 took the stream worker's record batches to 1/5-1/10 of their size at ~400-800 MB/s.
COMPRESSIONS = ("zstd", "lz4", "snappy", "gzip", "none")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")

# Topic short names; the namespace is prefixed at use (docs/architecture.md, "Topics and keys").
TOPICS = ("tasks", "spans", "trajectories", "batches", "checkpoints", "dlq")
# Attempts per task (one GRPO group): the runner starts this many, the stream app waits for them.
DEFAULT_GROUP_SIZE = 4


def opt(default: Any = dataclasses.MISSING, help: str = "", *, default_factory: Any = dataclasses.MISSING,
        cli: bool = True, secret: bool = False, choices: tuple[str, ...] | None = None) -> Any:
    """A config field that carries its help text, so the flag and the docs say what the code means.

    ``cli=False``: neither a flag nor an environment variable (values derived at run time).
    ``secret=True``: no flag (a password in argv is visible to every user of the machine),
    and left out of ``repr()``.
    """
    metadata = {"help": help, "cli": cli, "secret": secret, "choices": choices}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata, repr=not secret)
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


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
        "security_protocol",
        "ssl_cafile",
    )

    bootstrap_servers: str = opt("127.0.0.1:9092", "Kafka bootstrap servers, host:port[,host:port]")
    security_protocol: str = opt("PLAINTEXT", "broker security protocol", choices=SECURITY_PROTOCOLS)
    sasl_mechanism: str | None = opt(None, "SASL mechanism", choices=SASL_MECHANISMS)
    sasl_username: str | None = opt(None, "SASL user name")
    sasl_password: str | None = opt(None, "SASL password", secret=True)
    ssl_cafile: str | None = opt(None, "CA bundle that signs the broker's certificate")
    ssl_certfile: str | None = opt(None, "client certificate (mutual TLS)")
    ssl_keyfile: str | None = opt(None, "client certificate's private key")
    namespace: str = opt("boltstream.", "prefix of every topic name")
    partitions: int = opt(4, "partitions of topics created by boltstream")
    replication_factor: int = opt(1, "replication factor of topics created by boltstream")
    log_retention_ms: int = opt(-1, "retention.ms of the spans and dlq topics at creation (-1: keep forever; replay reads them)")
    log_retention_bytes: int = opt(-1, "retention.bytes per partition of the spans and dlq topics at creation (-1: no size limit)")
    max_message_bytes: int = opt(1_000_000, "largest record produced; larger training batches are split")
    compression: str = opt("zstd", "compression of the record batches boltstream produces (consumers read any)",
                           choices=COMPRESSIONS)
    schema_registry_url: str | None = opt(None, "Confluent-compatible schema registry (none: single-object Avro)")
    s3_endpoint: str = opt("http://127.0.0.1:9000", "S3 / MinIO endpoint for checkpoints")
    s3_bucket: str = opt("boltstream", "bucket for checkpoints")
    s3_access_key: str = opt("boltstream", "S3 access key")
    s3_secret_key: str = opt("boltstream-secret", "S3 secret key", secret=True)
    s3_region: str = opt("us-east-1", "S3 region")
    state_file: str = opt(DEFAULT_STATE_FILE, "state file of a running embedded stack (its addresses)")

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
        if self.compression not in COMPRESSIONS:
            raise ConfigError("compression", self.compression, f"one of {', '.join(COMPRESSIONS)}")
        if self.compression not in ("none", "gzip"):
            from aiokafka import codec

            if not codec.has_zstd():  # the three share one library
                raise ConfigError("compression", self.compression, "needs the cramjam package (pip install cramjam), "
                                  "or use gzip or none")
        if not self.s3_endpoint.startswith(("http://", "https://")):
            raise ConfigError("s3_endpoint", self.s3_endpoint, "must start with http:// or https://")
        if not self.s3_bucket:
            raise ConfigError("s3_bucket", self.s3_bucket, "must not be empty")

    @property
    def compression_type(self) -> str | None:
        """``compression`` as Kafka clients (aiokafka, faust) take it: None for none."""
        return None if self.compression == "none" else self.compression

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
    _warn_unknown(cls, env)
    return _resolve(cls, explicit, env, state, str(state_path))


def _warn_unknown(cls: type, env: Mapping[str, str]) -> None:
    """A variable under a component's own prefix that names no setting is a typo or a removed setting
    (``BOLTSTREAM_LEARN_TEMPERATURE``): say so rather than ignore it. A warning, not an error, because
    the exporter resolves its config inside the user's agent, which telemetry must never stop."""
    prefix = getattr(cls, "env_prefix", ENV_PREFIX)
    if prefix == ENV_PREFIX:
        return
    known = {k.env for k in knobs(cls)}
    for var in sorted(v for v in env if v.startswith(prefix) and v not in known):
        log.warning("%s is not a setting of %s; ignored (see --help for the settings)", var, cls.__name__)


def _resolve(cls: type[C], explicit: Mapping[str, Any], env: Mapping[str, str], state: Mapping[str, Any],
             state_path: str, parent_prefix: str = ENV_PREFIX) -> C:
    hints = typing.get_type_hints(cls)
    prefix = getattr(cls, "env_prefix", parent_prefix)
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
            kwargs[f.name] = nested if nested is not None else _resolve(typ, explicit, env, state, state_path, prefix)
            continue
        var = f"{prefix}{f.name.upper()}"
        if not f.metadata.get("cli", True):
            if f.name in explicit:
                kwargs[f.name] = explicit[f.name]
            continue
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
        secret = {f.name for f in dataclasses.fields(cls) if f.metadata.get("secret")}
        shown = {k: "***" if k in secret and v is not None else v for k, v in kwargs.items()}
        raise ConfigError(cls.__name__, shown, str(exc)) from exc


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


# --------------------------------------------------------------------------- command lines


@dataclasses.dataclass(frozen=True)
class Knob:
    """One leaf setting of a config: its field, its type and the names users set it by."""

    field: dataclasses.Field[Any]
    type: Any
    env: str
    owner: type

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def flag(self) -> str:
        return "--" + self.field.name.replace("_", "-")

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def knobs(cls: type, parent_prefix: str = ENV_PREFIX) -> Iterator[Knob]:
    """Every leaf setting of ``cls``, nested configs included, with its environment variable."""
    hints = typing.get_type_hints(cls)
    prefix = getattr(cls, "env_prefix", parent_prefix)
    nested = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            nested.append(typ)
        elif f.metadata.get("cli", True):
            yield Knob(f, typ, f"{prefix}{f.name.upper()}", cls)
    for typ in nested:  # a component's own settings first, in --help too
        yield from knobs(typ, prefix)


def _is_bool(typ: Any) -> bool:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return bool in typing.get_args(typ)
    return typ is bool


def _choices(knob: Knob) -> tuple[str, ...] | None:
    if knob.field.metadata.get("choices"):
        return tuple(knob.field.metadata["choices"])
    typ = knob.type
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    if typing.get_origin(typ) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(typ))
    return None


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


class _RefuseSecret(argparse.Action):
    """A secret's flag exists only to refuse it with a clear error that does not repeat the value
    (argparse would echo it, or take ``--api-key`` as an abbreviation of ``--api-key-file``)."""

    def __init__(self, *args: Any, env: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env = env

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not accepted on the command line, where every user of the machine "
                     f"can read it: set {self.env} instead")


def flags_from_dataclass(parser: Any, cls: type, *, only: tuple[str, ...] | None = None,
                         settings_title: str = "broker, object store, schema registry") -> None:
    """Add a flag for every setting of ``cls``: ``--field-name`` (``--x/--no-x`` for booleans).

    Flags default to None ("not given") and stay strings: :func:`load` converts them and, on a bad
    value, names the flag's field, exactly as for an environment variable. The help line of each
    flag says its default and its environment variable. Settings of a nested config with its own
    prefix (:class:`Settings`) go into their own help group; secrets get no flag. ``only`` picks
    some settings (``boltstream train`` offers a few of each component's).
    """
    groups: dict[type, Any] = {}
    for knob in knobs(cls):
        if only is not None and knob.name not in only:
            continue
        if knob.field.metadata.get("secret"):
            parser.add_argument(knob.flag, action=_RefuseSecret, env=knob.env, help=argparse.SUPPRESS)
            continue
        owner_prefix = getattr(knob.owner, "env_prefix", None)
        target: Any = parser
        if owner_prefix is not None and owner_prefix != getattr(cls, "env_prefix", None):
            target = groups.get(knob.owner) or groups.setdefault(
                knob.owner, parser.add_argument_group(f"{settings_title} ({owner_prefix}*)"))
        help_ = knob.field.metadata.get("help") or ""
        default = "" if "(default" in help_ else f"default {_show(knob.default)}; "
        help_ = f"{help_} ({default}env {knob.env})".strip()
        if _is_bool(knob.type):
            target.add_argument(knob.flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            target.add_argument(knob.flag, default=None, choices=_choices(knob), help=help_,
                                metavar=None if _choices(knob) else knob.name.upper())


def to_argv(cls: type, values: Mapping[str, Any]) -> list[str]:
    """The command-line flags that make ``cls``'s parser produce ``values`` (None = not given).

    Used by ``boltstream train`` to start a component with a setting, so the component resolves
    it exactly as if a user had typed the flag.
    """
    by_name = {k.name: k for k in knobs(cls)}
    argv: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        knob = by_name.get(name)
        if knob is None:
            raise ConfigError(name, value, f"not a setting of {cls.__name__}")
        if _is_bool(knob.type):
            argv.append(knob.flag if value else "--no-" + knob.flag[2:])
        else:
            argv += [knob.flag, _show(value)]
    return argv
