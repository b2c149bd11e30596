"""boltstream's Avro schemas and the codec every component uses to put records on and off topics.

>>> from boltstream.schemas import Codec
>>> codec = Codec()                                   # single-object encoding (no registry)
>>> data = codec.encode("Task", {"task_id": "t1", "payload_json": "{}"}, topic="boltstream.tasks")
>>> codec.decode(data, topic="boltstream.tasks", expect="Task")["task_id"]
't1'
"""

from .codec import Codec
from .errors import SchemaError
from .loader import RECORDS, SchemaCatalog, SchemaVersion, default_catalog, load_schema
from .registry import HttpSchemaRegistry, InMemorySchemaRegistry, SchemaRegistry

__all__ = [
    "RECORDS",
    "Codec",
    "HttpSchemaRegistry",
    "InMemorySchemaRegistry",
    "SchemaCatalog",
    "SchemaError",
    "SchemaRegistry",
    "SchemaVersion",
    "default_catalog",
    "load_schema",
]
