"""``boltstream stack up|down|status|env``: the embedded stack from a shell.

Kept apart from the stack's library modules so they have no argparse/rich
output concerns and tests can drive the same code without a subprocess.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from boltstream import stack
from boltstream.config import DEFAULT_STATE_FILE
from boltstream.errors import StackError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream stack", description="The embedded broker + S3 stack.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-file",
        help=f"state file (env BOLTSTREAM_STATE_FILE, default {DEFAULT_STATE_FILE})",
    )
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", parents=[common], help="start the stack (or report the running one)")
    up.add_argument(
        "--durable", action="store_true", help="keep the broker's log in S3 (survives a broker crash)"
    )
    up.add_argument(
        "--secure", action="store_true",
        help="clients reach the broker over TLS only (generated self-signed certificate, see 'stack env')",
    )
    up.add_argument("--partitions", type=int, help="partitions per topic (default 4)")
    up.add_argument("--namespace", help="topic name prefix (default 'boltstream.')")
    up.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for both services")
    up.add_argument("--json", action="store_true", help="print the state as JSON")
    sub.add_parser("down", parents=[common], help="stop exactly the processes 'up' started")
    st = sub.add_parser("status", parents=[common], help="addresses, pids and liveness")
    st.add_argument("--json", action="store_true", help="one JSON object")
    sub.add_parser("env", parents=[common], help='export lines: eval "$(boltstream stack env)"')
    return p


def _public(status: dict[str, Any]) -> dict[str, Any]:
    """Status without the secret key (``stack env`` prints credentials for those who need them)."""
    return {k: v for k, v in status.items() if k != "s3_secret_key"}


def _print_table(status: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"boltstream embedded stack ({'running' if status['running'] else 'NOT running'})")
    table.add_column("", overflow="fold")
    table.add_column("", overflow="fold")
    alive = status.get("alive", {})
    pids = status.get("pids", {})
    logs = status.get("logs", {})
    mode = f"durable ({status.get('broker_storage')})" if status.get("durable") else "memory"
    rows = [
        ("kafka bootstrap", status.get("bootstrap_servers", "")),
        ("kafka security", f"{status.get('security_protocol', 'PLAINTEXT')}"
                           + (f", CA {status['ssl_cafile']}" if status.get("ssl_cafile") else "")),
        ("broker", f"pid {pids.get('broker')} {'alive' if alive.get('broker') else 'DEAD'}, {mode}"),
        ("s3 endpoint", status.get("s3_endpoint", "")),
        ("s3", f"pid {pids.get('s3')} {'alive' if alive.get('s3') else 'DEAD'}"),
        ("s3 bucket", status.get("s3_bucket", "")),
        ("credentials", ", ".join(status.get("credentials_env", {}).values())),
        ("namespace", status.get("namespace", "")),
        ("partitions", str(status.get("partitions", ""))),
        ("started at", status.get("started_at", "")),
        ("logs", "\n".join(logs.values())),
        ("state file", status.get("state_file", "")),
    ]
    for key, value in rows:
        table.add_row(key, str(value))
    Console().print(table)


def main(argv: list[str]) -> int:
    """Entry point used by :mod:`boltstream.cli`."""
    args = parser().parse_args(argv)
    if args.action == "up":
        state = stack.start_stack(
            args.state_file,
            durable=args.durable,
            secure=args.secure,
            partitions=args.partitions,
            namespace=args.namespace,
            timeout=args.timeout,
        )
        status = stack.stack_status(state["state_file"])
        status["already_running"] = bool(state.get("already_running"))
        if args.json:
            sys.stdout.write(json.dumps(_public(status), sort_keys=True) + "\n")
        else:
            verb = "already running" if status["already_running"] else "started"
            sys.stdout.write(
                f"embedded stack {verb}: kafka {status['bootstrap_servers']}, s3 {status['s3_endpoint']}\n"
                f'point a shell at it: eval "$(boltstream stack env'
                f'{" --state-file " + shlex.quote(args.state_file) if args.state_file else ""})"\n'
            )
        return 0
    if args.action == "down":
        stopped = stack.stop_stack(args.state_file)
        sys.stdout.write("embedded stack stopped\n" if stopped else "no embedded stack was running\n")
        return 0
    status = stack.stack_status(args.state_file)
    if args.action == "status":
        if args.json:
            sys.stdout.write(json.dumps(_public(status), sort_keys=True) + "\n")
        elif status.get("pids"):
            _print_table(status)
        else:
            sys.stdout.write(f"no embedded stack (state file {status['state_file']})\n")
        return 0 if status["running"] else 1
    # env
    if not status["running"]:
        raise StackError(
            f"no running embedded stack (state file {status['state_file']}); run 'boltstream stack up'"
        )
    env = stack.settings_env(stack.settings_from_state(status), state_file=status["state_file"])
    for key, value in env.items():
        sys.stdout.write(f"export {key}={shlex.quote(value)}\n")
    return 0
