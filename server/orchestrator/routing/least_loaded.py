"""``least_loaded`` (trtllm-serve's ``load_balancing``): fewest requests in flight, ties in turn."""

from __future__ import annotations

from typing import Any

from ..estimates import BytesPerToken
from .base import Router, W
from .keys import RequestKey


class LeastLoadedRouter(Router):
    """Fewest in-flight requests; ties go round robin so idle workers share load.

    ``use_tokens`` (trtllm-serve's ``load_balancing`` argument): fewest in-flight prompt tokens
    instead, a request weighing its body's bytes / the pool's learned bytes per token (no parse), so one 40k-token
    prompt counts as much as forty 1k-token ones; ties by requests, then in turn."""

    name = "least_loaded"
    ARGS = frozenset({"use_tokens"})

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        self.estimate = BytesPerToken()
        self._tiebreak = 0
        use = (args or {}).get("use_tokens", False)
        if not isinstance(use, bool):
            raise ValueError(f"use_tokens must be true or false, got {use!r}")
        self.weighs_tokens = use

    def choose(self, candidates: list[W], key: RequestKey | None = None) -> W:
        if self.weighs_tokens:
            least_tokens = min(w.in_flight_tokens for w in candidates)
            candidates = [w for w in candidates if w.in_flight_tokens == least_tokens]
        least = min(w.in_flight for w in candidates)
        tied = [w for w in candidates if w.in_flight == least]
        worker = tied[self._tiebreak % len(tied)]
        self._tiebreak += 1
        return worker
