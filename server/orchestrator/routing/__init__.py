"""Routers: which worker of a pool takes a request (config ``<pool>.router.type``, trtllm-serve's names).

- ``round_robin``: in turn (round_robin.py).
- ``least_loaded`` (trtllm-serve's ``load_balancing``): fewest requests in flight, ties in turn
  (least_loaded.py).
- ``conversation``: a conversation's requests stick to one worker, by consistent hashing
  (conversation.py).
- ``kv_cache_aware``: the worker expected to hold the longest cached prefix of the prompt,
  balanced against load (kv_cache_aware.py, its per-worker index in prefix_index.py).

A router gets the healthy candidates and, when it says ``needs_key``, the request's
:class:`RequestKey` (keys.py: computed once per request, from the raw body, only when a pool's
router needs one: round_robin and least_loaded requests pay nothing). ``forget(worker)`` drops what
a router knows of a worker; the pool and the health checker call it when the worker leaves the
pool, turns unhealthy or comes back (it may have restarted with an empty cache). ``sync(workers)``
gives the router the pool's member list whenever it changes. What a router can do beyond that it
says in capability attributes (base.py: ``predicts_hits``, ``follows_cache_events``), asked
through :func:`can_predict_hits` and :func:`can_follow_cache_events`, never by its class.

A new policy is one module here plus its line in ``ROUTERS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import (
    BYTES_PER_TOKEN,
    CacheEventFollower,
    HitPredictor,
    RoutedWorker,
    Router,
    can_follow_cache_events,
    can_predict_hits,
)
from .conversation import ConversationRouter
from .conversation_params import conversation_to_params
from .keys import (
    CONVERSATION_HEADER,
    CONVERSATION_HEADERS,
    MAX_CONVERSATION_ID_BYTES,
    TRTLLM_CONVERSATION_HEADERS,
    RequestKey,
    conversation_header,
    request_key,
)
from .kv_cache_aware import LOAD_SAMPLE, MAX_ASKED, TIER_WEIGHT, KvCacheAwareRouter
from .least_loaded import LeastLoadedRouter
from .prefix_index import PrefixIndex
from .round_robin import RoundRobinRouter

__all__ = [
    "BYTES_PER_TOKEN",
    "CONVERSATION_HEADER",
    "CONVERSATION_HEADERS",
    "LOAD_SAMPLE",
    "MAX_ASKED",
    "MAX_CONVERSATION_ID_BYTES",
    "ROUTERS",
    "ROUTER_ARGS",
    "TIER_WEIGHT",
    "TRTLLM_CONVERSATION_HEADERS",
    "CacheEventFollower",
    "ConversationRouter",
    "HitPredictor",
    "KvCacheAwareRouter",
    "LeastLoadedRouter",
    "PrefixIndex",
    "RequestKey",
    "RoundRobinRouter",
    "RoutedWorker",
    "Router",
    "can_follow_cache_events",
    "can_predict_hits",
    "conversation_header",
    "conversation_to_params",
    "make_router",
    "request_key",
]

#: config router kind -> its router: the one list of the routers built (the config's router types and
#: the CLI's choices are read from it, server/orchestrator/config.py ROUTER_TYPES)
ROUTERS: dict[str, Callable[..., Router]] = {
    "round_robin": lambda args=None: RoundRobinRouter(),
    "least_loaded": LeastLoadedRouter,
    "conversation": ConversationRouter,
    "kv_cache_aware": KvCacheAwareRouter,
}
#: config router kind -> the args it takes
ROUTER_ARGS: dict[str, frozenset[str]] = {
    kind: getattr(new, "ARGS", frozenset()) for kind, new in ROUTERS.items()
}


def make_router(kind: str, args: dict[str, Any] | None = None) -> Router:
    """The router ``kind`` with ``args`` (``ValueError`` naming a bad argument's value)."""
    return ROUTERS[kind](args or {})
