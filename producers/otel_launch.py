"""Imported by the ``opentelemetry-instrument`` launcher (``opentelemetry_environment_variables`` entry point).

The launcher imports every module of that group to turn its ``OTEL_*``
names into command-line flags, then execs the agent with its environment.
That import is the one moment that comes before any distro or configurator
runs whichever of them wins, so the metrics/logs defaults are written here
(see :mod:`.otel_distro`). This module must define no ``OTEL_*`` name: each
would become a duplicate launcher flag.
"""

from __future__ import annotations

from .otel_distro import apply_signal_defaults

apply_signal_defaults()
