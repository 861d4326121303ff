"""The orchestrator's per-request numbers, both twins: the pure classes of tally.py, bytes_per_token.py
and breaker.py (metrics', estimates' and pools' ``PURE``) against the same sources compiled
(server.orchestrator._tally, _bytes_per_token, _breaker), the same inputs giving the same results to
the bit, the same errors, and the same values on the metrics page after a flush."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest

from server.metrics import Registry
from server.orchestrator import estimates, metrics, pools, twins

ROOT = Path(__file__).resolve().parent.parent
COMPILED = twins.tally
needs_compiled = pytest.mark.skipif(
    COMPILED is None, reason="compiled twins not built (or FASTCORE_NO_EXTENSIONS=1)"
)
#: each class's compiled module, by the pure module it is compiled from
SOURCES = {"TallyOne": "tally", "TallyHistogram": "tally", "NoClock": "tally"}
SOURCES |= {"BytesPerToken": "bytes_per_token", "CircuitBreaker": "breaker"}


def pair(name: str) -> tuple[Any, Any]:
    """(the pure class, the compiled one) of ``name``."""
    pure = {**metrics.PURE, **estimates.PURE, **pools.PURE}[name]
    compiled = getattr(twins, SOURCES[name])
    assert compiled is not None
    return pure, getattr(compiled, name)


def test_no_compiled_class_is_a_second_copy_of_its_pure_source() -> None:
    """Issue 41's twin rule: every compiled twin of the orchestrator's per-request classes is its pure
    module compiled (Cython's pure-Python mode, typed by the .pxd of the compiled name): no
    hand-written .pyx copies them, and each .pxd types a module setup.py compiles from the .py."""
    orchestrator = ROOT / "server/orchestrator"
    copies = [
        p.name for p in orchestrator.glob("*.pyx") if any(f"class {n}" in p.read_text() for n in SOURCES)
    ]
    assert copies == []
    setup = (ROOT / "setup.py").read_text()
    for source in set(SOURCES.values()):
        assert (orchestrator / f"_{source}.pxd").is_file()
        assert f'"server.orchestrator._{source}": ["server/orchestrator/{source}.py"]' in setup


@needs_compiled
def test_tally_is_one_source_compiled() -> None:
    """TallyOne, TallyHistogram and NoClock: tally.py compiled as _tally, cdef classes (their fields in
    C), the ones metrics.py binds its children to."""
    for name in ("TallyOne", "TallyHistogram", "NoClock"):
        pure_class, c_class = pair(name)
        assert pure_class.__module__ == "server.orchestrator.tally"
        assert c_class.__module__ == "server.orchestrator._tally"
        assert getattr(metrics, name) is c_class
    assert not hasattr(metrics.TallyOne(Registry().counter("t_cdef_total", "C.").labels()), "__dict__")
    assert not hasattr(metrics.TallyHistogram(histogram_child("t_cdef_seconds")), "__dict__")
    assert not hasattr(metrics.NO_CLOCK, "__dict__")


def test_the_chosen_twins_are_the_ones_the_orchestrator_uses() -> None:
    if COMPILED is None:
        assert twins.backend == "python"
        assert metrics.TallyOne is metrics.PURE["TallyOne"]
        assert estimates.BytesPerToken is estimates.PURE["BytesPerToken"]
    else:
        assert twins.backend == "cython"
        assert metrics.TallyHistogram is COMPILED.TallyHistogram
        assert isinstance(metrics.NO_CLOCK, COMPILED.NoClock)
        assert estimates.BytesPerToken is pair("BytesPerToken")[1]
        assert isinstance(pools.Worker("http://a").breaker, pair("CircuitBreaker")[1])


@needs_compiled
def test_bytes_per_token_is_one_source_compiled() -> None:
    """Issue 41's twin rule: the compiled BytesPerToken is bytes_per_token.py compiled (Cython's pure
    mode, typed by _bytes_per_token.pxd), not a second copy of its code in _tally.pyx."""
    pure_class, c_class = pair("BytesPerToken")
    assert pure_class.__module__ == "server.orchestrator.bytes_per_token"
    assert c_class.__module__ == "server.orchestrator._bytes_per_token"
    assert not hasattr(c_class(), "__dict__")  # a cdef class: its fields in C


@needs_compiled
def test_bytes_per_token_twins_agree_to_the_bit() -> None:
    pure_class, c_class = pair("BytesPerToken")
    rng = random.Random(25)
    for trial in range(50):
        pure, comp = pure_class(), c_class()
        if trial % 3 == 0:
            seed = rng.choice([None, 0.1, 2.0, 3.7, 64.0, 65.0, True, 7])
            pure.seed(seed)
            comp.seed(seed)
        for _ in range(200):
            nbytes = rng.choice([0, -5, 1, rng.randrange(1, 200_000), rng.randrange(1, 10**12)])
            tokens = rng.choice([None, 0, 1, rng.randrange(1, 60_000), rng.randrange(1, 10**11)])
            pure.observe(nbytes, tokens)
            comp.observe(nbytes, tokens)
            assert (comp.value, comp._bytes, comp._tokens, comp.observed) == (
                pure.value, pure._bytes, pure._tokens, pure.observed,
            )  # fmt: skip
            n = rng.choice([0, 7, 4000, 160_000, 2.5])
            assert comp.tokens(n) == pure.tokens(n)
        comp.seed(3.0)  # after answers: ignored by both
        pure.seed(3.0)
        assert comp.value == pure.value


@needs_compiled
def test_bytes_per_token_twins_bound_their_steps_alike() -> None:
    """Ratios near the figure, far from it (both bounds: the outlier's and the step's) and long runs
    of either: the same figure, sums and count to the bit."""
    pure_class, c_class = pair("BytesPerToken")
    rng = random.Random(36)
    for trial in range(30):
        pure, comp = pure_class(), c_class()
        if trial % 2:
            pure.seed(trial / 4 + 0.5)
            comp.seed(trial / 4 + 0.5)
        for _ in range(300):
            tokens = rng.choice([1, 7, rng.randrange(1, 5_000), rng.randrange(1, 200_000)])
            ratio = rng.choice([pure.value, rng.uniform(0.3, 63.0), pure.value * rng.uniform(0.4, 2.5)])
            nbytes = max(1, int(tokens * ratio))
            pure.observe(nbytes, tokens)
            comp.observe(nbytes, tokens)
            assert (comp.value, comp._bytes, comp._tokens, comp.observed) == (
                pure.value, pure._bytes, pure._tokens, pure.observed,
            )  # fmt: skip


@needs_compiled
@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda e: e.seed("4"), TypeError),  # a worker's /server_info is not trusted to send a number
        (lambda e: e.observe(10**400, 10), OverflowError),
        (lambda e: e.observe("100", 10), TypeError),
        (lambda e: e.tokens(None), TypeError),
    ],
)
def test_bytes_per_token_twins_refuse_the_same_inputs(call: Any, error: type[Exception]) -> None:
    for cls in pair("BytesPerToken"):
        with pytest.raises(error):
            call(cls())


def histogram_child(name: str) -> Any:
    return Registry().histogram(name, "Tallied.", ("phase",)).labels(phase="x")


@needs_compiled
def test_histogram_twins_count_the_same_buckets_and_flush_the_same_page() -> None:
    amounts = [0.0, -1.0, 0.005, 0.0050000001, 0.1, 0.25, 2.5, 10.0, 1e9, math.inf, math.nan, 3, True]
    amounts += [random.Random(1).uniform(0, 12) for _ in range(500)]
    results = []
    for cls in pair("TallyHistogram"):
        child = histogram_child(f"t_twin_{cls.__module__.replace('.', '_')}_seconds")
        tally = cls(child)
        for amount in amounts:
            tally.observe(amount)
        counts, total = list(tally.counts), tally.sum
        assert tally.pending
        tally.flush()
        assert not tally.pending and not any(tally.counts) and tally.sum == 0.0
        tally.flush()  # nothing pending: nothing added
        buckets = [b.get() for b in child._buckets]
        results.append((counts, math.isnan(total), buckets, math.isnan(child._sum.get())))
    assert results[0] == results[1]
    assert sum(results[0][0]) == len(amounts) - 1  # every amount in a bucket, but NaN


@needs_compiled
def test_histogram_twins_refuse_what_is_not_a_number() -> None:
    for cls in pair("TallyHistogram"):
        child = histogram_child(f"t_twin_bad_{cls.__module__.replace('.', '_')}_seconds")
        with pytest.raises(TypeError):
            cls(child).observe(None)


@needs_compiled
def test_counter_twins_add_their_counts_at_the_flush() -> None:
    for cls in pair("TallyOne"):
        registry = Registry()
        counter = registry.counter(f"t_twin_{cls.__module__.replace('.', '_')}_total", "Tallied.", ("path",))
        tally = cls(counter.labels(path="a"))
        for _ in range(5):
            tally.inc()
        assert tally.n == 5 and tally._value.get() == 0.0
        tally.flush()
        assert tally.n == 0 and tally._value.get() == 5.0
        tally.flush()
        assert tally._value.get() == 5.0


@needs_compiled
def test_clock_twins_take_the_same_arguments() -> None:
    for cls in pair("NoClock"):
        clock = cls()
        assert clock.start() is None and clock.lap("relay") is None and clock.finish() is None
        with pytest.raises(TypeError):
            clock.lap()
        with pytest.raises(TypeError):
            clock.start("relay")


def breaker_state(b: Any) -> tuple[Any, ...]:
    return (b.state, b._state, b.failures, b.open_for, b.probing, b.opened, b.threshold, b.open_s)


@needs_compiled
def test_breaker_is_one_source_compiled() -> None:
    """Issue 41's twin rule: the compiled CircuitBreaker is breaker.py compiled (Cython's pure mode,
    typed by _breaker.pxd), not a second copy of its code in _tally.pyx."""
    pure_class, c_class = pair("CircuitBreaker")
    assert pure_class.__module__ == "server.orchestrator.breaker"
    assert c_class.__module__ == "server.orchestrator._breaker"
    assert not hasattr(c_class(), "__dict__")  # a cdef class: its fields in C


@needs_compiled
def test_breaker_twins_walk_the_same_states_and_bump_the_same_epoch() -> None:
    pure_class, c_class = pair("CircuitBreaker")
    assert breaker_state(pure_class()) == breaker_state(c_class())  # the same defaults
    assert (c_class.CLOSED, c_class.HALF_OPEN, c_class.OPEN, c_class.MAX_OPEN_FACTOR) == (
        pure_class.CLOSED, pure_class.HALF_OPEN, pure_class.OPEN, pure_class.MAX_OPEN_FACTOR,
    )  # fmt: skip
    rng = random.Random(7)
    for trial in range(40):
        threshold, open_s = rng.choice([1, 2, 3]), rng.choice([5, 0.5, 2.0])
        twins_ = [pure_class(threshold, open_s), c_class(threshold, open_s)]
        for _ in range(60):
            op = rng.choice(["chosen", "succeeded", "failed", "failed_at_once", "ended", "allows"])
            delta = rng.choice([0.0, 0.1, open_s, open_s * 3, open_s * 20])
            answers, bumps = [], []
            for b in twins_:
                epoch = pools._ROUTABLE_EPOCH[0]
                if op == "failed":
                    answers.append(b.failed())
                elif op == "failed_at_once":
                    answers.append(b.failed(at_once=True))
                elif op == "allows":
                    answers.append(b.allows(b.opened_at + delta))
                else:
                    answers.append(getattr(b, op)())
                bumps.append(pools._ROUTABLE_EPOCH[0] - epoch)
            assert answers[0] == answers[1] and bumps[0] == bumps[1], (trial, op)
            assert breaker_state(twins_[0]) == breaker_state(twins_[1]), (trial, op)
        for b in twins_:
            b.state = pure_class.HALF_OPEN  # set from outside (the tests do): the same epoch bump
        assert breaker_state(twins_[0]) == breaker_state(twins_[1])
