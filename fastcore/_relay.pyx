# cython: freethreading_compatible = False
"""Compiled twin of ``fastcore._relay_py``: the relay kernels, the orchestrator's whole work per body.

The pure twin states what each kernel does (it is the reference); these take the same decisions in
C: one scan (``fastcore._scan``, cimported) with a path set compiled at import, spans kept in C
arrays, small fields decoded from their bytes, each output built with one allocation from a table
of pieces (or, in the legs' pieces forms, handed on as that table: views of the bodies' long runs).
No Python object is made on the way but the results. The text they write is the pure twin's bytes, built
from ``fastcore.protocol``'s names.
"""

cimport cython
from cpython.buffer cimport PyBuffer_Release
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong
from cpython.memoryview cimport PyMemoryView_FromObject
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint8_t
from libc.stdlib cimport free, malloc
from libc.string cimport memchr, memcpy

from fastcore._codec cimport _check_b64
from fastcore._scan cimport (
    INLINE_FRAMES,
    INLINE_NODES,
    NOGIL_MIN_BYTES,
    Frame,
    Node,
    Scanner,
    _build_path_set,
    _get_body,
    _PathSet,
    _scan_begin,
    _scan_end,
    _scan_run,
    _span_of,
    _span_tuple,
    is_digit,
    skip_ws,
)

from json import loads as _json_loads

from fastcore import protocol as _protocol
from fastcore.errors import TokenDecodeError


cdef enum:
    N_CLIENT = 14  # len(CLIENT_REQUEST_PATHS)
    C_ROOT = 0
    C_MESSAGES = 1
    C_DISAGG = 2
    C_B64 = 3
    C_IDS = 4
    C_STREAM = 5
    C_STREAM_OPTIONS = 6
    C_PROMPT = 7
    C_LAST_MESSAGE = 8
    C_MODEL = 9
    C_MAX_TOKENS = 10
    C_MAX_COMPLETION_TOKENS = 11
    C_INCLUDE_USAGE = 12
    C_CONVERSATION_ID = 13
    N_CONTEXT = 14  # len(CONTEXT_RESPONSE_PATHS)
    X_ROOT = 0
    X_FINISH = 1
    X_DP = 2
    X_USAGE = 3
    X_IDS = 4
    X_B64 = 5
    X_REQUEST_TYPE = 6
    X_CTX_USAGE = 7
    X_FIRST_CHOICE = 8
    X_COMPLETION_TOKENS = 9
    X_CTX_INFO_ENDPOINT = 10
    X_ENCODED_OPAQUE_STATE = 11
    X_PROMPT_TOKENS = 12
    X_CACHED_TOKENS = 13
    STRIP_CHOICES = 8  # the choices the first strip scan covers
    MAX_PIECES = 32
    INLINE_MEMBERS = 2 + STRIP_CHOICES

import fastcore._relay_py as _py

for _name, _value in (
    ("C_ROOT", C_ROOT), ("C_MESSAGES", C_MESSAGES), ("C_DISAGG", C_DISAGG), ("C_B64", C_B64), ("C_IDS", C_IDS),
    ("C_STREAM", C_STREAM), ("C_STREAM_OPTIONS", C_STREAM_OPTIONS), ("C_PROMPT", C_PROMPT),
    ("C_LAST_MESSAGE", C_LAST_MESSAGE), ("C_MODEL", C_MODEL), ("C_MAX_TOKENS", C_MAX_TOKENS),
    ("C_MAX_COMPLETION_TOKENS", C_MAX_COMPLETION_TOKENS), ("C_INCLUDE_USAGE", C_INCLUDE_USAGE),
    ("C_CONVERSATION_ID", C_CONVERSATION_ID),
    ("X_ROOT", X_ROOT), ("X_FINISH", X_FINISH), ("X_DP", X_DP), ("X_USAGE", X_USAGE), ("X_IDS", X_IDS),
    ("X_B64", X_B64), ("X_REQUEST_TYPE", X_REQUEST_TYPE), ("X_CTX_USAGE", X_CTX_USAGE),
    ("X_FIRST_CHOICE", X_FIRST_CHOICE), ("X_COMPLETION_TOKENS", X_COMPLETION_TOKENS),
    ("X_CTX_INFO_ENDPOINT", X_CTX_INFO_ENDPOINT), ("X_ENCODED_OPAQUE_STATE", X_ENCODED_OPAQUE_STATE),
    ("X_PROMPT_TOKENS", X_PROMPT_TOKENS), ("X_CACHED_TOKENS", X_CACHED_TOKENS),
):
    if getattr(_py, _name) != _value:  # the twins index the same path tuples
        raise ImportError(f"fastcore._relay: {_name} differs from the pure twin's")
if len(_py.CLIENT_REQUEST_PATHS) != N_CLIENT or len(_py.CONTEXT_RESPONSE_PATHS) != N_CONTEXT:
    raise ImportError("fastcore._relay: the relay path tables differ from the pure twin's")

CLIENT_PATHS = _py.CLIENT_PATHS
CLIENT_REQUEST_PATHS = _py.CLIENT_REQUEST_PATHS
CONTEXT_PATHS = _py.CONTEXT_PATHS
CONTEXT_RESPONSE_PATHS = _py.CONTEXT_RESPONSE_PATHS
strip_paths = _py.strip_paths
VIEW_MIN = _py.VIEW_MIN

cdef _PathSet _CLIENT_SET = _build_path_set(_py.CLIENT_REQUEST_PATHS)
cdef _PathSet _CONTEXT_SET = _build_path_set(_py.CONTEXT_RESPONSE_PATHS)
cdef _PathSet _STRIP_SET = _build_path_set(_py.strip_paths(STRIP_CHOICES))
cdef dict _strip_sets = {STRIP_CHOICES: _STRIP_SET}
cdef int _MAX_INT_DIGITS = _py.MAX_INT_DIGITS
cdef int _MAX_COUNT_DIGITS = _py.MAX_COUNT_DIGITS
cdef Py_ssize_t _VIEW_MIN = _py.VIEW_MIN

cdef dict _FINISH_REASONS = _py.COMMON_FINISH_REASONS
# The wire text the kernels write: the pure twin's bytes, built from fastcore.protocol's names.
cdef bytes _STREAM_KEY = _py.STREAM_KEY
cdef bytes _STREAM_OPTIONS_KEY = _py.STREAM_OPTIONS_KEY
cdef bytes _CONTEXT_PARAMS_OPEN = _py.CONTEXT_PARAMS_OPEN
cdef bytes _ASK_B64 = _py.ASK_B64
cdef bytes _DISAGGREGATED_PARAMS_KEY = _py.DISAGGREGATED_PARAMS_KEY
cdef bytes _REQUEST_TYPE_KEY = _py.REQUEST_TYPE_KEY
cdef bytes _GENERATION_ONLY = _py.GENERATION_ONLY
cdef bytes _CTX_USAGE_KEY = _py.CTX_USAGE_KEY
cdef bytes _PROMPT_TOKEN_IDS_B64_KEY = _py.PROMPT_TOKEN_IDS_B64_KEY
cdef bytes _PROMPT_TOKEN_IDS_KEY = _py.PROMPT_TOKEN_IDS_KEY
cdef bytes _PROMPT_KEY = _py.PROMPT_KEY
cdef bytes _NULL = b"null"


cdef struct Piece:
    const char *p
    Py_ssize_t n


cdef inline void _add(Piece *pieces, int *count, const char *p, Py_ssize_t n) noexcept:
    if n > 0:
        pieces[count[0]].p = p
        pieces[count[0]].n = n
        count[0] += 1


cdef inline void _text(Piece *pieces, int *count, bytes text) noexcept:
    # ``text`` outlives the call: a module constant or a literal.
    _add(pieces, count, PyBytes_AS_STRING(text), PyBytes_GET_SIZE(text))


cdef bytes _join(Piece *pieces, int count):
    """The pieces concatenated: one allocation, one copy each."""
    cdef Py_ssize_t total = 0
    cdef int k
    cdef char *out
    for k in range(count):
        total += pieces[k].n
    result = PyBytes_FromStringAndSize(NULL, total)
    out = PyBytes_AS_STRING(result)
    if total >= NOGIL_MIN_BYTES:
        with nogil:
            for k in range(count):
                memcpy(out, pieces[k].p, pieces[k].n)
                out += pieces[k].n
    else:
        for k in range(count):
            memcpy(out, pieces[k].p, pieces[k].n)
            out += pieces[k].n
    return result


cdef inline bint _within(const Piece *piece, object data) noexcept:
    # The piece lies in the bytes ``data`` (``None``: in nothing).
    if data is None:
        return False
    cdef const char *start = PyBytes_AS_STRING(data)
    return start <= piece.p and piece.p + piece.n <= start + PyBytes_GET_SIZE(data)


cdef object _view(object base, object data, const Piece *piece):
    """``data[piece]`` as a slice of ``base``, a memoryview of the bytes ``data``."""
    cdef Py_ssize_t start = piece.p - PyBytes_AS_STRING(data)
    return base[start:start + piece.n]


cdef list _views(Piece *pieces, int count, object first, object second):
    """The pieces as a list for one vectored write: each run of ``first`` or ``second`` (bytes) of
    ``VIEW_MIN`` bytes or more as a memoryview of them, the pieces between joined into one ``bytes``
    (the new text, and runs too short to be worth a view)."""
    cdef object out = None, first_view = None, second_view = None
    cdef int k, small = 0
    for k in range(count):
        if pieces[k].n < _VIEW_MIN:
            continue
        if _within(&pieces[k], first):
            if first_view is None:
                first_view = PyMemoryView_FromObject(first)
            view = _view(first_view, first, &pieces[k])
        elif _within(&pieces[k], second):
            if second_view is None:
                second_view = PyMemoryView_FromObject(second)
            view = _view(second_view, second, &pieces[k])
        else:
            continue
        if out is None:
            out = []
        if small < k:
            out.append(_join(pieces + small, k - small))
        out.append(view)
        small = k + 1
    if out is None:  # nothing long enough to view (a short leg): one bytes, one small list
        return [_join(pieces, count)]
    if small < count:
        out.append(_join(pieces + small, count - small))
    return out


cdef object _as_bytes(object body):
    """``body`` itself if it is ``bytes``, else a copy (the pure twin's ``_as_bytes``, same errors)."""
    cdef Py_buffer view
    if isinstance(body, bytes):
        return body
    _get_body(body, &view)
    try:
        return PyBytes_FromStringAndSize(<const char *>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef inline const uint8_t *_data(object data) noexcept:
    return <const uint8_t *>PyBytes_AS_STRING(data)


cdef int _scan_spans(object data, _PathSet compiled, bint validate, bint members,
                     Py_ssize_t *starts, Py_ssize_t *ends) except -1:
    """One scan of the bytes ``data``; the span of each path of ``compiled`` into ``starts``/``ends``."""
    cdef Scanner s
    cdef Frame inline_frames[INLINE_FRAMES]
    cdef Node inline_nodes[INLINE_NODES]
    cdef Py_ssize_t i
    _scan_begin(&s, compiled, _data(data), PyBytes_GET_SIZE(data), validate, inline_frames, inline_nodes)
    try:
        _scan_run(&s, compiled)
        for i in range(compiled.n_paths):
            _span_of(&s, compiled, i, members, &starts[i], &ends[i])
    finally:
        _scan_end(&s, inline_nodes)
    return 0


cdef inline bint _is_empty(const uint8_t *buf, Py_ssize_t start, Py_ssize_t end) noexcept:
    # The container at [start, end) holds only blanks (its span was validated).
    return skip_ws(buf, start + 1, end) == end - 1


cdef inline bint _is_number(uint8_t first) noexcept:
    return first == 0x2D or is_digit(first)


cdef inline bint _integral(const uint8_t *buf, Py_ssize_t start, Py_ssize_t end) noexcept:
    # A valid JSON number is an integer unless it has a fraction or an exponent.
    cdef Py_ssize_t k
    for k in range(start, end):
        if buf[k] == 0x2E or buf[k] == 0x65 or buf[k] == 0x45:
            return False
    return True


cdef object _int_of(object data, const uint8_t *buf, Py_ssize_t start, Py_ssize_t end):
    # The integer spelled by the (valid, integral, at most 20-digit) number at [start, end).
    cdef bint negative = buf[start] == 0x2D
    cdef Py_ssize_t k = start + negative
    cdef long long value = 0
    if end - k > 18:
        return int(data[start:end])
    while k < end:
        value = value * 10 + (buf[k] - 0x30)
        k += 1
    return PyLong_FromLongLong(-value if negative else value)


cdef object _count_at(const uint8_t *buf, Py_ssize_t start, Py_ssize_t end):
    """The pure twin's ``_count_at``: 1 to MAX_COUNT_DIGITS ASCII digits, or ``None``."""
    if start < 0 or end - start > _MAX_COUNT_DIGITS or end <= start:
        return None
    cdef long long value = 0
    cdef Py_ssize_t k
    for k in range(start, end):
        if not is_digit(buf[k]):
            return None
        value = value * 10 + (buf[k] - 0x30)
    return PyLong_FromLongLong(value)


cdef object _int_at(object data, const uint8_t *buf, Py_ssize_t start, Py_ssize_t end):
    """The pure twin's ``_int_at``: the integer at the span, or ``None``."""
    if start < 0:
        return None
    cdef uint8_t first = buf[start]
    if not _is_number(first) or end - start - (first == 0x2D) > _MAX_INT_DIGITS:
        return None
    if not _integral(buf, start, end):
        return None
    return _int_of(data, buf, start, end)


cdef object _max_tokens_at(object data, const uint8_t *buf, Py_ssize_t start, Py_ssize_t end, str key):
    if start < 0:
        return None
    cdef uint8_t first = buf[start]
    if _is_number(first):
        if end - start - (first == 0x2D) > _MAX_INT_DIGITS:
            raise _py.too_many_digits(key)
        if _integral(buf, start, end):
            return _int_of(data, buf, start, end)
    elif first == 0x6E:  # null
        return None
    raise _py.must_be(key, _py.AN_INTEGER)


cdef int _bool_at(const uint8_t *buf, Py_ssize_t start, str key) except -1:
    """0 false, 1 true, 2 absent or null; else the RelayError."""
    if start < 0:
        return 2
    cdef uint8_t first = buf[start]
    if first == 0x74:
        return 1
    if first == 0x66:
        return 0
    if first == 0x6E:
        return 2
    raise _py.must_be(key, _py.A_BOOLEAN)


cdef object _str_at(object data, const uint8_t *buf, Py_ssize_t start, Py_ssize_t end, str key):
    if start < 0:
        return None
    cdef uint8_t first = buf[start]
    if first == 0x6E:
        return None
    if first != 0x22:
        raise _py.must_be(key, _py.A_STRING)
    if memchr(buf + start + 1, 0x5C, end - start - 2) == NULL:
        return PyUnicode_DecodeUTF8(<const char *>buf + start + 1, end - start - 2, NULL)  # UTF-8 checked
    return _json_loads(data[start:end])  # escapes: a short string, the stdlib decodes them right


cdef tuple _spans_tuple(const Py_ssize_t *starts, const Py_ssize_t *ends, Py_ssize_t count):
    return tuple([_span_tuple(starts[i], ends[i]) for i in range(count)])


@cython.no_gc  # holds bytes, str and int only: never in a reference cycle
@cython.auto_pickle(False)
cdef class _Scan:
    """Equality, no hash, and the repr of the pure twin's scans (over the same ``_FIELDS``)."""

    def _relay_key(self):
        return tuple([getattr(self, name) for name in self._FIELDS])

    def __eq__(self, other):
        # Equal across the twins: the pure twin's scans have the same _relay_key.
        key = getattr(other, "_relay_key", None)
        if key is None or type(other).__name__ != type(self).__name__:
            return NotImplemented
        return self._relay_key() == key()

    __hash__ = None

    def __repr__(self):
        fields = ", ".join([f"{name}={getattr(self, name)!r}" for name in self._FIELDS if name != "body"])
        return f"{type(self).__name__}({fields})"


@cython.no_gc
@cython.auto_pickle(False)
cdef class ClientScan(_Scan):
    """A client body read by :func:`read_client_request` (see the pure twin's ``ClientScan``)."""

    _FIELDS = _py.ClientScan._FIELDS

    cdef readonly object body
    cdef readonly bint chat
    cdef readonly bint empty
    cdef readonly bint stream
    cdef readonly bint include_usage
    cdef readonly object max_tokens
    cdef readonly object model
    cdef Py_ssize_t starts[N_CLIENT]
    cdef Py_ssize_t ends[N_CLIENT]

    @property
    def spans(self):
        return _spans_tuple(self.starts, self.ends, N_CLIENT)

    @property
    def has_conversation_id(self):
        """A top-level ``conversation_id`` (see the pure twin)."""
        return self.starts[C_CONVERSATION_ID] >= 0

    @property
    def prompt_bytes(self):
        """The bytes of the prompt's span (see the pure twin)."""
        cdef int field = C_MESSAGES if self.chat else C_PROMPT
        if self.starts[field] < 0:
            return 0
        return self.ends[field] - self.starts[field]



@cython.no_gc
@cython.auto_pickle(False)
cdef class ContextScan(_Scan):
    """A context response read by :func:`read_context_response` (see the pure twin's ``ContextScan``)."""

    _FIELDS = _py.ContextScan._FIELDS

    cdef readonly object body
    cdef readonly object finish_reason
    cdef readonly bint finished
    cdef Py_ssize_t starts[N_CONTEXT]
    cdef Py_ssize_t ends[N_CONTEXT]

    @property
    def spans(self):
        return _spans_tuple(self.starts, self.ends, N_CONTEXT)

    def auth_fields(self):
        """``ctx_info_endpoint`` and ``encoded_opaque_state`` of ``choices[0].disaggregated_params``,
        decoded when asked (see the pure twin)."""
        return (self._json_at(X_CTX_INFO_ENDPOINT), self._json_at(X_ENCODED_OPAQUE_STATE))

    def usage_tokens(self):
        """``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens`` (see the pure twin)."""
        cdef const uint8_t *buf = _data(self.body)
        return (_count_at(buf, self.starts[X_PROMPT_TOKENS], self.ends[X_PROMPT_TOKENS]),
                _count_at(buf, self.starts[X_CACHED_TOKENS], self.ends[X_CACHED_TOKENS]))

    cdef object _json_at(self, int index):
        if self.starts[index] < 0:
            return None
        return _json_loads(self.body[self.starts[index]:self.ends[index]])



def read_client_request(body, chat):
    """Validate a client body and read what the orchestrator needs of it, in one pass (see the pure twin)."""
    cdef object data = _as_bytes(body)
    cdef const uint8_t *buf = _data(data)
    cdef ClientScan out = ClientScan.__new__(ClientScan)
    cdef Py_ssize_t *st = out.starts
    cdef Py_ssize_t *en = out.ends
    cdef bint is_chat = chat
    cdef int stream, include_usage = 2
    cdef uint8_t first
    cdef str key
    _scan_spans(data, _CLIENT_SET, True, False, st, en)
    if buf[st[C_ROOT]] != 0x7B:
        raise _py.not_an_object(_py.REQUEST_BODY)
    if st[C_DISAGG] >= 0 or st[C_B64] >= 0 or st[C_IDS] >= 0:
        # One of them is there: the one rule (which are internal on which route) decides.
        _py.check_internal_fields(_spans_tuple(st, en, N_CLIENT), is_chat)
    stream = _bool_at(buf, st[C_STREAM], _protocol.STREAM)
    if st[C_STREAM_OPTIONS] >= 0:
        first = buf[st[C_STREAM_OPTIONS]]
        if first == 0x7B:
            include_usage = _bool_at(buf, st[C_INCLUDE_USAGE], _protocol.INCLUDE_USAGE)
        elif first != 0x6E:
            raise _py.must_be(_protocol.STREAM_OPTIONS, _py.AN_OBJECT)
    out.model = _str_at(data, buf, st[C_MODEL], en[C_MODEL], _protocol.MODEL)
    if is_chat:
        if st[C_LAST_MESSAGE] < 0:  # absent, not an array, or empty
            raise _py.must_be(_protocol.MESSAGES, _py.A_NON_EMPTY_ARRAY)
        completion = _max_tokens_at(data, buf, st[C_MAX_COMPLETION_TOKENS], en[C_MAX_COMPLETION_TOKENS],
                                    "max_completion_tokens")
        tokens = _max_tokens_at(data, buf, st[C_MAX_TOKENS], en[C_MAX_TOKENS], "max_tokens")
        if completion is not None:
            key, value = "max_completion_tokens", completion
        else:
            key, value = "max_tokens", tokens
    else:
        if st[C_PROMPT] < 0 or (buf[st[C_PROMPT]] != 0x22 and buf[st[C_PROMPT]] != 0x5B):
            raise _py.must_be(_protocol.PROMPT, _py.A_STRING_OR_ARRAY)
        key, value = "max_tokens", _max_tokens_at(data, buf, st[C_MAX_TOKENS], en[C_MAX_TOKENS], "max_tokens")
    if value is not None and value < 1:
        raise _py.below_one(key, value)
    out.body = data
    out.chat = is_chat
    out.empty = _is_empty(buf, st[C_ROOT], en[C_ROOT])
    out.stream = stream == 1
    out.include_usage = include_usage == 1
    out.max_tokens = value
    return out


cdef ClientScan _client_scan(object client):
    if type(client) is not ClientScan:
        raise _py.not_a_scan("client", "ClientScan", client)
    return <ClientScan>client


cdef ContextScan _context_scan(object context):
    if type(context) is not ContextScan:
        raise _py.not_a_scan("context", "ContextScan", context)
    return <ContextScan>context


cdef int _decimal(long long value, char *out) noexcept:
    """``value`` in decimal into ``out`` (at least 20 bytes); the length."""
    cdef char scratch[24]
    cdef int length = 0, k
    cdef unsigned long long magnitude = <unsigned long long>value
    if value < 0:
        magnitude = 0 - magnitude
    while True:
        scratch[length] = <char>(0x30 + magnitude % 10)
        length += 1
        magnitude //= 10
        if magnitude == 0:
            break
    k = 0
    if value < 0:
        out[0] = 0x2D
        k = 1
    while length:
        length -= 1
        out[k] = scratch[length]
        k += 1
    return k


def context_request(client, disagg_request_id, return_b64):
    """Leg (1) from a read client body (see the pure twin): the join of its pieces."""
    return _context(client, disagg_request_id, return_b64, False)


def context_request_pieces(client, disagg_request_id, return_b64):
    """Leg (1) as pieces for one vectored write (see the pure twin): the client body's runs of
    ``VIEW_MIN`` bytes or more as memoryviews of ``client.body`` (each holds a reference to those
    immutable bytes), the rest joined into small ``bytes``. Hold them until the write is done."""
    return _context(client, disagg_request_id, return_b64, True)


cdef object _context(object client, object disagg_request_id, object return_b64, bint as_pieces):
    cdef ClientScan c = _client_scan(client)
    cdef Piece pieces[MAX_PIECES]
    cdef int count, overflow = 0, length
    cdef long long request_id
    cdef char digits[32]
    cdef const char *id_text
    if isinstance(disagg_request_id, bool) or not isinstance(disagg_request_id, int):
        raise _py.not_an_id()
    request_id = PyLong_AsLongLongAndOverflow(disagg_request_id, &overflow)
    if overflow:
        big = b"%d" % disagg_request_id
        id_text = <const char *>PyBytes_AS_STRING(big)
        length = <int>PyBytes_GET_SIZE(big)
    else:
        length = _decimal(request_id, digits)
        id_text = digits
    # The pieces point into the body, module constants and id_text (digits or big: alive to here).
    count = _context_pieces(c, id_text, length, return_b64, pieces)
    return _views(pieces, count, c.body, None) if as_pieces else _join(pieces, count)


cdef int _context_pieces(ClientScan c, const char *id_text, int length, bint return_b64,
                         Piece *pieces) noexcept:
    """Leg (1)'s pieces into ``pieces`` (``MAX_PIECES``); their count."""
    cdef int count = 0
    cdef const char *buf = PyBytes_AS_STRING(c.body)
    cdef Py_ssize_t previous = 0, at
    # stream and stream_options come before the root's end and after each other in body order.
    if c.starts[C_STREAM] >= 0 and c.starts[C_STREAM_OPTIONS] >= 0 and c.starts[C_STREAM_OPTIONS] < c.starts[C_STREAM]:
        _add(pieces, &count, buf, c.starts[C_STREAM_OPTIONS])
        _text(pieces, &count, _NULL)
        _add(pieces, &count, buf + c.ends[C_STREAM_OPTIONS], c.starts[C_STREAM] - c.ends[C_STREAM_OPTIONS])
        _text(pieces, &count, b"false")
        previous = c.ends[C_STREAM]
    else:
        if c.starts[C_STREAM] >= 0:
            _add(pieces, &count, buf, c.starts[C_STREAM])
            _text(pieces, &count, b"false")
            previous = c.ends[C_STREAM]
        if c.starts[C_STREAM_OPTIONS] >= 0:
            _add(pieces, &count, buf + previous, c.starts[C_STREAM_OPTIONS] - previous)
            _text(pieces, &count, _NULL)
            previous = c.ends[C_STREAM_OPTIONS]
    at = c.ends[C_ROOT] - 1
    _add(pieces, &count, buf + previous, at - previous)
    if not c.empty:
        _text(pieces, &count, b",")
    if c.starts[C_STREAM] < 0:
        _text(pieces, &count, _STREAM_KEY)
        _text(pieces, &count, b"false,")
    if c.starts[C_STREAM_OPTIONS] < 0:
        _text(pieces, &count, _STREAM_OPTIONS_KEY)
        _text(pieces, &count, b"null,")
    _text(pieces, &count, _CONTEXT_PARAMS_OPEN)
    _add(pieces, &count, id_text, length)
    if return_b64:
        _text(pieces, &count, _ASK_B64)
    _text(pieces, &count, b"}")
    _add(pieces, &count, buf + at, PyBytes_GET_SIZE(c.body) - at)
    return count


def read_context_response(body, max_tokens):
    """Validate a context response and decide whether a generation leg follows (see the pure twin)."""
    cdef object data = _as_bytes(body)
    cdef const uint8_t *buf = _data(data)
    cdef ContextScan out = ContextScan.__new__(ContextScan)
    cdef Py_ssize_t *st = out.starts
    cdef Py_ssize_t *en = out.ends
    cdef Py_ssize_t start, end
    cdef bint follows = False, length = False
    _scan_spans(data, _CONTEXT_SET, True, False, st, en)
    if buf[st[X_ROOT]] != 0x7B:
        raise _py.context_refusal(_py.CTX_NOT_AN_OBJECT)
    finish_reason = None
    start = st[X_FINISH]
    end = en[X_FINISH]
    if start >= 0:
        finish_reason = _FINISH_REASONS.get(PyBytes_FromStringAndSize(<const char *>buf + start, end - start), data)
        if finish_reason is data:  # not one of the common ones
            if buf[start] != 0x22:
                raise _py.context_refusal(_py.CTX_FINISH_NOT_A_STRING, _protocol.FINISH_REASON)
            finish_reason = _json_loads(data[start:end])  # a short string with escapes
        length = finish_reason == _protocol.FINISH_LENGTH
        follows = length or finish_reason == _protocol.FINISH_NOT_FINISHED
    if st[X_FIRST_CHOICE] < 0:
        raise _py.no_first_choice()
    if length and max_tokens is not None:
        completion_tokens = _int_at(data, buf, st[X_COMPLETION_TOKENS], en[X_COMPLETION_TOKENS])
        if completion_tokens is not None:
            follows = completion_tokens < max_tokens
    if follows and (st[X_DP] < 0 or buf[st[X_DP]] != 0x7B):
        raise _py.lacks_params()
    out.body = data
    out.finish_reason = finish_reason
    out.finished = not follows
    return out


cdef void _add_generation_params(Piece *pieces, int *counter, ContextScan x, const char *usage,
                                 Py_ssize_t usage_len) noexcept:
    """Leg (3)'s disaggregated_params: the context leg's, with request_type generation_only and
    ctx_usage the context leg's usage, each replaced where present and added where not."""
    cdef const char *ctx = PyBytes_AS_STRING(x.body)
    cdef Py_ssize_t dp0 = x.starts[X_DP], dp1 = x.ends[X_DP], previous
    cdef Py_ssize_t rt0 = x.starts[X_REQUEST_TYPE], rt1 = x.ends[X_REQUEST_TYPE]
    cdef Py_ssize_t cu0 = x.starts[X_CTX_USAGE], cu1 = x.ends[X_CTX_USAGE]
    cdef int count = counter[0]
    previous = dp0
    if rt0 >= 0 and cu0 >= 0 and cu0 < rt0:
        _add(pieces, &count, ctx + previous, cu0 - previous)
        _add(pieces, &count, usage, usage_len)
        _add(pieces, &count, ctx + cu1, rt0 - cu1)
        _text(pieces, &count, _GENERATION_ONLY)
        previous = rt1
    else:
        if rt0 >= 0:
            _add(pieces, &count, ctx + previous, rt0 - previous)
            _text(pieces, &count, _GENERATION_ONLY)
            previous = rt1
        if cu0 >= 0:
            _add(pieces, &count, ctx + previous, cu0 - previous)
            _add(pieces, &count, usage, usage_len)
            previous = cu1
    if rt0 >= 0 and cu0 >= 0:
        _add(pieces, &count, ctx + previous, dp1 - previous)
    else:
        _add(pieces, &count, ctx + previous, dp1 - 1 - previous)
        if not _is_empty(<const uint8_t *>ctx, dp0, dp1):
            _text(pieces, &count, b",")
        if rt0 < 0:
            _text(pieces, &count, _REQUEST_TYPE_KEY)
            _text(pieces, &count, _GENERATION_ONLY)
            if cu0 < 0:
                _text(pieces, &count, b",")
        if cu0 < 0:
            _text(pieces, &count, _CTX_USAGE_KEY)
            _add(pieces, &count, usage, usage_len)
        _text(pieces, &count, b"}")
    counter[0] = count


def generation_request(client, context, tokids_b64, strip_history):
    """Leg (3) from a read client body and context response (see the pure twin): the join of its pieces."""
    return _generation(client, context, tokids_b64, strip_history, False)


def generation_request_pieces(client, context, tokids_b64, strip_history):
    """Leg (3) as pieces for one vectored write (see the pure twin): the runs of ``VIEW_MIN`` bytes
    or more of the client body and the context response (the prompt ids among them) as memoryviews
    of ``client.body`` and ``context.body`` (each holds a reference to those immutable bytes), the
    rest joined into small ``bytes``. Hold them until the write is done."""
    return _generation(client, context, tokids_b64, strip_history, True)


cdef object _generation(object client, object context, object tokids_b64, object strip_history,
                        bint as_pieces):
    cdef ClientScan c = _client_scan(client)
    cdef ContextScan x = _context_scan(context)
    cdef Piece pieces[MAX_PIECES]
    cdef int count = 0
    cdef const char *body = PyBytes_AS_STRING(c.body)
    cdef const char *ctx = PyBytes_AS_STRING(x.body)
    cdef const uint8_t *cbuf = <const uint8_t *>ctx
    cdef Py_ssize_t previous = 0, at = c.ends[C_ROOT] - 1, dp0 = x.starts[X_DP]
    cdef Py_ssize_t u0 = x.starts[X_USAGE], u1 = x.ends[X_USAGE], ids0 = -1, ids1 = -1, p
    cdef const char *usage = PyBytes_AS_STRING(_NULL)
    cdef Py_ssize_t usage_len = PyBytes_GET_SIZE(_NULL)
    cdef bint gate_b64 = tokids_b64, strip = strip_history, replace_prompt = False
    if dp0 < 0 or cbuf[dp0] != 0x7B:
        raise _py.context_refusal(_py.CTX_NO_PARAMS_OBJECT, _protocol.DISAGGREGATED_PARAMS)
    if gate_b64:
        ids0 = x.starts[X_B64]
        ids1 = x.ends[X_B64]
        # The list fallback (see the pure twin's _token_b64): no b64 string (absent or null) but the list.
        if (ids0 < 0 or cbuf[ids0] == 0x6E) and x.starts[X_IDS] >= 0 and cbuf[x.starts[X_IDS]] == 0x5B:
            gate_b64 = False
        elif ids0 < 0 or cbuf[ids0] != 0x22:
            raise _py.context_refusal(_py.CTX_NO_B64, _protocol.PROMPT_TOKEN_IDS_B64)
        else:
            try:
                _check_b64(cbuf, ids0 + 1, ids1 - 1)
            except TokenDecodeError as exc:
                raise _py.bad_b64(exc) from exc
    if not gate_b64:
        ids0 = x.starts[X_IDS]
        ids1 = x.ends[X_IDS]
        if ids0 < 0 or cbuf[ids0] != 0x5B:
            raise _py.context_refusal(_py.CTX_NO_IDS, _protocol.PROMPT_TOKEN_IDS)
        replace_prompt = not c.chat and c.starts[C_PROMPT] >= 0
    if u0 >= 0:
        usage = ctx + u0
        usage_len = u1 - u0
    # The client body up to the insertion point, with its edits: the prompt replaced by the ids
    # (completions, id list), or messages cut to their last element.
    if replace_prompt:
        _add(pieces, &count, body, c.starts[C_PROMPT])
        _add(pieces, &count, ctx + ids0, ids1 - ids0)
        previous = c.ends[C_PROMPT]
    elif strip and c.chat and c.starts[C_MESSAGES] >= 0 and c.starts[C_LAST_MESSAGE] >= 0:
        _add(pieces, &count, body, c.starts[C_MESSAGES])
        _text(pieces, &count, b"[")
        _add(pieces, &count, body + c.starts[C_LAST_MESSAGE], c.ends[C_LAST_MESSAGE] - c.starts[C_LAST_MESSAGE])
        _text(pieces, &count, b"]")
        previous = c.ends[C_MESSAGES]
    _add(pieces, &count, body + previous, at - previous)
    if not c.empty:
        _text(pieces, &count, b",")
    _text(pieces, &count, _DISAGGREGATED_PARAMS_KEY)
    _add_generation_params(pieces, &count, x, usage, usage_len)
    if gate_b64:
        _text(pieces, &count, b",")
        _text(pieces, &count, _PROMPT_TOKEN_IDS_B64_KEY)
        _add(pieces, &count, ctx + ids0, ids1 - ids0)
    elif not replace_prompt:
        _text(pieces, &count, b",")
        _text(pieces, &count, _PROMPT_TOKEN_IDS_KEY if c.chat else _PROMPT_KEY)
        _add(pieces, &count, ctx + ids0, ids1 - ids0)
    _add(pieces, &count, body + at, PyBytes_GET_SIZE(c.body) - at)
    return _views(pieces, count, c.body, x.body) if as_pieces else _join(pieces, count)


cdef _PathSet _strip_set(Py_ssize_t choices):
    compiled = _strip_sets.get(choices)
    if compiled is None:
        compiled = _strip_sets[choices] = _build_path_set(_py.strip_paths(choices))
    return <_PathSet>compiled


cdef inline bint _separator_only(const uint8_t *buf, Py_ssize_t i, Py_ssize_t end) noexcept:
    # buf[i:end] is exactly [ \t\n\r]*,[ \t\n\r]*
    i = skip_ws(buf, i, end)
    if i >= end or buf[i] != 0x2C:
        return False
    return skip_ws(buf, i + 1, end) == end


cdef inline Py_ssize_t _sorted_members(Py_ssize_t *st, Py_ssize_t *en, Py_ssize_t paths) noexcept:
    """strip_internal_fields' members to cut (key-to-value spans; path 0 is the body, 3 the choices
    array), sorted, compacted into ``st``/``en`` from index 0; their count."""
    cdef Py_ssize_t count = 0, i, j, start, end
    for i in range(1, paths):
        if i == 3 or st[i] < 0:
            continue
        start = st[i]
        end = en[i]
        j = count
        while j > 0 and (st[j - 1] > start or (st[j - 1] == start and en[j - 1] > end)):
            st[j] = st[j - 1]
            en[j] = en[j - 1]
            j -= 1
        st[j] = start
        en[j] = end
        count += 1
    return count


cdef inline Py_ssize_t _cut_runs(const uint8_t *buf, Py_ssize_t n, Py_ssize_t *st, Py_ssize_t *en,
                                 Py_ssize_t count) noexcept:
    """The ``count`` sorted members as runs to cut, in ``st``/``en`` from index 0: adjacent members
    of one object as one run, each with exactly the comma it leaves (the one after it, or, the last
    member, before it); their count."""
    cdef Py_ssize_t runs = 0, i, start, end, after, comma
    for i in range(count):
        if runs and _separator_only(buf, en[runs - 1], st[i]):
            en[runs - 1] = en[i]
        else:
            st[runs] = st[i]
            en[runs] = en[i]
            runs += 1
    for i in range(runs):
        start = st[i]
        end = en[i]
        after = skip_ws(buf, end, n)
        if buf[after] == 0x2C:
            end = skip_ws(buf, after + 1, n)
        else:
            comma = start - 1
            while comma >= 0 and buf[comma] != 0x2C:
                comma -= 1
            if comma >= 0 and skip_ws(buf, comma + 1, start) == start:
                start = comma
        st[i] = start
        en[i] = end
    return runs


def strip_internal_fields(body, validate=True):
    """``body`` without the internal fields (see the pure twin)."""
    cdef object data = _as_bytes(body)
    cdef const uint8_t *buf = _data(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t choices = STRIP_CHOICES, count, i, runs, previous
    cdef Py_ssize_t inline_starts[INLINE_MEMBERS + 2]
    cdef Py_ssize_t inline_ends[INLINE_MEMBERS + 2]
    cdef Py_ssize_t *st = inline_starts
    cdef Py_ssize_t *en = inline_ends
    cdef _PathSet compiled = _STRIP_SET
    cdef bint check = validate
    cdef Piece inline_pieces[INLINE_MEMBERS + 1]
    cdef Piece *pieces = inline_pieces
    cdef int pieces_count = 0
    try:
        while True:
            _scan_spans(data, compiled, check, True, st, en)
            if st[3] < 0:
                break
            choices *= 4  # more choices than asked for: rare (n > 8), scan again
            compiled = _strip_set(choices)
            if st != inline_starts:
                free(st)
                free(en)
            st = <Py_ssize_t *>malloc(compiled.n_paths * sizeof(Py_ssize_t))
            en = <Py_ssize_t *>malloc(compiled.n_paths * sizeof(Py_ssize_t))
            if st == NULL or en == NULL:
                raise MemoryError()
        if buf[st[0]] != 0x7B:
            raise _py.not_an_object(_py.RESPONSE_BODY)
        count = _sorted_members(st, en, compiled.n_paths)
        if count == 0:
            return data
        runs = _cut_runs(buf, n, st, en, count)
        if runs + 1 > INLINE_MEMBERS + 1:
            pieces = <Piece *>malloc((runs + 1) * sizeof(Piece))
            if pieces == NULL:
                raise MemoryError()
        previous = 0
        for i in range(runs):
            if st[i] < previous:  # as splice would refuse these edits
                raise ValueError(f"edit {i}: starts at {st[i]}, before the previous edit ends ({previous})")
            _add(pieces, &pieces_count, <const char *>buf + previous, st[i] - previous)
            previous = en[i]
        _add(pieces, &pieces_count, <const char *>buf + previous, n - previous)
        return _join(pieces, pieces_count)
    finally:
        if st != inline_starts:
            free(st)
            free(en)
        if pieces != inline_pieces:
            free(pieces)
