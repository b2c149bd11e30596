"""The one exception the codec raises for anything wrong with a record, a schema or the registry.

A plain ``ValueError``: the records layer depends on nothing else in boltstream (the CLI
prints it as cleanly as its own errors).
"""

from __future__ import annotations


class SchemaError(ValueError):
    """Bytes that cannot be decoded, a record that cannot be encoded, or a schema/registry failure.

    One type on purpose: consumers catch ``SchemaError`` and route the input to the dead-letter
    topic; they never need to know whether fastavro, struct or the network was underneath.
    The message always starts with the topic so a log line alone says where the bad data lives.
    """

    def __init__(self, reason: str, *, topic: str | None = None) -> None:
        self.reason = reason
        self.topic = topic
        where = f"topic {topic!r}" if topic else "topic <none>"
        super().__init__(f"{where}: {reason}")

    def with_topic(self, topic: str | None) -> SchemaError:
        """The same reason attributed to ``topic`` (registry errors are raised before the topic is known)."""
        if topic is None or topic == self.topic:
            return self
        err = SchemaError(self.reason, topic=topic)
        err.__cause__ = self.__cause__
        return err
