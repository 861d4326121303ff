"""``round_robin``: in turn."""

from __future__ import annotations

from ..estimates import BytesPerToken
from .base import Router, W
from .keys import RequestKey


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self) -> None:
        self.estimate = BytesPerToken()
        self._next = 0

    def choose(self, candidates: list[W], key: RequestKey | None = None) -> W:
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return worker
