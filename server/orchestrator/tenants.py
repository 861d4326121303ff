"""Who may call the orchestrator: client API keys, the tenant each names, its fair-share weight.

``api_keys_file`` holds one key a line, ``<key> <tenant> [weight] [priority=MIN..MAX]`` (``#``
comments and blank lines skipped); ``priority=`` bounds the ``priority`` a request with that key may
claim, when ``admission.client_priority`` grants any (server/orchestrator/admission.py). With it
(or one key in ``$FASTCORE_API_KEY`` / ``api_key``, tenant ``default``, as vllm serve's
``--api-key``), every ``/v1/*`` request needs ``Authorization: Bearer <key>``;
anything else gets one 401, the same bytes for a missing, malformed and wrong key, so an answer
tells a caller nothing about how close it came.

Keys are never kept or compared as they are: the table maps a keyed BLAKE2b digest of each key
(under a random per-process salt) to its tenant, and a request's key is digested the same way
before the lookup. That is the constant-time comparison here: the lookup's time depends only on
the digest, which under a salt the caller never sees says nothing about how much of a guess
matches a key (the timing attack a byte-by-byte comparison or a plain dict of keys allows), and
it costs one hash for any number of keys (``hmac.compare_digest`` over every key would cost N).

SIGHUP re-reads the file (``fastcore-serve orchestrator`` installs the handler; with ``--workers
N`` the parent passes it to every process): a new key works from the next request, a removed one
stops. A file that no longer loads keeps the keys in force and logs why, naming the line, never a
key.

``/metrics`` (server/metrics_access.py) keeps its rule, the metrics token or else loopback peers
only; ``metrics_requires_key: true`` makes it: the metrics token or any client API key, from any
address, loopback alone no longer enough (:class:`KeyedMetricsAccess`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from server.errors import HTTPError, error_body
from server.metrics_access import MetricsAccess

if TYPE_CHECKING:
    from server.metrics import Registry


class KeySettings(Protocol):
    """What the key table and /metrics' rule read of the orchestrator's config (config.py's
    OrchestratorConfig: it reads the key file at startup, so this module does not import it)."""

    @property
    def api_keys_file(self) -> str | None: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def api_key_bytes(self) -> bytes | None: ...
    @property
    def metrics_requires_key(self) -> bool: ...
    @property
    def metrics_token_bytes(self) -> bytes | None: ...


log = logging.getLogger("fastcore.orchestrator")

#: the environment variable holding one client key (tenant ``default``) without a key file
API_KEY_ENV = "FASTCORE_API_KEY"
#: the tenant of ``$FASTCORE_API_KEY``, and of every request when admission runs without keys
DEFAULT_TENANT = "default"
#: a tenant name is a metric label: short and plain
_TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: a key: printable ASCII without spaces (RFC 6750's b64token is narrower; any such key works)
_KEY_RE = re.compile(rb"[\x21-\x7e]{1,512}")
#: a key's priority range: ``priority=MIN..MAX``, signed 64-bit integers (vLLM's field, bounded)
_PRIORITY_RE = re.compile(rb"priority=(-?[0-9]{1,19})\.\.(-?[0-9]{1,19})")
_INT64 = 1 << 63
_FIELDS = "'<key> <tenant> [weight] [priority=MIN..MAX]'"

#: the one answer to a request without a valid key (built once: the same bytes every time)
UNAUTHORIZED_BODY = error_body(
    401,
    "missing or invalid API key: send Authorization: Bearer <key>",
    code="invalid_api_key",
)
UNAUTHORIZED_HEADERS = b'WWW-Authenticate: Bearer realm="api"\r\n'


@dataclass(frozen=True, slots=True)
class Tenant:
    """A client of the deployment: its name (a metric label), its fair-share weight and the range of
    ``priority`` its key may claim (None: ``admission.client_priority``'s)."""

    name: str
    weight: float = 1.0
    priority: tuple[int, int] | None = None


#: every request's tenant when admission runs without keys
ANONYMOUS = Tenant(DEFAULT_TENANT)


class KeyFileError(ValueError):
    """An ``api_keys_file`` that does not load: says which line, never the key on it."""


def bearer_credentials(authorization: bytes | None) -> bytes | None:
    """The credentials of an ``Authorization: Bearer <credentials>`` header (scheme in any case)."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return credentials.strip() or None


def parse_key_file(text: bytes, path: str) -> dict[bytes, Tenant]:
    """``{key: Tenant}`` from the lines of a key file; :class:`KeyFileError` naming the line."""
    keys: dict[bytes, Tenant] = {}
    weights: dict[str, float] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(b"#"):  # a comment is a whole line: a key may hold "#"
            continue
        parts = line.split()
        where = f"{path} line {number}"
        if not 2 <= len(parts) <= 4:
            raise KeyFileError(f"{where}: expected {_FIELDS}, got {len(parts)} fields")
        key, tenant_raw = parts[0], parts[1]
        if not _KEY_RE.fullmatch(key):
            raise KeyFileError(f"{where}: a key is 1-512 printable ASCII characters")
        tenant = tenant_raw.decode("ascii", "replace")
        if not _TENANT_RE.fullmatch(tenant):
            raise KeyFileError(f"{where}: a tenant name is 1-64 of A-Z a-z 0-9 . _ -, got {tenant[:70]!r}")
        weight, priority = None, None
        for field in parts[2:]:
            if field.startswith(b"priority=") and priority is None:
                priority = _priority_range(field, where)
            elif weight is None and priority is None:
                weight = _weight(field, where)
            else:
                raise KeyFileError(f"{where}: expected {_FIELDS}")
        weight = 1.0 if weight is None else weight
        if weights.setdefault(tenant, weight) != weight:
            raise KeyFileError(
                f"{where}: tenant {tenant} has weight {weight:g} here and {weights[tenant]:g} on an earlier line"
            )
        if key in keys:
            raise KeyFileError(f"{where}: this key is listed twice")
        keys[key] = Tenant(tenant, weight, priority)
    if not keys:
        raise KeyFileError(f"{path}: no keys (lines {_FIELDS})")
    return keys


def _weight(field: bytes, where: str) -> float:
    try:
        weight = float(field)
    except ValueError:
        weight = math.nan
    if not (0 < weight < math.inf):
        raise KeyFileError(
            f"{where}: weight must be a number > 0, got {field[:40].decode('ascii', 'replace')!r}"
        )
    return weight


def _priority_range(field: bytes, where: str) -> tuple[int, int]:
    match = _PRIORITY_RE.fullmatch(field)
    low, high = (int(match[1]), int(match[2])) if match else (1, 0)
    if not (-_INT64 <= low <= high < _INT64):
        raise KeyFileError(
            f"{where}: priority=MIN..MAX takes two integers, MIN <= MAX, within a signed 64-bit range, "
            f"got {field[:60].decode('ascii', 'replace')!r}"
        )
    return low, high


def read_key_file(path: str) -> dict[bytes, Tenant]:
    try:
        with open(path, "rb") as fh:
            text = fh.read()
    except OSError as exc:
        raise KeyFileError(f"cannot read api_keys_file {path}: {exc.strerror}") from None
    return parse_key_file(text, path)


class ApiKeys:
    """The key table of one process: ``tenant(authorization)`` is the whole per-request cost."""

    def __init__(self, path: str | None, single_key: bytes | None) -> None:
        if path is None and not single_key:
            raise ValueError("ApiKeys needs a key file or a key")
        self.path = path
        self._single = single_key
        self._salt = secrets.token_bytes(32)
        self._table: dict[bytes, Tenant] = {}
        #: 401s answered (a scrape-time counter)
        self.refused = 0
        self._install(read_key_file(path) if path is not None else {single_key: Tenant(DEFAULT_TENANT)})  # type: ignore[dict-item]

    def _digest(self, key: bytes) -> bytes:
        return hashlib.blake2b(key, digest_size=32, key=self._salt).digest()

    def _install(self, keys: dict[bytes, Tenant]) -> None:
        self._table = {self._digest(key): tenant for key, tenant in keys.items()}

    @property
    def tenants(self) -> dict[str, Tenant]:
        """Every tenant named now, by name."""
        return {t.name: t for t in self._table.values()}

    def lookup(self, authorization: bytes | None) -> Tenant | None:
        """The tenant of a request's ``Authorization`` header, or None."""
        key = bearer_credentials(authorization)
        return self._table.get(self._digest(key)) if key is not None else None

    def tenant(self, authorization: bytes | None) -> Tenant | None:
        """:meth:`lookup`, counting the refusals (None: answer it 401)."""
        key = bearer_credentials(authorization)
        if key is not None:
            tenant = self._table.get(self._digest(key))
            if tenant is not None:
                return tenant
        self.refused += 1
        return None

    def reload(self) -> bool:
        """SIGHUP: re-read the key file. False (the keys in force kept, the reason logged) when it
        does not load; a single key from the environment has nothing to re-read."""
        if self.path is None:
            return True
        try:
            keys = read_key_file(self.path)
        except KeyFileError as exc:
            log.error("api_keys_file not reloaded, the previous keys stay in force: %s", exc)
            return False
        self._install(keys)
        log.info("api_keys_file reloaded: %d key(s), %d tenant(s)", len(keys), len(self.tenants))
        return True


def keys_from_config(config: KeySettings, registry: Registry) -> ApiKeys | None:
    """The orchestrator's key table (None: no key file, no key: /v1/* is open), its 401s counted."""
    if config.api_keys_file is None and not config.api_key:
        return None
    keys = ApiKeys(config.api_keys_file, config.api_key_bytes)
    registry.counter(
        "fastcore_orchestrator_unauthorized_total",
        "/v1/* requests answered 401 (no, malformed or unknown API key).",
        callback=lambda: keys.refused,
    )
    return keys


def metrics_access_for(config: KeySettings, keys: ApiKeys | None) -> MetricsAccess:
    """``/metrics``' rule: server/metrics_access.py's, or with ``metrics_requires_key`` the
    metrics token or a client API key."""
    if config.metrics_requires_key and keys is not None:
        return KeyedMetricsAccess(config.metrics_token_bytes, keys)
    return MetricsAccess(config.metrics_token_bytes)


class KeyedMetricsAccess(MetricsAccess):
    """``metrics_requires_key: true``: ``/metrics`` to a request bearing the metrics token or any
    client API key, from any address; loopback alone is not enough."""

    def __init__(self, token: bytes | None, keys: ApiKeys) -> None:
        super().__init__(token)
        self.keys = keys

    def refusal(self, authorization: bytes | None, peer: object) -> HTTPError | None:
        if self.token is not None and super().refusal(authorization, peer) is None:
            return None
        if self.keys.lookup(authorization) is not None:
            return None
        return HTTPError(
            401,
            "GET /metrics needs Authorization: Bearer <a client API key or the metrics token> "
            "(metrics_requires_key)",
            code="metrics_token_required",
            headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
        )


__all__ = [
    "ANONYMOUS",
    "API_KEY_ENV",
    "DEFAULT_TENANT",
    "UNAUTHORIZED_BODY",
    "UNAUTHORIZED_HEADERS",
    "ApiKeys",
    "KeyFileError",
    "KeyedMetricsAccess",
    "Tenant",
    "bearer_credentials",
    "keys_from_config",
    "metrics_access_for",
    "parse_key_file",
    "read_key_file",
]
