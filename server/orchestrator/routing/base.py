"""What every router is and what its users may ask of it: the ``Router`` base, ``RoutedWorker``
(what a router reads of a worker: it does not import the pools), the capabilities a policy
declares instead of being asked its class, and the parsing of router arguments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, TypeVar

if TYPE_CHECKING:
    from ..estimates import BytesPerToken
    from .keys import RequestKey

#: JSON bytes per prompt token where a figure must be fixed at startup (``tokens_per_block`` as
#: chunk bytes, timeouts, rate limits); every routing figure uses the learned one (estimates.py)
BYTES_PER_TOKEN = 4


class RoutedWorker(Protocol):
    """What a router reads of a worker (server/orchestrator/pools.py's ``Worker`` is one): its URL,
    the legs and estimated prompt tokens it has in flight, the KV capacity its ``/server_info``
    says. Routers key their state by the worker object itself (hashed by identity)."""

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def in_flight_tokens(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int | None: ...


#: a router hands back one of the candidates it was given, as the caller's type
W = TypeVar("W", bound=RoutedWorker)


class Router:
    """One routing policy (a module of this package each, registered in ``ROUTERS``).

    What a policy can do beyond ``choose`` it says in capability attributes, which its users ask
    (vllm-router's policies behind one trait): no module tests a router's class.
    """

    name = ""
    #: this router reads a RequestKey (Pool.choose gets one only then)
    needs_key = False
    #: the key's kinds it reads: "conversation", "prefix"
    key_kinds: frozenset[str] = frozenset()
    #: capability: ``choose`` sets the key's expected hit on the worker chosen (``hit_chunks``,
    #: ``hit_tier2_chunks``) and the router keeps the hit counts /metrics reads (:class:`HitPredictor`)
    predicts_hits = False
    #: capability: the router takes a worker's own cache events, an exact view of its cache
    #: (server/orchestrator/cache_view.py; :class:`CacheEventFollower`)
    follows_cache_events = False
    #: capability: ``choose`` reads the candidates' ``in_flight_tokens`` (each request weighing its
    #: prompt's estimated tokens): the orchestrator counts them per worker only when a pool's router
    #: says so (least_loaded with ``use_tokens``)
    weighs_tokens = False
    #: the pool's learned prompt bytes per token (seeded by its workers' /server_info, taught by
    #: the context answers' usage: server/orchestrator/estimates.py)
    estimate: BytesPerToken

    def choose(self, candidates: list[W], key: RequestKey | None = None) -> W:
        raise NotImplementedError

    def sync(self, workers: Sequence[RoutedWorker]) -> None:
        """The pool's members changed (all of them, healthy or not)."""

    def forget(self, worker: RoutedWorker) -> None:
        """``worker`` left, turned unhealthy or came back: drop what is known of it."""


class HitPredictor(Protocol):
    """A router that ``predicts_hits``: what the request path and /metrics read of it."""

    estimate: BytesPerToken
    chunk_bytes: int
    #: chunks routed with a key, and of them those expected to hit
    routed_chunks: int
    hit_chunks: int
    #: context answers' hit tokens: predicted, achieved, sum of |predicted - achieved|
    predicted_tokens: int
    achieved_tokens: int
    error_tokens: int
    #: hit tokens by tier (device, tier 2): predicted when routed, achieved as answered
    predicted_tier_tokens: list[int]
    achieved_tier_tokens: list[int]

    def account(
        self, hit_chunks: int, prompt_tokens: int, cached_tokens: int, tier2_tokens: int = 0
    ) -> None: ...


class CacheEventFollower(Protocol):
    """A router that ``follows_cache_events``: what server/orchestrator/cache_view.py calls."""

    chunk_bytes: int
    #: the workers whose events it follows (a resync adds one, ``forget`` drops it)
    followed: set[RoutedWorker]

    def resync(self, worker: RoutedWorker, keys: list[int], tier2: list[int] | None = None) -> None: ...

    def tier_rates(
        self, worker: RoutedWorker, load_tokens_per_s: object, prefill_tokens_per_s: object
    ) -> None: ...

    def stored(self, worker: RoutedWorker, keys: list[int], tier: int = 1) -> None: ...

    def moved(self, worker: RoutedWorker, keys: list[int], tier: int) -> None: ...

    def removed(self, worker: RoutedWorker, keys: list[int]) -> None: ...


def can_predict_hits(router: Router) -> TypeGuard[HitPredictor]:
    """Whether ``router`` says it ``predicts_hits`` (then typed as one)."""
    return router.predicts_hits


def can_follow_cache_events(router: Router) -> TypeGuard[CacheEventFollower]:
    """Whether ``router`` says it ``follows_cache_events`` (then typed as one)."""
    return router.follows_cache_events


# -- router arguments (config ``<pool>.router.args``): a bad value is a ValueError naming it -------


def int_arg(args: dict[str, Any], name: str, default: int, low: int, high: int | None = None) -> int:
    value = args.get(name, default)
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def float_arg(args: dict[str, Any], name: str, default: float, low: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
        raise ValueError(f"{name} must be a number >= {low:g}, got {value!r}")
    return float(value)


def chunk_from_tokens(args: dict[str, Any], default_bytes: int) -> int:
    """``chunk_bytes``, or trtllm-serve's ``tokens_per_block`` as bytes (x ``BYTES_PER_TOKEN``: our
    chunks are of the raw JSON, not of token ids); not both."""
    from fastcore._hash_py import CHUNK_MAX

    if "tokens_per_block" in args:
        if "chunk_bytes" in args:
            raise ValueError("tokens_per_block: give it or chunk_bytes, not both (one chunk size)")
        high = CHUNK_MAX // BYTES_PER_TOKEN
        tokens = int_arg(args, "tokens_per_block", 32, 8, high)
        if tokens % 8:
            raise ValueError(
                f"tokens_per_block must be a multiple of 8 (chunks of {BYTES_PER_TOKEN} x it bytes, "
                f"a multiple of 32), got {tokens}"
            )
        return tokens * BYTES_PER_TOKEN
    chunk = int_arg(args, "chunk_bytes", default_bytes, 32, CHUNK_MAX)
    if chunk % 32:
        raise ValueError(f"chunk_bytes must be a multiple of 32, got {chunk}")
    return chunk
