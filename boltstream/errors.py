"""Errors that cross component boundaries; each one names what was wrong."""

from __future__ import annotations

from typing import Any


class BoltstreamError(Exception):
    """Base for errors boltstream raises on purpose (the CLI prints them without a traceback)."""


class ConfigError(BoltstreamError, ValueError):
    """A configuration value is invalid; names the variable (or field) and the value."""

    def __init__(self, name: str, value: Any, reason: str) -> None:
        self.name = name
        self.value = value
        self.reason = reason
        super().__init__(f"{name}={value!r}: {reason}")


class StackError(BoltstreamError):
    """The embedded stack could not be started, found or stopped."""


class CheckpointError(BoltstreamError):
    """A checkpoint is missing, partial or corrupt."""
