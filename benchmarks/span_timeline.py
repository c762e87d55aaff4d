"""Where a request's time goes, from the spans every service exports (``--trace``).

``traced_services`` starts an OTLP receiver in this process and points the services that
``stageserve up`` starts at it (they inherit this process's environment); each row of a
benchmark then notes the wall-clock window of its requests, and ``timeline_lines`` prints,
for the requests whose ``router.request`` span started in a window, each span's mean start
(ms after ``router.request`` started) and mean duration.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections import defaultdict
from collections.abc import Iterator, Sequence

from benchmarks.otlp_receiver import OtlpReceiver, ReceivedSpan
from benchmarks.report import markdown_table

ROOT = "router.request"
EXPORT_TIMEOUT_S = 30.0


@contextlib.contextmanager
def traced_services() -> Iterator[OtlpReceiver]:
    """An OTLP/gRPC receiver, exported to by every process started inside the block."""
    receiver = OtlpReceiver()
    saved = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    os.environ.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.start_grpc(),
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms: spans leave soon after they end
    )
    try:
        yield receiver
    finally:
        for key in [k for k in os.environ if k.startswith("OTEL_")]:
            del os.environ[key]
        os.environ.update(saved)
        receiver.stop()


def _roots(spans: Sequence[ReceivedSpan], window: tuple[int, int]) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == ROOT and window[0] <= s.start_ns <= window[1]]


def wait_for_roots(
    receiver: OtlpReceiver,
    windows: Sequence[tuple[int, int]],
    counts: Sequence[int],
    required: Sequence[frozenset[str]],
) -> list[ReceivedSpan]:
    """The spans received once every window holds its count of root spans and each of those
    roots' traces holds the window's ``required`` span names: every service exports on its own
    schedule, so the router's root can arrive before a later stage's span."""
    by_window = list(zip(windows, counts, required, strict=True))

    def complete(spans: list[ReceivedSpan]) -> bool:
        names: dict[str, set[str]] = defaultdict(set)
        for span in spans:
            names[span.trace_id].add(span.name)
        for window, count, needed in by_window:
            roots = _roots(spans, window)
            if len(roots) < count or any(not needed <= names[r.trace_id] for r in roots):
                return False
        return True

    return receiver.wait_for(complete, EXPORT_TIMEOUT_S)


def timeline_lines(
    spans: Sequence[ReceivedSpan], rows: Sequence[tuple[str, tuple[int, int]]]
) -> list[str]:
    """A table: per row (name, window) and span, its mean start and duration in ms."""
    by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in spans:
        by_trace[span.trace_id].append(span)
    cells = []
    for name, window in rows:
        starts: dict[str, list[float]] = defaultdict(list)
        lengths: dict[str, list[float]] = defaultdict(list)
        roots = _roots(spans, window)
        for root in roots:
            for span in by_trace[root.trace_id]:
                starts[span.name].append((span.start_ns - root.start_ns) / 1e6)
                lengths[span.name].append((span.end_ns - span.start_ns) / 1e6)
        for span_name in sorted(starts, key=lambda n: statistics.mean(starts[n])):
            cells.append(
                (
                    name,
                    span_name,
                    f"{statistics.mean(starts[span_name]):.1f}",
                    f"{statistics.mean(lengths[span_name]):.1f}",
                    f"{len(lengths[span_name])}/{len(roots)}",
                )
            )
    header = ("row", "span", "starts at ms", "lasts ms", "requests")
    return markdown_table(header, cells)
