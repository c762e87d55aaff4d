"""The prefill leader's trace spans of a plan's step, children of each caller's span."""

from __future__ import annotations

from opentelemetry import trace

from services.common import telemetry
from services.prefill.messages import RankPlan
from services.prefill.request import PrefillOutput, PrefillPlan

_tracer = telemetry.tracer("prefill")


def forward_spans(plan: PrefillPlan, payload: RankPlan, num_ranks: int) -> list[trace.Span]:
    """A ``prefill.forward`` span per request, child of its caller's span, for the plan's step."""
    cp_size = num_ranks if payload.solo_rank < 0 else 1
    return [
        _tracer.start_span(
            "prefill.forward",
            context=telemetry.extract_context(p.request.trace_carrier.items()),
            attributes={
                "request_id": p.request.request_id,
                "prefill.batch_size": len(plan.requests),
                "prefill.batch_tokens": plan.num_tokens,
                "prefill.cp_size": cp_size,
            },
        )
        for p in plan.requests
    ]


def transfer_spans(plan: PrefillPlan, output: PrefillOutput, end_ns: int) -> None:
    """A ``kv.transfer`` span per request: its ranks' KV write time, ending with the step."""
    for planned, outcome in zip(plan.requests, output.outcomes, strict=True):
        span = _tracer.start_span(
            "kv.transfer",
            context=telemetry.extract_context(planned.request.trace_carrier.items()),
            start_time=end_ns - int(outcome.kv_transfer_s * 1e9),
            attributes={"request_id": outcome.request_id, "kv.num_bytes": outcome.num_kv_bytes},
        )
        if outcome.error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, outcome.error.message))
        span.end(end_ns)
