"""The embedded stack: a real Kafka-protocol broker (Tansu) and a real S3 endpoint (moto), no Docker.

- :mod:`~boltstream.stack.lifecycle`: start, status, crash-test and stop the pair;
- :mod:`~boltstream.stack.services`: each service's process, and waiting until it answers;
- :mod:`~boltstream.stack.state`: the state file other processes find the stack through;
- :mod:`~boltstream.stack.tls`: a self-signed certificate and a TLS-terminating front for the broker (``--secure``);
- :mod:`~boltstream.stack.cli`: ``boltstream stack up|down|status|env``.

Processes are started and stopped by :mod:`boltstream.processes`.
"""

from boltstream.stack.lifecycle import (
    embedded_stack,
    kill_broker,
    restart_broker,
    stack_status,
    start_stack,
    stop_stack,
)
from boltstream.stack.services import run_sync
from boltstream.stack.state import (
    CREDENTIALS_ENV,
    resolve_state_file,
    settings_env,
    settings_from_state,
    state_pids,
)

__all__ = [
    "CREDENTIALS_ENV",
    "embedded_stack",
    "kill_broker",
    "resolve_state_file",
    "restart_broker",
    "run_sync",
    "settings_env",
    "settings_from_state",
    "stack_status",
    "start_stack",
    "state_pids",
    "stop_stack",
]
