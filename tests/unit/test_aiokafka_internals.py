"""The aiokafka internals the core uses (boltstream/broker/aiokafka_internals.py): the installed version is
one the contract was checked with, and a SCRAM refusal becomes an authentication error naming the reason."""

from __future__ import annotations

import pytest
from aiokafka import conn
from aiokafka.errors import AuthenticationFailedError

from boltstream.broker import aiokafka_internals, kafka  # noqa: F401 - importing kafka applies the patch
from tests.fences import assert_checked


@pytest.mark.parametrize("dist", sorted(aiokafka_internals.CHECKED_WITH))
def test_the_installed_version_is_one_the_contract_was_checked_with(dist: str) -> None:
    assert_checked(aiokafka_internals, dist)


def test_a_scram_refusal_names_the_brokers_reason() -> None:
    auth = conn.ScramAuthenticator.__new__(conn.ScramAuthenticator)
    with pytest.raises(AuthenticationFailedError, match="refused SCRAM authentication: unknown-user"):
        auth.process_server_final_message("e=unknown-user")
    patched = conn.ScramAuthenticator.process_server_final_message
    aiokafka_internals.scram_refusal_is_an_auth_error()  # a second call does not wrap it again
    assert conn.ScramAuthenticator.process_server_final_message is patched


def test_without_the_patch_aiokafka_still_fails_the_way_the_contract_says() -> None:
    """The patch is needed on the checked version: aiokafka's own method meets ``e=`` with KeyError('v')."""
    original = conn.ScramAuthenticator.process_server_final_message.unpatched
    auth = conn.ScramAuthenticator.__new__(conn.ScramAuthenticator)
    auth._server_signature = b"signature"  # what the client computed earlier in the exchange
    with pytest.raises(KeyError, match="v"):
        original(auth, "e=unknown-user")
