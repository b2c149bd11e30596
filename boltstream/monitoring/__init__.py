"""The operator's view of a run: ``boltstream status``, the Prometheus endpoint every process serves and
the experiment trackers (``--report-to``)."""
