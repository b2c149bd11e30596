"""Secrets set by env never show in a config's repr, str or --help, whichever component resolves them."""

from __future__ import annotations

import os

import pytest

from boltstream.compose_check import COMMAND_CONFIGS, _class
from boltstream.config import knobs, load

SECRETS = {"BOLTSTREAM_SASL_PASSWORD": "sasl-pw-9b1e", "BOLTSTREAM_S3_SECRET_KEY": "s3-secret-77d2",
           "BOLTSTREAM_SERVE_API_KEY": "sk-api-c0ffee"}
ENV = {**SECRETS, "BOLTSTREAM_SECURITY_PROTOCOL": "SASL_SSL", "BOLTSTREAM_SASL_MECHANISM": "SCRAM-SHA-512",
       "BOLTSTREAM_SASL_USERNAME": "boltstream", "BOLTSTREAM_RUNNER_AGENT": "boltstream.examples.calc.agent:solve"}


@pytest.mark.parametrize("ref", sorted(set(COMMAND_CONFIGS.values())))
def test_no_secret_in_the_repr_of_a_config(ref: str) -> None:
    cls = _class(ref)
    env = {k: v for k, v in ENV.items() if k in {kn.env for kn in knobs(cls)}}
    cfg = load(cls, env=env, state_file=os.devnull)
    settings = getattr(cfg, "settings", cfg)
    assert settings.sasl_password == SECRETS["BOLTSTREAM_SASL_PASSWORD"]  # resolved, not dropped
    for text in (repr(cfg), str(cfg)):
        leaked = [name for name, secret in SECRETS.items() if secret in text]
        assert not leaked, f"{cls.__name__} shows {leaked}"


def test_every_secret_knob_is_marked_secret() -> None:
    # a new password-like setting without secret=True would get a flag and a repr
    for ref in set(COMMAND_CONFIGS.values()):
        for knob in knobs(_class(ref)):
            if any(word in knob.name for word in ("password", "secret", "api_key")) \
                    and not knob.name.endswith("_file"):
                assert knob.field.metadata.get("secret"), f"{knob.env} is not secret=True"
