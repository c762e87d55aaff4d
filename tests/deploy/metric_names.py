"""Metric names: what the services export (from their own metrics modules) and what a PromQL
expression selects."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from services.common.telemetry import metrics_view
from services.decode import metrics as decode_metrics
from services.prefill import metrics as prefill_metrics
from services.router.metrics import RouterMetrics
from services.tokenizer.metrics import TokenizerMetrics
from services.vision_encoder.metrics import VisionEncoderMetrics

# The series each family type puts on /metrics (the text format's suffixes).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "info": ("_info",),
}


def _families() -> list[Metric]:
    registry = CollectorRegistry()
    TokenizerMetrics(registry)
    VisionEncoderMetrics(registry)
    RouterMetrics(registry)
    families = list(metrics_view("test", "test", registry).collect())  # + stageserve_model_info
    for module in (decode_metrics, prefill_metrics):  # module-level metrics on the process registry
        for value in vars(module).values():
            if isinstance(value, MetricWrapperBase):
                families += value.describe()
    return families


def exported_series() -> set[str]:
    """Every series name a stageserve service serves on /metrics."""
    return {family.name + suffix for family in _families() for suffix in SUFFIXES[family.type]}


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NAME = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {"bool", "and", "or", "unless", "offset", "group_left", "group_right", "inf", "nan"}


def selected_metrics(expr: str) -> set[str]:
    """The metric names ``expr`` selects: its names that are no function, aggregation, keyword,
    label (matchers, grouping) or number."""
    text = _STRING.sub('""', expr)
    for pattern in (_MATCHERS, _RANGE, _GROUPING):
        text = pattern.sub(" ", text)
    names = set()
    for match in _NAME.finditer(text):
        is_call = text[match.end() :].lstrip().startswith("(")
        if not is_call and match.group().lower() not in _KEYWORDS:
            names.add(match.group())
    return names
