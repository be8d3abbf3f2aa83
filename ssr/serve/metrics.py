"""Counters for ``GET /metrics`` (Prometheus text format, version 0.0.4), kept in-process without dependencies."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.tokens: Counter = Counter()  # kind -> count: prompt, completion, reasoning, accepted, ...
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.in_flight = 0

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, endpoint: str, status: int, seconds: float, result: Any = None) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests[endpoint, str(status)] += 1
            self.latency_sum += seconds
            self.latency_count += 1
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self.latency_buckets[i] += 1
            if result is not None:
                stats = result.stats
                self.tokens["prompt"] += result.prompt_tokens
                self.tokens["completion"] += len(result.token_ids)
                self.tokens["reasoning"] += int(stats.get("think_tokens", 0))
                self.tokens["accepted"] += int(stats.get("accepted_tokens", 0))
                self.tokens["think_accepted"] += int(stats.get("think_accepted_tokens", 0))
                self.tokens["cached_prompt"] += int(stats.get("reused_prompt_tokens", 0))
                self.tokens["forward_passes"] += int(stats.get("forward_passes", 0))
                self.tokens["plain_forward_passes"] += int(stats.get("plain_forward_passes", 0))

    def render(self, load: dict[str, int]) -> str:
        """The metrics as Prometheus text; ``load`` holds the engine's gauges (live lanes, queued, running)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {_number(value)}")

        with self._lock:
            metric("ssr_requests_total", "counter", "Requests answered, by endpoint and HTTP status.",
                   [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("ssr_requests_in_flight", "gauge", "Requests being answered now.", [("", self.in_flight)])
            for kind, help in (("prompt", "Prompt tokens of finished requests."),
                               ("completion", "Generated tokens (reasoning and answer)."),
                               ("reasoning", "Generated thinking tokens."),
                               ("accepted", "Answer tokens taken from verified drafts and proposals."),
                               ("think_accepted", "Thinking tokens taken from verified proposals."),
                               ("cached_prompt", "Prompt tokens whose KV cache was reused.")):
                metric(f"ssr_{kind}_tokens_total", "counter", help, [("", self.tokens[kind])])
            metric("ssr_forward_passes_total", "counter", "Forward passes run.", [("", self.tokens["forward_passes"])])
            metric("ssr_plain_forward_passes_total", "counter", "Forward passes plain decoding would have run.",
                   [("", self.tokens["plain_forward_passes"])])
            samples: list[tuple[str, float]] = [(f'_bucket{{le="{b}"}}', c)
                                                for b, c in zip(LATENCY_BUCKETS, self.latency_buckets)]
            samples += [('_bucket{le="+Inf"}', self.latency_count), ("_sum", self.latency_sum),
                        ("_count", self.latency_count)]
            lines.append("# HELP ssr_request_duration_seconds Time from a request's arrival to its last byte.")
            lines.append("# TYPE ssr_request_duration_seconds histogram")
            lines += [f"ssr_request_duration_seconds{suffix} {_number(v)}" for suffix, v in samples]
        for key, help in (("live_lanes", "KV-cache lanes live in the backend (thinking, drafts, parked)."),
                          ("queued", "Requests waiting to start."), ("running", "Requests being decoded.")):
            if key in load:
                name = "ssr_live_lanes" if key == "live_lanes" else f"ssr_requests_{key}"
                metric(name, "gauge", help, [("", load[key])])
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
