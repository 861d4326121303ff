# cython: annotation_typing=False, auto_pickle=False
"""A worker's circuit breaker (:class:`CircuitBreaker`, which :mod:`.pools` gives each worker),
written once: this module is the pure twin, and Cython compiles the same source, in its pure-Python
mode, into ``server.orchestrator._breaker`` (setup.py), the compiled twin, typed by ``_breaker.pxd``
(a ``cdef class``: its state an int, its times doubles, its states C constants). Nothing here
imports Cython; the annotations are for mypy alone (``annotation_typing=False``).

A change of state bumps the epoch of :mod:`.pools`' cached routable workers: pools hands its list
over at import (:func:`watch_epoch`), to both twins.

Measured against the hand-written ``cdef class`` it replaced in _tally.pyx (callgrind, 200,000 legs'
``chosen``/``succeeded``/``ended`` from Python: the whole run's instructions 960.56M there, 960.54M
here); tests/test_tally_twins.py: the twins walk the same states and bump the same epoch.
"""

from __future__ import annotations

import time

__all__ = ["BREAKER_FAILURES", "BREAKER_OPEN_S", "CircuitBreaker", "watch_epoch"]

#: a breaker's defaults (CircuitBreaker, Pool and the config keys circuit_breaker_failures and
#: circuit_breaker_open_s read them): failed legs in a row that open it, seconds it stays open
BREAKER_FAILURES = 3
BREAKER_OPEN_S = 5.0
#: the states (CircuitBreaker's CLOSED, HALF_OPEN, OPEN)
_CLOSED, _HALF_OPEN, _OPEN = 0, 1, 2

#: pools.py's ``_ROUTABLE_EPOCH`` (a one-item list), once pools hands it over (:func:`watch_epoch`)
_epoch: list[int] = [0]


def watch_epoch(epoch: list[int]) -> None:
    """Bump ``epoch[0]`` on each breaker's change of state (pools.py's cached routable workers)."""
    global _epoch
    _epoch = epoch


class CircuitBreaker:
    """One worker's breaker: closed (legs go), open (none), half-open (one probe leg at a time).

    ``failures`` failed legs in a row open it; so does one timed-out leg (each costs a
    client the whole timeout) and a failed probe. It stays open ``open_s``, doubled
    by each failed probe up to ``MAX_OPEN_FACTOR`` times; then the next leg chosen
    for the worker is its probe, and no other leg goes there until the probe ends:
    a success closes the breaker, a failure opens it again, no verdict (the client
    left, a 4xx) lets the next leg probe.
    """

    CLOSED, HALF_OPEN, OPEN = _CLOSED, _HALF_OPEN, _OPEN
    #: a worker that keeps failing its probes waits at most this many times ``open_s``
    MAX_OPEN_FACTOR = 8

    __slots__ = ("_state", "failures", "open_for", "open_s", "opened", "opened_at", "probing", "threshold")

    def __init__(self, threshold: int = BREAKER_FAILURES, open_s: float = BREAKER_OPEN_S) -> None:
        self.threshold = threshold
        self.open_s = open_s
        self._state = _CLOSED
        self.failures = 0
        self.open_for = open_s
        self.opened_at = 0.0
        self.probing = False
        #: times it opened (for /metrics)
        self.opened = 0

    @property
    def state(self) -> int:
        return self._state

    @state.setter
    def state(self, state: int) -> None:
        if state != self._state:
            self._state = state
            _epoch[0] += 1  # Pool.choose's cached candidates are stale

    def allows(self, now: float) -> bool:
        """Whether a new leg may go to the worker now (an open breaker past its time turns half-open)."""
        if self._state == _OPEN:
            if now - self.opened_at < self.open_for:
                return False
            self.state = _HALF_OPEN
            self.probing = False
        return not self.probing

    def chosen(self) -> None:
        """A leg goes to the worker: in half-open, it is the probe."""
        if self._state == _HALF_OPEN:
            self.probing = True

    def succeeded(self) -> None:
        self.failures = 0
        self.probing = False
        if self._state != _CLOSED:
            self.state = _CLOSED
            self.open_for = self.open_s

    def failed(self, *, at_once: bool = False) -> bool:
        """Count a failed leg; True when this opened the breaker."""
        self.failures += 1
        probe = self._state == _HALF_OPEN
        if self._state == _OPEN or not (at_once or probe or self.failures >= self.threshold):
            return False
        if probe:
            self.open_for = min(self.open_for * 2, self.open_s * self.MAX_OPEN_FACTOR)
        self.state = _OPEN
        self.opened_at = time.monotonic()
        self.probing = False
        self.opened += 1
        return True

    def ended(self) -> None:
        """The leg is over, whatever its verdict: a probe without one lets the next leg probe."""
        if self._state == _HALF_OPEN:
            self.probing = False
