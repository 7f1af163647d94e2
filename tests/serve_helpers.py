"""Helpers shared by the server tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples (all labels) from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)
