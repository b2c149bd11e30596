"""An agent process for the spool tests: ``python spool_agent.py N ROLLOUTS [PACE]`` emits N spans
through ``KafkaSpanExporter`` (configured by ``BOLTSTREAM_*`` env only), shuts down and prints its
metrics. PACE=1: after every 500 spans the agent waits (bounded) until the exporter holds fewer than
500 in memory, as an agent paced by its LLM calls would be; with a spool that is true even while the
broker is down, because spans move from memory to disk."""

from __future__ import annotations

import json
import sys
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from boltstream.producers.exporter import KafkaSpanExporter


def main(n: int, rollouts: int, pace: bool) -> None:
    exporter = KafkaSpanExporter(install_rollout_processor=False)
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=max(n, 256) + 1, schedule_delay_millis=20,
                                             max_export_batch_size=256))
    tracer = tp.get_tracer("spool-agent")
    for i in range(n):
        r = i % rollouts
        with tracer.start_as_current_span(f"r{r}-{i // rollouts:05d}", attributes={"boltstream.rollout_id": f"r{r}"}):
            pass
        if pace and i % 500 == 499:
            tp.force_flush()
            deadline = time.monotonic() + 10
            while exporter.metrics.buffered >= 500:
                if time.monotonic() > deadline:
                    sys.exit(f"spans stayed in memory: {exporter.metrics_dict()}")
                time.sleep(0.01)  # a poll interval
    tp.shutdown()
    print(json.dumps(exporter.metrics_dict()), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] == ["1"])
