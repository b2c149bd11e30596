"""The token payload encoding before packed bytes, for benchmarks that report today's speed
as a ratio to it, measured in the same run on the same records.

:func:`legacy_codec` is a real :class:`~boltstream.schemas.Codec` over only the schema versions that
carried token ids as Avro arrays (Span v1; Trajectory, Sample, TrainingBatch v2): it writes what the
previous release wrote and decodes token ids into Python lists, as that release did.
"""

from __future__ import annotations

import json
from pathlib import Path

from boltstream.schemas import Codec, SchemaCatalog, default_catalog
from boltstream.schemas.loader import snake_case

#: Newest version of each record before its token payloads were packed.
LEGACY_VERSIONS = {"Span": 1, "Trajectory": 2, "Sample": 2, "TrainingBatch": 2}


def legacy_codec(folder: Path) -> Codec:
    """A codec whose newest versions are :data:`LEGACY_VERSIONS` (schemas written under ``folder``)."""
    catalog = default_catalog()
    for record in catalog.records:
        newest = LEGACY_VERSIONS.get(record, catalog.latest(record).version)
        for sv in catalog.versions(record):
            if sv.version <= newest:
                path = folder / snake_case(record) / f"v{sv.version}.avsc"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(sv.raw))
    return Codec(catalog=SchemaCatalog([folder], include_package=False))
