"""Checks a docker compose file against the code, without a Docker engine.

No engine runs where boltstream is tested, and a compose file nothing reads drifts: a renamed flag,
a removed setting or a topic created without its retention only shows on a user's first
``docker compose up``. So the file is read as data and held against what the code declares: the
settings of each component's config dataclass (:func:`boltstream.config.knobs`), the sub-commands
and flags of each command's own ``parser()``, the topics and their configs
(:mod:`boltstream.broker.topics`), and the rules compose itself enforces at start (dependency order,
healthchecks, host ports), the files its bind mounts name, and the Prometheus scrape config
against the metrics port each component serves (:func:`_check_scrape`).
``python -m boltstream.compose_check infra/docker-compose.yml [overlay.yml ...]`` prints every
problem and exits 1 if there is one.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from boltstream import config
from boltstream.cli import COMMANDS
from boltstream.errors import BoltstreamError

# The config dataclass each command resolves, whose knobs are the BOLTSTREAM_* variables it reads.
COMMAND_CONFIGS: Mapping[str, str] = {
    "topics": "boltstream.config:Settings",
    "tasks": "boltstream.config:Settings",
    "runner": "boltstream.producers.runner:RunnerConfig",
    "ingest": "boltstream.producers.otlp_ingest:IngestConfig",
    "serve": "boltstream.inference.cli:ServeConfig",
    "stream": "boltstream.streams.config:StreamConfig",
    "learn": "boltstream.learner.config:LearnerConfig",
}
ONE_SHOT = "service_completed_successfully"
# The config field holding the port of a command's /metrics (and the address field beside it).
METRICS_FIELDS: Mapping[str, tuple[str, str]] = {
    "runner": ("metrics_port", "metrics_host"),
    "stream": ("metrics_port", "metrics_host"),
    "learn": ("metrics_port", "metrics_host"),
    "serve": ("port", "host"),  # the inference worker serves /metrics on its API port
}
# Top-level key load_compose adds: the folder relative bind mounts resolve against (compose's project
# directory is the first file's folder). An ``x-`` key, which compose itself ignores.
COMPOSE_DIR = "x-compose-dir"
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``${VAR}`` / ``${VAR:-default}`` as compose substitutes them (env first, then the default)."""
    return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


def variables(text: str) -> set[str]:
    """Names of the variables a compose file interpolates."""
    return {m.group(1) for m in _VAR.finditer(text)}


def _merge(base: Any, over: Any) -> Any:
    """Compose's overlay rule for what we use: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {k: _merge(base[k], v) if k in base else v for k, v in {**base, **over}.items()}
    return over


def load_compose(paths: Iterable[str | Path], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose model of ``paths`` (first the base file, then overlays), variables substituted."""
    model: dict[str, Any] = {}
    paths = list(paths)
    for path in paths:
        model = _merge(model, yaml.safe_load(interpolate(Path(path).read_text(), env or {})) or {})
    if paths:
        model[COMPOSE_DIR] = str(Path(paths[0]).resolve().parent)
    # YAML aliases (`environment: *boltstream-env`) share one object; each service gets its own copy.
    return json.loads(json.dumps(model))


def command_lines(spec: Mapping[str, Any]) -> list[list[str]]:
    """The commands a service runs: its ``command``, or each ``&&``-joined part of ``sh -c "..."``."""
    command = spec.get("command")
    if command is None:
        return []
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if argv[:2] in (["sh", "-c"], ["bash", "-c"]) and len(argv) == 3:
        return [shlex.split(part) for part in re.split(r"&&|;", argv[2]) if part.strip()]
    return [argv]


def _environment(spec: Mapping[str, Any]) -> dict[str, str]:
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _class(ref: str) -> type:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def check_command(argv: list[str]) -> str | None:
    """Why ``argv`` would fail before doing anything (unknown command, sub-command or flag), or None."""
    if argv[:2] == ["python", "-m"] and len(argv) > 2:
        return None if importlib.util.find_spec(argv[2]) else f"no module {argv[2]!r}"
    if not argv or argv[0] != "boltstream":
        return None  # not ours to check
    if len(argv) < 2 or argv[1] not in COMMANDS:
        return f"unknown boltstream command {argv[1:2]} (known: {', '.join(COMMANDS)})"
    module = importlib.import_module(COMMANDS[argv[1]][0])
    if not hasattr(module, "parser"):
        return f"boltstream {argv[1]} has no parser() to check its flags against"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            module.parser().parse_args(argv[2:])
    except SystemExit:
        last = err.getvalue().strip().splitlines()
        return f"'{shlex.join(argv)}' is refused by its parser: {last[-1] if last else 'exit'}"
    return None


def _resolve(argv: list[str], env: Mapping[str, str]) -> Any:
    """The config a ``boltstream`` command line resolves with ``env`` (None: not one of ours, or refused)."""
    if argv[:1] != ["boltstream"] or len(argv) < 2 or argv[1] not in COMMAND_CONFIGS:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = vars(importlib.import_module(COMMANDS[argv[1]][0]).parser().parse_args(argv[2:]))
        return config.load(_class(COMMAND_CONFIGS[argv[1]]), args, env=env, state_file=os.devnull)
    except (SystemExit, BoltstreamError):
        return None  # check_command / _check_env report it


def metrics_endpoints(spec: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(port, bind address) of every /metrics a service's commands serve."""
    out = []
    env = _environment(spec)
    for argv in command_lines(spec):
        resolved = _resolve(argv, env)
        fields = METRICS_FIELDS.get(argv[1]) if resolved is not None else None
        if fields and getattr(resolved, fields[0], None) is not None:
            out.append((int(getattr(resolved, fields[0])), str(getattr(resolved, fields[1]))))
    return out


def _volume_parts(volume: Any) -> tuple[str, str]:
    """(source, target) of a service's volume, short (``src:dst[:ro]``) or long syntax."""
    if isinstance(volume, dict):
        return str(volume.get("source") or ""), str(volume.get("target") or "")
    parts = str(volume).split(":")
    return (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])


def _is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def _check_volumes(model: Mapping[str, Any]) -> list[str]:
    """Bind-mounted files exist in the repository; named volumes are declared."""
    services: Mapping[str, Any] = model.get("services") or {}
    declared = set(model.get("volumes") or {})
    base = model.get(COMPOSE_DIR)
    problems = []
    for name, spec in services.items():
        for volume in spec.get("volumes") or []:
            source, _ = _volume_parts(volume)
            if not source:
                continue
            if _is_bind(source):
                if base is not None and source.startswith(".") and not (Path(base) / source).exists():
                    problems.append(f"{name}: mounts {source}, which does not exist next to the compose file")
            elif source not in declared:
                problems.append(f"{name}: uses volume {source!r}, which the top-level volumes do not declare")
    return problems


def scrape_targets(prometheus_config: Mapping[str, Any]) -> list[tuple[str, str, int, str]]:
    """(job, host, port, metrics path) of every target of a Prometheus config (static and DNS)."""
    out = []
    for job in prometheus_config.get("scrape_configs") or []:
        name, path = str(job.get("job_name")), str(job.get("metrics_path") or "/metrics")
        for static in job.get("static_configs") or []:
            for target in static.get("targets") or []:
                host, _, port = str(target).rpartition(":")
                out.append((name, host, int(port) if port.isdigit() else -1, path))
        for dns in job.get("dns_sd_configs") or []:
            out += [(name, str(host), int(dns.get("port", -1)), path) for host in dns.get("names") or []]
    return out


def prometheus_config_file(model: Mapping[str, Any]) -> tuple[str, Path] | None:
    """(service, file in the repository) of the Prometheus scrape config the compose file mounts."""
    base = model.get(COMPOSE_DIR)
    for name, spec in (model.get("services") or {}).items():
        for volume in spec.get("volumes") or []:
            source, target = _volume_parts(volume)
            if target == PROMETHEUS_CONFIG and _is_bind(source) and base is not None:
                return name, Path(base) / source
    return None


def _check_scrape(model: Mapping[str, Any]) -> list[str]:
    """Every component's /metrics is scraped, on the port and address it serves, and nothing else is."""
    services: Mapping[str, Any] = model.get("services") or {}
    served = {name: metrics_endpoints(spec) for name, spec in services.items()}
    served = {name: ends for name, ends in served.items() if ends}
    found = prometheus_config_file(model)
    if found is None:
        return [f"no prometheus service mounts a scrape config at {PROMETHEUS_CONFIG}, but {sorted(served)} "
                "serve /metrics"] if served else []
    prom, path = found
    if not path.is_file():
        return []  # _check_volumes reports it
    try:
        targets = scrape_targets(yaml.safe_load(path.read_text()) or {})
    except (yaml.YAMLError, AttributeError, ValueError) as exc:
        return [f"{prom}: {path.name} is not a Prometheus config: {exc}"]
    problems = []
    scraped = set()
    for job, host, port, metrics_path in targets:
        if host not in services:
            problems.append(f"{prom}: job {job} scrapes {host}:{port}, and {host} is not a service")
            continue
        scraped.add(host)
        ends = served.get(host, [])
        ports = {p for p, _ in ends}
        if not ends:
            problems.append(f"{prom}: job {job} scrapes {host}:{port}, but {host} serves no /metrics "
                            "(no metrics port set)")
        elif port not in ports:
            problems.append(f"{prom}: job {job} scrapes {host}:{port}, but {host} serves /metrics on "
                            f"{sorted(ports)}")
        elif any(p == port and bind in LOOPBACK for p, bind in ends):
            problems.append(f"{prom}: job {job} scrapes {host}:{port}, but {host} binds it to loopback only "
                            "(set its metrics host to 0.0.0.0)")
        if metrics_path != "/metrics":
            problems.append(f"{prom}: job {job} scrapes {metrics_path}; boltstream serves /metrics")
    for name in sorted(set(served) - scraped):
        problems.append(f"{name}: serves /metrics on {[p for p, _ in served[name]]}, but no job of {prom} "
                        "scrapes it")
    return problems


def _check_env(name: str, spec: Mapping[str, Any], lines: list[list[str]]) -> list[str]:
    """Each BOLTSTREAM_* variable is a setting of the command that runs, with a value it accepts."""
    env = _environment(spec)
    ours = {k for k in env if k.startswith(config.ENV_PREFIX)}
    known: set[str] = set()
    problems = []
    for argv in lines:
        if argv[:1] != ["boltstream"] or len(argv) < 2 or argv[1] not in COMMAND_CONFIGS:
            continue
        cls = _class(COMMAND_CONFIGS[argv[1]])
        known |= {k.env for k in config.knobs(cls)}
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                args = vars(importlib.import_module(COMMANDS[argv[1]][0]).parser().parse_args(argv[2:]))
        except SystemExit:
            continue  # check_command reports it
        try:
            config.load(cls, args, env=env, state_file=os.devnull)
        except BoltstreamError as exc:
            problems.append(f"{name}: its environment is refused by boltstream {argv[1]}: {exc}")
    unknown = sorted(ours - known)
    if unknown:
        problems.append(f"{name}: sets {unknown}, which no setting of its command reads")
    return problems


def _check_topics(services: Mapping[str, Any], lines: Mapping[str, list[list[str]]]) -> list[str]:
    from boltstream.broker.topics import TOPIC_CONFIGS

    inits = [n for n, ls in lines.items() if any(a[:3] == ["boltstream", "topics", "create"] for a in ls)]
    if not inits:
        return ["no service runs 'boltstream topics create': topics would be auto-created without "
                f"their partitions and configs {dict(TOPIC_CONFIGS)}"]
    problems = []
    init = inits[0]
    argv = next(a for a in lines[init] if a[:3] == ["boltstream", "topics", "create"])
    named = [a for a in argv[3:] if not a.startswith("-") and a in config.TOPICS]
    if named and set(named) != set(config.TOPICS):
        problems.append(f"{init}: creates only {named}; the code needs {list(config.TOPICS)}")
    init_env = _environment(services[init])
    for key in ("BOLTSTREAM_PARTITIONS", "BOLTSTREAM_NAMESPACE", "BOLTSTREAM_BOOTSTRAP_SERVERS"):
        for name, spec in services.items():
            value = _environment(spec).get(key)
            if name != init and value is not None and value != init_env.get(key):
                problems.append(f"{name}: {key}={value!r} differs from the topic init service's "
                                f"{init_env.get(key)!r}")
    partitions = init_env.get("BOLTSTREAM_PARTITIONS")
    if partitions is not None and (not partitions.isdigit() or int(partitions) < 1):
        problems.append(f"{init}: BOLTSTREAM_PARTITIONS={partitions!r} is not a partition count >= 1")
    for name, ls in lines.items():
        uses_broker = any(a[:1] == ["boltstream"] and a[1:2] != ["topics"] for a in ls)
        depends = services[name].get("depends_on") or {}
        if uses_broker and (not isinstance(depends, dict) or depends.get(init, {}).get("condition") != ONE_SHOT):
            problems.append(f"{name}: does not wait for {init} ({ONE_SHOT}); it could start before "
                            "the topics exist")
    return problems


def _check_images(services: Mapping[str, Any]) -> list[str]:
    problems = []
    for name, spec in services.items():
        refs = [spec["image"]] if spec.get("image") else []
        build = spec.get("build")
        if isinstance(build, dict):
            refs += [v for k, v in (build.get("args") or {}).items() if k.endswith("IMAGE")]
        elif not refs:
            problems.append(f"{name}: neither an image nor a build")
        for ref in refs:
            last = str(ref).rsplit("/", 1)[-1]
            tag = last.split(":", 1)[1] if ":" in last else ""
            if "@sha256:" not in str(ref) and tag in ("", "latest"):
                problems.append(f"{name}: image {ref!r} is not pinned to a tag")
    return problems


def _host_port(mapping: Any) -> str | None:
    if isinstance(mapping, dict):
        return str(mapping.get("published")) if mapping.get("published") else None
    parts = str(mapping).split("/")[0].split(":")
    return ":".join(parts[:-1]) if len(parts) > 1 else None


def _check_ports(services: Mapping[str, Any]) -> list[str]:
    owner: dict[str, str] = {}
    problems = []
    for name, spec in services.items():
        for mapping in spec.get("ports") or []:
            host = _host_port(mapping)
            if host is None:
                continue
            if host in owner:
                problems.append(f"{name}: host port {host} is already published by {owner[host]}")
            owner[host] = name
    return problems


def _check_order(services: Mapping[str, Any]) -> list[str]:
    problems = []
    graph: dict[str, list[str]] = {}
    for name, spec in services.items():
        depends = spec.get("depends_on") or {}
        deps = {d: {} for d in depends} if isinstance(depends, list) else depends
        graph[name] = list(deps)
        for dep, cond in deps.items():
            condition = (cond or {}).get("condition", "service_started")
            if dep not in services:
                problems.append(f"{name}: depends on {dep!r}, which is not a service")
            elif condition == "service_healthy" and not services[dep].get("healthcheck"):
                problems.append(f"{name}: waits for {dep} to be healthy, but {dep} has no healthcheck")
            elif condition == ONE_SHOT and services[dep].get("restart") in ("always", "unless-stopped"):
                problems.append(f"{name}: waits for {dep} to complete, but {dep} restarts forever")
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 2 or node not in graph:
            return
        if state.get(node) == 1:
            problems.append(f"depends_on cycle: {' -> '.join([*path[path.index(node):], node])}")
            return
        state[node] = 1
        for dep in graph[node]:
            visit(dep, [*path, node])
        state[node] = 2

    for node in graph:
        visit(node, [])
    return problems


def check_compose(model: Mapping[str, Any]) -> list[str]:
    """Every problem of a compose model (see :func:`load_compose`), as sentences naming the service."""
    services: Mapping[str, Any] = model.get("services") or {}
    if not services:
        return ["no services"]
    lines = {name: command_lines(spec) for name, spec in services.items()}
    problems = []
    for name, ls in lines.items():
        problems += [f"{name}: {why}" for argv in ls if (why := check_command(argv))]
        problems += _check_env(name, services[name], ls)
    return problems + _check_topics(services, lines) + _check_images(services) + _check_ports(services) \
        + _check_order(services) + _check_volumes(model) + _check_scrape(model)


def check_env_example(compose_texts: Iterable[str], env_example: str) -> list[str]:
    """Variables the compose files interpolate that ``.env.example`` does not list, and the reverse."""
    used = set().union(*(variables(t) for t in compose_texts))
    listed = {line.split("=", 1)[0].strip() for line in env_example.splitlines()
              if "=" in line and not line.lstrip().startswith("#")}
    problems = [f".env.example does not list {v}" for v in sorted(used - listed)]
    return problems + [f".env.example lists {v}, which no compose file uses" for v in sorted(listed - used)]


def main(argv: list[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv) or ["infra/docker-compose.yml"]
    problems = check_compose(load_compose(paths))
    for problem in problems:
        sys.stderr.write(f"{problem}\n")
    sys.stdout.write(f"{len(problems)} problem(s) in {', '.join(paths)}\n")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
