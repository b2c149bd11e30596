"""The ``GET /metrics`` endpoint every long-running boltstream process serves to Prometheus.

One small class so the learner, the stream worker and the runner start, report and stop their
endpoint alike: a registry of the process's own (tests run several components in one process,
which the global default registry would mix), served from prometheus_client's thread on
``--metrics-host:--metrics-port`` (0 picks a free port, read back from :attr:`port`).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


class MetricsServer:
    """A private registry and, once :meth:`serve` is called, the HTTP server that exposes it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.port: int | None = None
        self._server: Any = None

    def serve(self, host: str, port: int) -> int:
        """Start ``/metrics`` on ``host:port`` (0: any free port); returns the bound port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server.server_port)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        """Stop the HTTP server (if one was started); the registry stays readable."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
