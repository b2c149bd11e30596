"""The aiokafka internals the core relies on, all of them, with the versions they were checked with.

Why any: a SCRAM refusal (RFC 5802 server-final ``e=unknown-user``, ``e=invalid-proof``) reaches
aiokafka as ``KeyError('v')``, so a wrong password or an unknown user surfaces as "unable to
bootstrap" after the whole timeout. :func:`scram_refusal_is_an_auth_error` makes it an
``AuthenticationFailedError`` naming the broker's reason, for every client of the process.
``tests/unit/test_aiokafka_internals.py`` fails, naming the versions, when the installed aiokafka
is not one in :data:`CHECKED_WITH` (re-check the contract below, then add the version). The stream
app's transport has its own, faust-bound, list (``boltstream.streams.faust_internals``).

The contract (aiokafka, as of the versions in :data:`CHECKED_WITH`):

* ``aiokafka.conn.ScramAuthenticator.process_server_final_message(self, server_final)`` receives the
  server-final message as a string and raises ``KeyError('v')`` on one that carries ``e=`` instead
  of the server signature ``v=``.
"""

from __future__ import annotations

from typing import Any

from aiokafka.errors import AuthenticationFailedError

# distribution -> versions this module's contract was checked against (read by the test).
CHECKED_WITH: dict[str, tuple[str, ...]] = {"aiokafka": ("0.14.0",)}


def scram_refusal_is_an_auth_error() -> None:
    """Patch aiokafka's SCRAM client (once per process) so a broker's refusal raises
    ``AuthenticationFailedError`` with the broker's reason."""
    from aiokafka import conn

    original = conn.ScramAuthenticator.process_server_final_message
    if hasattr(original, "unpatched"):
        return

    def process_server_final_message(self: Any, server_final: str) -> None:
        if server_final.startswith("e="):
            raise AuthenticationFailedError(f"the broker refused SCRAM authentication: {server_final[2:]}")
        original(self, server_final)

    process_server_final_message.unpatched = original  # type: ignore[attr-defined]
    conn.ScramAuthenticator.process_server_final_message = process_server_final_message
