"""``boltstream export``: ranges of the spans, trajectories and batches topics as Parquet or JSON lines.

Why a package of its own in the core: the export reads the log with the shared range
module and the codec only (no stream app, no torch), and ``learn --offline`` reads its
files back through :mod:`.batches`. Modules: :mod:`.columns` (Avro -> Arrow, pure),
:mod:`.rows` (one layout per kind, and the way back for batches), :mod:`.writers`
(bounded row groups, temporary name, metadata), :mod:`.batches` (batches files read
back: checked, regrouped into records), :mod:`.cli` (the command).
"""
