"""Make ``OTEL_TRACES_EXPORTER=boltstream opentelemetry-instrument python agent.py`` start with nothing else set.

Why: ``opentelemetry-distro`` (what OTel's docs tell users to install for
``opentelemetry-instrument``) defaults the metrics and logs exporters to
OTLP/gRPC. That exporter is rarely installed next to an agent, so the SDK
setup raises ``Requested component 'otlp_proto_grpc' not found`` and no span
is ever exported. When boltstream exports the traces, a metrics or logs
exporter that nobody chose defaults to ``none`` instead. A variable that is
set (even to ``otlp``) is never changed.

Two hooks, because ``opentelemetry-instrument`` uses the *first* distro and
the *first* configurator it finds, in an order that depends on the file
system (opentelemetry-python-contrib#551), so a hook that only works when it
wins would work on some machines only:

* ``opentelemetry_environment_variables`` -> :mod:`.otel_launch`: the
  ``opentelemetry-instrument`` launcher imports it before it execs the agent,
  so the defaults are in the agent's environment whichever distro wins;
* ``opentelemetry_distro`` -> :class:`BoltstreamDistro`: the same defaults for
  setups without the launcher (``PYTHONPATH`` set by hand, the Kubernetes
  operator) that pick it, e.g. with ``OTEL_PYTHON_DISTRO=boltstream``. Without
  boltstream in ``OTEL_TRACES_EXPORTER`` it behaves as ``opentelemetry-distro``
  would, so installing boltstream changes nothing for anyone else.

No configurator of our own: the SDK's comes with ``opentelemetry-distro``
(the ``instrument`` extra), and a second one only earns a warning per start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry.environment_variables import (
    OTEL_LOGS_EXPORTER,
    OTEL_METRICS_EXPORTER,
    OTEL_TRACES_EXPORTER,
)
from opentelemetry.instrumentation.distro import BaseDistro

log = logging.getLogger(__name__)

EXPORTER_NAME = "boltstream"  # our entry point in opentelemetry_traces_exporter
_OTHER_SIGNALS = (OTEL_METRICS_EXPORTER, OTEL_LOGS_EXPORTER)


def exports_traces(environ: Mapping[str, str]) -> bool:
    """True when ``OTEL_TRACES_EXPORTER`` names boltstream (alone or in a comma-separated list)."""
    return EXPORTER_NAME in (n.strip() for n in environ.get(OTEL_TRACES_EXPORTER, "").split(","))


def signal_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add: ``none`` for each metrics/logs exporter left unset when boltstream exports traces."""
    if not exports_traces(environ):
        return {}
    return {name: "none" for name in _OTHER_SIGNALS if name not in environ}


def apply_signal_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Write :func:`signal_defaults` into ``environ`` (default ``os.environ``); returns what was added."""
    environ = os.environ if environ is None else environ
    added = signal_defaults(environ)
    environ.update(added)
    if added:
        log.debug("boltstream exports the traces: defaulting %s to none", ", ".join(sorted(added)))
    return added


class BoltstreamDistro(BaseDistro):  # type: ignore[misc]
    """``opentelemetry-distro``'s defaults, except that unset metrics/logs exporters are ``none`` next to boltstream."""

    def _configure(self, **kwargs: Any) -> None:
        apply_signal_defaults()
        try:
            from opentelemetry.distro import OpenTelemetryDistro
        except ImportError:  # no opentelemetry-distro: nothing else to default
            return
        OpenTelemetryDistro().configure(**kwargs)  # setdefault only: what we set above stays

