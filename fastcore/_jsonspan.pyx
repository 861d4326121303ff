# cython: freethreading_compatible = False
"""Compiled twin of ``fastcore._jsonspan_py``: the JSON span scanner.

The same state machine, byte for byte, in C without the GIL: identical spans,
exceptions, messages and offsets on every input (the pure-Python twin's
docstring states the semantics; its ``_compile`` and ``make_error`` are
reused here so paths and errors cannot drift apart). The long runs that
dominate our bodies (string contents, base64 data) are consumed 16 bytes at
a time with SSE2, the x86-64 baseline; other targets take the scalar loop.

The relay kernels at the end (``read_client_request``, ``context_request``,
``read_context_response``, ``generation_request``, ``strip_internal_fields``)
are the orchestrator's whole per-body work, each one call: a scan with a path
set compiled at import, spans in C arrays, small fields decoded from their
bytes, outputs assembled with one allocation.
"""

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_INCREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint8_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memchr, memcmp, memcpy

from fastcore._jsonspan cimport Frame, Node, Scanner

from fastcore._jsonspan_py import _compile, make_error
from fastcore.errors import TokenDecodeError
from fastcore.limits import JSON_MAX_DEPTH, JSON_MAX_NUMBER_CHARS



fc_js_init()

#: The string kernel this CPU runs: ``"avx2"``, ``"sse2"`` or ``"scalar"``.
KERNEL = fc_js_kernel().decode()


def _set_kernel(name):
    """Tests only: force ``"avx2"`` (if supported) or the ``"sse2"`` fallback."""
    global KERNEL, fc_js_avx2
    fc_js_init()
    if name == "sse2":
        fc_js_avx2 = False
    elif name != "avx2" or not fc_js_avx2:
        raise ValueError(f"kernel {name!r} is not available here")
    KERNEL = fc_js_kernel().decode()


# Status codes: the same numbers as _jsonspan_py's E_* constants.
cdef enum:
    E_EOF = 1
    E_VALUE = 2
    E_OBJECT_SEPARATOR = 3
    E_ARRAY_SEPARATOR = 4
    E_KEY = 5
    E_COLON = 6
    E_TRAILING = 7
    E_CONTROL = 8
    E_ESCAPE = 9
    E_UNICODE_ESCAPE = 10
    E_UTF8 = 11
    E_DIGIT = 12
    E_LITERAL = 13
    E_DUPLICATE_KEY = 14
    E_DEPTH = 15
    E_NUMBER_LENGTH = 16
    E_NO_MEMORY = 100

cdef enum:
    INLINE_FRAMES = 64
    INLINE_NODES = 32
    # Below this size releasing the GIL costs more than it frees.
    NOGIL_MIN_BYTES = 65536
    PATH_CACHE_SIZE = 256

# fastcore.limits, read once: the frame stack never grows past _MAX_DEPTH frames.
cdef Py_ssize_t _MAX_DEPTH = JSON_MAX_DEPTH
cdef Py_ssize_t _MAX_NUMBER_CHARS = JSON_MAX_NUMBER_CHARS
if _MAX_DEPTH < 1 or _MAX_NUMBER_CHARS < 1:
    raise ImportError("fastcore.limits: JSON_MAX_DEPTH and JSON_MAX_NUMBER_CHARS must be positive")


# -- small scanners ----------------------------------------------------------------------------------

cdef inline int fail(Scanner *s, int code, Py_ssize_t offset) noexcept nogil:
    s.error_offset = offset
    return code


cdef inline Py_ssize_t skip_ws(const uint8_t *buf, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    cdef uint8_t c
    while i < n:
        c = buf[i]
        if c != 0x20 and c != 0x0A and c != 0x0D and c != 0x09:
            break
        i += 1
    return i


cdef inline bint is_digit(uint8_t c) noexcept nogil:
    return 0x30 <= c <= 0x39


cdef inline int hex_value(uint8_t c) noexcept nogil:
    if 0x30 <= c <= 0x39:
        return c - 0x30
    if 0x61 <= c <= 0x66:
        return c - 0x61 + 10
    if 0x41 <= c <= 0x46:
        return c - 0x41 + 10
    return -1


cdef inline Py_ssize_t utf8_sequence(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """Length of the well-formed UTF-8 sequence at ``i`` (lead >= 0x80), or 0.

    RFC 3629: no overlongs, no encoded surrogates, nothing above U+10FFFF;
    a sequence cut short by the end of data is ill-formed.
    """
    cdef uint8_t c = p[i], c1
    if c < 0xC2:
        return 0
    if c < 0xE0:
        return 2 if i + 1 < n and (p[i + 1] & 0xC0) == 0x80 else 0
    if c < 0xF0:
        if i + 2 >= n:
            return 0
        c1 = p[i + 1]
        if (c1 & 0xC0) != 0x80 or (c == 0xE0 and c1 < 0xA0) or (c == 0xED and c1 >= 0xA0):
            return 0
        return 3 if (p[i + 2] & 0xC0) == 0x80 else 0
    if c < 0xF5:
        if i + 3 >= n:
            return 0
        c1 = p[i + 1]
        if (c1 & 0xC0) != 0x80 or (c == 0xF0 and c1 < 0x90) or (c == 0xF4 and c1 >= 0x90):
            return 0
        return 4 if (p[i + 2] & 0xC0) == 0x80 and (p[i + 3] & 0xC0) == 0x80 else 0
    return 0


cdef int scan_string_rest(Scanner *s, Py_ssize_t i, Py_ssize_t *end, bint *escaped) noexcept nogil:
    """scan_string from ``i``, where the run of plain bytes after the opening quote stopped."""
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t n = s.n, k, length
    cdef uint8_t c, e
    if not s.validate:
        while True:
            if i >= n:
                return fail(s, E_EOF, n)
            if buf[i] == 0x22:
                end[0] = i + 1
                return 0
            escaped[0] = True
            if i + 1 >= n:
                return fail(s, E_EOF, n)
            i = fc_js_quote_or_backslash(buf, i + 2, n)
    while True:
        if i >= n:
            return fail(s, E_EOF, n)
        c = buf[i]
        if c == 0x22:
            end[0] = i + 1
            return 0
        if c >= 0x80:
            length = utf8_sequence(buf, i, n)
            if length == 0:
                return fail(s, E_UTF8, i)
            i = fc_js_plain_run(buf, i + length, n)
            continue
        if c != 0x5C:
            return fail(s, E_CONTROL, i)
        escaped[0] = True
        if i + 1 >= n:
            return fail(s, E_EOF, n)
        e = buf[i + 1]
        if e == 0x22 or e == 0x5C or e == 0x2F or e == 0x62 or e == 0x66 or e == 0x6E or e == 0x72 or e == 0x74:
            i += 2
        elif e == 0x75:  # 'u'
            for k in range(i + 2, i + 6):
                if k >= n:
                    return fail(s, E_EOF, n)
                if hex_value(buf[k]) < 0:
                    return fail(s, E_UNICODE_ESCAPE, i)
            i += 6
        else:
            return fail(s, E_ESCAPE, i)
        i = fc_js_plain_run(buf, i, n)


cdef inline int scan_string(Scanner *s, const uint8_t *buf, Py_ssize_t n, bint validate, Py_ssize_t pos,
                            Py_ssize_t *end, bint *escaped) noexcept nogil:
    """The string opening at ``pos``: ``end`` past its closing quote; ``escaped`` if it has a backslash.

    Most strings are plain bytes up to the closing quote: that case stays inline in the caller
    (``buf``, ``n`` and ``validate`` are ``s``'s, passed in the caller's registers).
    """
    cdef Py_ssize_t i
    escaped[0] = False
    if validate:
        i = fc_js_plain_run(buf, pos + 1, n)
    else:
        i = fc_js_quote_or_backslash(buf, pos + 1, n)
    if i < n and buf[i] == 0x22:
        end[0] = i + 1
        return 0
    return scan_string_rest(s, i, end, escaped)


cdef int scan_number(Scanner *s, Py_ssize_t i, Py_ssize_t *end) noexcept nogil:
    """Past the number at ``i``; a malformed one fails where it breaks, a long one at ``i``."""
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t n = s.n, start = i
    cdef uint8_t c
    if buf[i] == 0x2D:  # '-'
        i += 1
    if i >= n:
        return fail(s, E_EOF, n)
    c = buf[i]
    if c == 0x30:
        i += 1
    elif is_digit(c):
        i += 1
        while i < n and is_digit(buf[i]):
            i += 1
    else:
        return fail(s, E_DIGIT, i)
    if i < n and buf[i] == 0x2E:  # '.'
        i += 1
        if i >= n:
            return fail(s, E_EOF, n)
        if not is_digit(buf[i]):
            return fail(s, E_DIGIT, i)
        while i < n and is_digit(buf[i]):
            i += 1
    if i < n and (buf[i] == 0x65 or buf[i] == 0x45):  # 'e' 'E'
        i += 1
        if i < n and (buf[i] == 0x2B or buf[i] == 0x2D):
            i += 1
        if i >= n:
            return fail(s, E_EOF, n)
        if not is_digit(buf[i]):
            return fail(s, E_DIGIT, i)
        while i < n and is_digit(buf[i]):
            i += 1
    if i - start > _MAX_NUMBER_CHARS:
        return fail(s, E_NUMBER_LENGTH, start)
    end[0] = i
    return 0


cdef inline Py_ssize_t number_end(const uint8_t *buf, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """Past the well-formed number at ``i`` within the length limit, or -1 (scan_number says what
    is wrong)."""
    cdef Py_ssize_t start = i
    if buf[i] == 0x2D:
        i += 1
        if i >= n:
            return -1
    if buf[i] == 0x30:
        i += 1
    elif is_digit(buf[i]):
        i += 1
        while i < n and is_digit(buf[i]):
            i += 1
    else:
        return -1
    if i < n and buf[i] == 0x2E:
        i += 1
        if i >= n or not is_digit(buf[i]):
            return -1
        while i < n and is_digit(buf[i]):
            i += 1
    if i < n and (buf[i] == 0x65 or buf[i] == 0x45):
        i += 1
        if i < n and (buf[i] == 0x2B or buf[i] == 0x2D):
            i += 1
        if i >= n or not is_digit(buf[i]):
            return -1
        while i < n and is_digit(buf[i]):
            i += 1
    if i - start > _MAX_NUMBER_CHARS:
        return -1
    return i


cdef Py_ssize_t number_array_end(const uint8_t *buf, Py_ssize_t pos, Py_ssize_t n) noexcept nogil:
    """Past the array at ``pos`` if it is a non-empty, well-formed list of numbers only, else -1.

    Token-id lists dominate our bodies; this consumes one without the walk's per-value
    bookkeeping (the pure twin's ``_NUMBER_ARRAY``). On anything else the walk takes the array
    from its start and finds the exact error.
    """
    cdef Py_ssize_t i = skip_ws(buf, pos + 1, n)
    cdef uint8_t c
    while True:
        if i >= n:
            return -1
        c = buf[i]
        if c != 0x2D and not is_digit(c):
            return -1
        i = number_end(buf, i, n)
        if i < 0:
            return -1
        if i < n and buf[i] == 0x2C:  # the common case: no blank before the comma
            i = skip_ws(buf, i + 1, n)
            continue
        i = skip_ws(buf, i, n)
        if i >= n:
            return -1
        c = buf[i]
        if c == 0x2C:
            i = skip_ws(buf, i + 1, n)
            continue
        if c == 0x5D:
            return i + 1
        return -1


cdef int scan_literal(Scanner *s, Py_ssize_t pos, const char *word, Py_ssize_t length, Py_ssize_t *end) noexcept nogil:
    cdef Py_ssize_t k
    for k in range(length):
        if pos + k >= s.n:
            return fail(s, E_EOF, s.n)
        if s.buf[pos + k] != <uint8_t>word[k]:
            return fail(s, E_LITERAL, pos + k)
    end[0] = pos + length
    return 0


cdef int skip_container(Scanner *s, Py_ssize_t pos, Py_ssize_t outer, Py_ssize_t *end) noexcept nogil:
    """Past the container opening at ``pos``, by bracket counting only (``validate=False``).

    ``outer``: the containers open around it; the depth limit counts them too.
    """
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t n = s.n, i = pos, depth = 0, limit = _MAX_DEPTH - outer
    cdef uint8_t c = 0
    cdef bint escaped
    cdef int code
    while True:
        while i < n:
            c = buf[i]
            if c == 0x22 or c == 0x5B or c == 0x5D or c == 0x7B or c == 0x7D:
                break
            i += 1
        if i >= n:
            return fail(s, E_EOF, n)
        if c == 0x22:
            code = scan_string(s, buf, n, False, i, &i, &escaped)
            if code:
                return code
            continue
        if c == 0x5B or c == 0x7B:
            depth += 1
            if depth > limit:
                return fail(s, E_DEPTH, i)
        else:
            depth -= 1
        i += 1
        if depth == 0:
            end[0] = i
            return 0


# -- keys ----------------------------------------------------------------------------------------------

cdef inline Py_ssize_t put_code_point(uint8_t *out, Py_ssize_t k, unsigned int cp) noexcept nogil:
    # UTF-8, surrogates included (Python's "surrogatepass"), as the path keys are encoded.
    if cp < 0x80:
        out[k] = cp
        return k + 1
    if cp < 0x800:
        out[k] = 0xC0 | (cp >> 6)
        out[k + 1] = 0x80 | (cp & 0x3F)
        return k + 2
    if cp < 0x10000:
        out[k] = 0xE0 | (cp >> 12)
        out[k + 1] = 0x80 | ((cp >> 6) & 0x3F)
        out[k + 2] = 0x80 | (cp & 0x3F)
        return k + 3
    out[k] = 0xF0 | (cp >> 18)
    out[k + 1] = 0x80 | ((cp >> 12) & 0x3F)
    out[k + 2] = 0x80 | ((cp >> 6) & 0x3F)
    out[k + 3] = 0x80 | (cp & 0x3F)
    return k + 4


cdef inline int hex4(const uint8_t *buf, Py_ssize_t start, Py_ssize_t end) noexcept nogil:
    cdef int value = 0, digit
    cdef Py_ssize_t k
    if start + 4 > end:
        return -1
    for k in range(start, start + 4):
        digit = hex_value(buf[k])
        if digit < 0:
            return -1
        value = value * 16 + digit
    return value


cdef int decode_key(Scanner *s, Py_ssize_t start, Py_ssize_t end, Py_ssize_t *length) noexcept nogil:
    """Unescape the key ``buf[start:end]`` into ``s.scratch`` (never longer than the raw key)."""
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t i = start, k = 0
    cdef uint8_t *grown
    cdef uint8_t c, e
    cdef int unit, low
    if end - start > s.scratch_capacity:
        grown = <uint8_t *>realloc(s.scratch, end - start)
        if grown == NULL:
            return E_NO_MEMORY
        s.scratch = grown
        s.scratch_capacity = end - start
    cdef uint8_t *out = s.scratch
    while i < end:
        c = buf[i]
        if c != 0x5C:
            out[k] = c
            k += 1
            i += 1
            continue
        e = buf[i + 1]  # a string never ends in an unpaired backslash
        if e == 0x22 or e == 0x5C or e == 0x2F:
            out[k] = e
        elif e == 0x62:
            out[k] = 0x08
        elif e == 0x66:
            out[k] = 0x0C
        elif e == 0x6E:
            out[k] = 0x0A
        elif e == 0x72:
            out[k] = 0x0D
        elif e == 0x74:
            out[k] = 0x09
        elif e == 0x75:
            unit = hex4(buf, i + 2, end)
            if unit < 0:
                return fail(s, E_UNICODE_ESCAPE, i)
            i += 6
            if 0xD800 <= unit < 0xDC00 and i + 1 < end and buf[i] == 0x5C and buf[i + 1] == 0x75:
                low = hex4(buf, i + 2, end)
                if 0xDC00 <= low < 0xE000:
                    unit = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                    i += 6
            k = put_code_point(out, k, unit)
            continue
        else:
            return fail(s, E_ESCAPE, i)
        k += 1
        i += 2
    length[0] = k
    return 0


cdef int match_key(Scanner *s, int parent, Py_ssize_t start, Py_ssize_t end, bint escaped, int *found) noexcept nogil:
    """The child of ``parent`` named by the key ``buf[start:end]`` (raw, no quotes), or -1."""
    cdef const uint8_t *key = s.buf + start
    cdef Py_ssize_t length = end - start
    cdef int code, child
    if escaped:
        code = decode_key(s, start, end, &length)
        if code:
            return code
        key = s.scratch
    cdef Node *nodes = s.nodes
    child = nodes[parent].first_child
    while child >= 0:
        # key_len is -1 on index nodes; the first byte spares most memcmp calls.
        if nodes[child].key_len == length:
            if length == 0 or (<uint8_t>nodes[child].key[0] == key[0] and memcmp(nodes[child].key, key, length) == 0):
                found[0] = child
                return 0
        child = nodes[child].next_sibling
    found[0] = -1
    return 0


cdef inline int index_child(Scanner *s, int parent, Py_ssize_t index) noexcept nogil:
    if parent < 0:
        return -1
    cdef int child = s.nodes[parent].first_child
    while child >= 0:
        if not s.nodes[child].is_key and s.nodes[child].index == index:
            return child
        child = s.nodes[child].next_sibling
    return -1


# -- the walk ------------------------------------------------------------------------------------------

cdef int grow_frames(Scanner *s) noexcept nogil:
    """Double the frame stack, up to _MAX_DEPTH frames (``s.depth`` are in use); 0 or E_NO_MEMORY."""
    cdef Frame *grown
    cdef Py_ssize_t capacity = s.capacity * 2
    if capacity > _MAX_DEPTH:
        capacity = _MAX_DEPTH
    if s.frames_on_heap:
        grown = <Frame *>realloc(s.frames, capacity * sizeof(Frame))
    else:
        grown = <Frame *>malloc(capacity * sizeof(Frame))
        if grown != NULL:
            memcpy(grown, s.frames, s.depth * sizeof(Frame))
    if grown == NULL:
        return E_NO_MEMORY
    s.frames = grown
    s.frames_on_heap = True
    s.capacity = capacity
    return 0


cdef inline void close_frame(Node *nodes, Frame *frame, Py_ssize_t end) noexcept nogil:
    if frame.node < 0:
        return
    cdef Node *node = &nodes[frame.node]
    if node.last and not frame.is_object and frame.has_last:
        node.last_start = frame.last_start
        node.last_end = frame.last_end
    if node.terminal:
        node.start = frame.start
        node.end = end


cdef int run(Scanner *s) noexcept nogil:
    """Validate (as ``s.validate`` asks) and record the spans of the nodes; 0 or a status code."""
    # The scanner's fields live in locals here: every store through a Node or Frame pointer could
    # alias them otherwise (the build has -fno-strict-aliasing), and they would be reloaded each time.
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t n = s.n, pos, start, key_start, depth = 0, array_end
    cdef Node *nodes = s.nodes
    cdef Frame *frames = s.frames
    cdef bint validate = s.validate
    cdef int node = 0 if nodes != NULL else -1  # the path node of the value about to be parsed
    cdef int value_node, code
    cdef bint expecting_key = False, escaped, is_object, descend
    cdef Frame *frame
    cdef uint8_t c, closer
    pos = skip_ws(buf, 0, n)
    while True:
        if expecting_key:
            # At the first non-blank byte where a member of the innermost object starts.
            frame = &frames[depth - 1]
            if pos >= n:
                return fail(s, E_EOF, n)
            if buf[pos] != 0x22:
                return fail(s, E_KEY, pos)
            key_start = pos
            code = scan_string(s, buf, n, validate, pos, &pos, &escaped)
            if code:
                return code
            node = -1
            if frame.node >= 0 and nodes[frame.node].has_keys:
                code = match_key(s, frame.node, key_start + 1, pos - 1, escaped, &node)
                if code:
                    return code
                if node >= 0:
                    if nodes[node].seen:
                        s.error_node = node
                        return fail(s, E_DUPLICATE_KEY, key_start)
                    nodes[node].seen = True
                    nodes[node].key_start = key_start
            pos = skip_ws(buf, pos, n)
            if pos >= n:
                return fail(s, E_EOF, n)
            if buf[pos] != 0x3A:
                return fail(s, E_COLON, pos)
            pos = skip_ws(buf, pos + 1, n)
            expecting_key = False

        # Parse one value at pos (non-blank or end of data) for `node`.
        if pos >= n:
            return fail(s, E_EOF, n)
        start = pos
        c = buf[pos]
        value_node = node
        if c == 0x22:
            code = scan_string(s, buf, n, validate, pos, &pos, &escaped)
        elif c == 0x2D or is_digit(c):
            code = scan_number(s, pos, &pos)
        elif c == 0x74:
            code = scan_literal(s, pos, b"true", 4, &pos)
        elif c == 0x66:
            code = scan_literal(s, pos, b"false", 5, &pos)
        elif c == 0x6E:
            code = scan_literal(s, pos, b"null", 4, &pos)
        elif c == 0x7B or c == 0x5B:
            if depth == s.capacity:
                # The stack is full: the depth limit (the stack's largest size) or time to grow. The
                # check comes before the number-array path, which opens a level without a frame.
                if depth >= _MAX_DEPTH:
                    return fail(s, E_DEPTH, pos)
                s.depth = depth
                code = grow_frames(s)
                if code:
                    return code
                frames = s.frames
            is_object = c == 0x7B
            if node < 0:
                descend = False
            elif is_object:
                descend = nodes[node].has_keys
            else:
                descend = nodes[node].has_items or nodes[node].last
            array_end = -1
            if not descend and not is_object and validate:
                array_end = number_array_end(buf, pos, n)
            if not descend and not validate:
                code = skip_container(s, pos, depth, &pos)
            elif array_end >= 0:
                pos = array_end
                code = 0
            else:
                depth += 1
                frame = &frames[depth - 1]
                frame.node = node
                frame.is_object = is_object
                frame.has_last = False
                frame.start = start
                frame.index = 0
                frame.elem_start = -1
                pos = skip_ws(buf, pos + 1, n)
                if pos >= n:
                    return fail(s, E_EOF, n)
                closer = 0x7D if is_object else 0x5D
                if buf[pos] != closer:
                    if is_object:
                        expecting_key = True
                        continue
                    node = index_child(s, frame.node, 0)
                    frame.elem_start = pos
                    continue
                pos += 1
                depth -= 1
                close_frame(nodes, frame, pos)
                value_node = -1  # close_frame recorded it
        else:
            return fail(s, E_VALUE, pos)
        if code:
            return code
        if value_node >= 0 and nodes[value_node].terminal:
            nodes[value_node].start = start
            nodes[value_node].end = pos

        # After a value: separators and closers, possibly several levels up.
        while True:
            if depth == 0:
                pos = skip_ws(buf, pos, n)
                if pos != n:
                    return fail(s, E_TRAILING, pos)
                return 0
            frame = &frames[depth - 1]
            if not frame.is_object and frame.node >= 0 and nodes[frame.node].last:
                frame.has_last = True
                frame.last_start = frame.elem_start
                frame.last_end = pos
            pos = skip_ws(buf, pos, n)
            if pos >= n:
                return fail(s, E_EOF, n)
            c = buf[pos]
            if c == 0x2C:
                pos = skip_ws(buf, pos + 1, n)
                if frame.is_object:
                    expecting_key = True
                else:
                    frame.index += 1
                    node = index_child(s, frame.node, frame.index)
                    frame.elem_start = pos
                break
            if frame.is_object:
                if c != 0x7D:
                    return fail(s, E_OBJECT_SEPARATOR, pos)
            elif c != 0x5D:
                return fail(s, E_ARRAY_SEPARATOR, pos)
            pos += 1
            depth -= 1
            close_frame(nodes, frame, pos)


# -- compiled path sets --------------------------------------------------------------------------------

cdef enum:
    # How the span of a path is read off its end node.
    END_VALUE = 0
    END_LAST = 1  # the path ends with -1: the last element's span
    END_KEY = 2  # the path ends with a key (find_member_spans: the member spans key to value)


cdef class _PathSet:
    """Paths compiled to a flat node array; cached, so a hot caller pays for it once."""

    cdef Node *nodes
    cdef int count
    cdef int *end_nodes  # per path: the index of its end node
    cdef uint8_t *end_kinds  # per path: END_*
    cdef Py_ssize_t n_paths
    cdef object source  # the paths as given (the identity cache checks it)
    cdef list keys  # owns the key bytes the nodes point into
    cdef list labels  # the str key of each node (for the duplicate-key message), or None

    def __dealloc__(self):
        free(self.nodes)
        free(self.end_nodes)
        free(self.end_kinds)


cdef _PathSet _build_path_set(object paths):
    root, ends = _compile(paths)
    cdef _PathSet compiled = _PathSet.__new__(_PathSet)
    order = [root]
    index_of = {id(root): 0}
    parents = [-1]
    cursor = 0
    while cursor < len(order):
        py_node = order[cursor]
        for child in list(py_node.keys.values()) + list(py_node.items.values()):
            index_of[id(child)] = len(order)
            order.append(child)
            parents.append(cursor)
        cursor += 1
    compiled.count = len(order)
    compiled.nodes = <Node *>malloc(compiled.count * sizeof(Node))
    compiled.n_paths = len(ends)
    compiled.end_nodes = <int *>malloc((compiled.n_paths + 1) * sizeof(int))
    compiled.end_kinds = <uint8_t *>malloc(compiled.n_paths + 1)
    if compiled.nodes == NULL or compiled.end_nodes == NULL or compiled.end_kinds == NULL:
        raise MemoryError()
    compiled.keys = []
    compiled.labels = []
    cdef Node *c_node
    cdef int i, parent
    for i in range(compiled.count):
        py_node = order[i]
        c_node = &compiled.nodes[i]
        c_node.first_child = -1
        c_node.next_sibling = -1
        c_node.is_key = isinstance(py_node.label, str)
        c_node.key = NULL
        c_node.key_len = -1  # no key: never equal to a key's length
        c_node.index = 0
        if c_node.is_key:
            key = py_node.label.encode("utf-8", "surrogatepass")
            compiled.keys.append(key)
            c_node.key = PyBytes_AS_STRING(key)
            c_node.key_len = len(key)
        elif py_node.label is not None:
            c_node.index = py_node.label
        c_node.has_keys = bool(py_node.keys)
        c_node.has_items = bool(py_node.items)
        c_node.last = py_node.last
        c_node.terminal = py_node.terminal
        compiled.labels.append(py_node.label if c_node.is_key else None)
    # Children in the same order as the dicts of the pure twin (first-seen first).
    for i in range(compiled.count - 1, 0, -1):
        parent = parents[i]
        compiled.nodes[i].next_sibling = compiled.nodes[parent].first_child
        compiled.nodes[parent].first_child = i
    for i in range(compiled.n_paths):
        node, is_last = ends[i]
        compiled.end_nodes[i] = index_of[id(node)]
        compiled.end_kinds[i] = END_LAST if is_last else (END_KEY if isinstance(node.label, str) else END_VALUE)
    compiled.source = paths
    return compiled


cdef dict _path_cache = {}
# The same sets by the identity of the tuple they were compiled from: a caller that passes the same
# tuple object every time (a module constant) skips hashing it. Each set keeps its tuple alive, so an
# id is never reused while its entry is here.
cdef dict _path_identity = {}


cdef inline bint _plain_components(tuple paths):
    # bool hashes like int: (True,) must not hit the cache entry of (1,).
    for path in paths:
        if type(path) is not tuple:
            return False
        for component in <tuple>path:
            if type(component) is not str and type(component) is not int:
                return False
    return True


cdef _PathSet _path_set(object paths):
    if type(paths) is tuple:
        found = _path_identity.get(id(paths))
        if found is not None and (<_PathSet>found).source is paths:
            return <_PathSet>found
        if _plain_components(<tuple>paths):
            cached = _path_cache.get(paths)
            if cached is None:
                cached = _build_path_set(paths)
                if len(_path_cache) >= PATH_CACHE_SIZE:
                    _path_cache.clear()
                _path_cache[paths] = cached
                if len(_path_identity) >= PATH_CACHE_SIZE:
                    _path_identity.clear()
                _path_identity[id(paths)] = cached
            return <_PathSet>cached
    return _build_path_set(paths)


# -- one scan over a body ------------------------------------------------------------------------------

cdef int _scan_begin(Scanner *s, _PathSet compiled, const uint8_t *buf, Py_ssize_t n, bint validate,
                     Frame *inline_frames, Node *inline_nodes) except -1:
    """Set ``s`` up to scan ``buf`` for ``compiled`` (``_scan_end`` frees what it allocates)."""
    cdef int i
    cdef Node *node
    s.buf = buf
    s.n = n
    s.validate = validate
    s.frames = inline_frames
    s.depth = 0
    s.capacity = INLINE_FRAMES if INLINE_FRAMES < _MAX_DEPTH else _MAX_DEPTH
    s.frames_on_heap = False
    s.scratch = NULL
    s.scratch_capacity = 0
    s.error_offset = 0
    s.error_node = -1
    s.nodes = inline_nodes
    if compiled.count > INLINE_NODES:
        s.nodes = <Node *>malloc(compiled.count * sizeof(Node))
        if s.nodes == NULL:
            s.nodes = inline_nodes
            raise MemoryError()
    memcpy(s.nodes, compiled.nodes, compiled.count * sizeof(Node))
    for i in range(compiled.count):
        node = &s.nodes[i]
        node.seen = False
        node.start = -1
        node.end = -1
        node.key_start = -1
        node.last_start = -1
        node.last_end = -1
    return 0


cdef int _scan_run(Scanner *s, _PathSet compiled) except -1:
    """Run the scan; raise its error (``JSONSpanError``, ``MemoryError``)."""
    cdef int code
    if s.n >= NOGIL_MIN_BYTES:
        with nogil:
            code = run(s)
    else:
        code = run(s)
    if code == E_NO_MEMORY:
        raise MemoryError()
    if code:
        raise make_error(code, s.error_offset, compiled.labels[s.error_node] if s.error_node >= 0 else None)
    return 0


cdef inline void _scan_end(Scanner *s, Node *inline_nodes) noexcept:
    if s.frames_on_heap:
        free(s.frames)
    free(s.scratch)
    if s.nodes != inline_nodes:
        free(s.nodes)


cdef inline void _span_of(Scanner *s, _PathSet compiled, Py_ssize_t path, bint members,
                          Py_ssize_t *start, Py_ssize_t *end) noexcept:
    """The span of path number ``path`` after a scan; ``start`` -1 where absent."""
    cdef Node *node = &s.nodes[compiled.end_nodes[path]]
    cdef uint8_t kind = compiled.end_kinds[path]
    if kind == END_LAST:
        start[0] = node.last_start
        end[0] = node.last_end
    elif node.start < 0:
        start[0] = -1
        end[0] = -1
    elif members and kind == END_KEY:
        start[0] = node.key_start
        end[0] = node.end
    else:
        start[0] = node.start
        end[0] = node.end


# -- entry points --------------------------------------------------------------------------------------

cdef int _get_body(object body, Py_buffer *view) except -1:
    try:
        PyObject_GetBuffer(body, view, PyBUF_SIMPLE)
    except TypeError:
        raise TypeError(f"body must be bytes-like, not {type(body).__name__}") from None
    except BufferError:
        raise BufferError("body must be a contiguous buffer") from None
    return 0


cdef inline object _span_tuple(Py_ssize_t start, Py_ssize_t end):
    if start < 0:
        return None
    return (start, end)


cdef list _find(object body, object paths, bint validate, bint members):
    cdef Py_buffer view
    cdef Scanner s
    cdef Frame inline_frames[INLINE_FRAMES]
    cdef Node inline_nodes[INLINE_NODES]
    cdef Py_ssize_t i, start, end
    cdef _PathSet compiled
    cdef list spans
    _get_body(body, &view)
    try:
        compiled = _path_set(paths)
        _scan_begin(&s, compiled, <const uint8_t *>view.buf, view.len, validate, inline_frames, inline_nodes)
        try:
            _scan_run(&s, compiled)
            spans = PyList_New(compiled.n_paths)
            for i in range(compiled.n_paths):
                _span_of(&s, compiled, i, members, &start, &end)
                item = _span_tuple(start, end)
                Py_INCREF(item)
                PyList_SET_ITEM(spans, i, item)
            return spans
        finally:
            _scan_end(&s, inline_nodes)
    finally:
        PyBuffer_Release(&view)


def find_spans(body, paths, *, validate=True):
    """Half-open byte spans of the values at ``paths`` (``None`` where absent), in one pass."""
    return _find(body, paths, validate, False)


def find_span(body, path, *, validate=True):
    """Half-open byte span of the value at ``path`` (a string's span includes its quotes), or ``None``."""
    return _find(body, (path,), validate, False)[0]


def find_member_spans(body, paths, *, validate=True):
    """Like :func:`find_spans`, but a path ending in a key spans the whole member, key to value."""
    return _find(body, paths, validate, True)


def splice(body, edits):
    """``body`` with each ``(start, end, replacement)`` applied; edits sorted, non-overlapping.

    Several edits may share a position (insertions land in the given order).
    One output allocation; pieces are copied straight into it.
    """
    cdef Py_buffer view
    cdef Py_buffer *pieces = NULL
    cdef Py_ssize_t *bounds = NULL
    cdef Py_ssize_t count = 0, acquired = 0, size, total, previous = 0, k, length
    cdef char *out
    _get_body(body, &view)
    try:
        size = view.len
        edit_list = edits if type(edits) is list else list(edits)
        count = len(edit_list)
        pieces = <Py_buffer *>malloc((count + 1) * sizeof(Py_buffer))
        bounds = <Py_ssize_t *>malloc((2 * count + 1) * sizeof(Py_ssize_t))
        if pieces == NULL or bounds == NULL:
            raise MemoryError()
        total = size
        for number in range(count):
            edit = edit_list[number]
            try:
                start, end, replacement = edit
            except (TypeError, ValueError):
                raise TypeError(f"edit {number} must be a (start, end, replacement) tuple") from None
            if isinstance(start, bool) or isinstance(end, bool) or not isinstance(start, int) or not isinstance(end, int):
                raise TypeError(f"edit {number}: start and end must be ints")
            if not 0 <= start <= end <= size:
                raise ValueError(f"edit {number}: need 0 <= start <= end <= len(body) = {size}, got ({start}, {end})")
            if start < previous:
                raise ValueError(f"edit {number}: starts at {start}, before the previous edit ends ({previous})")
            try:
                PyObject_GetBuffer(replacement, &pieces[number], PyBUF_SIMPLE)
            except TypeError:
                raise TypeError(
                    f"edit {number}: replacement must be bytes-like, not {type(replacement).__name__}"
                ) from None
            except BufferError:
                raise BufferError(f"edit {number}: replacement must be a contiguous buffer") from None
            acquired += 1
            bounds[2 * number] = start
            bounds[2 * number + 1] = end
            previous = end
            total += pieces[number].len - (bounds[2 * number + 1] - bounds[2 * number])
        result = PyBytes_FromStringAndSize(NULL, total)
        out = PyBytes_AS_STRING(result)
        previous = 0
        with nogil:
            for k in range(count):
                length = bounds[2 * k] - previous
                memcpy(out, <const char *>view.buf + previous, length)
                out += length
                memcpy(out, pieces[k].buf, pieces[k].len)
                out += pieces[k].len
                previous = bounds[2 * k + 1]
            memcpy(out, <const char *>view.buf + previous, size - previous)
        return result
    finally:
        for k in range(acquired):
            PyBuffer_Release(&pieces[k])
        free(pieces)
        free(bounds)
        PyBuffer_Release(&view)


cdef Py_ssize_t _check_b64(const uint8_t *buf, Py_ssize_t lo, Py_ssize_t hi) except -1:
    """check_token_b64 on ``buf[lo:hi]`` (offsets absolute): the id count, or TokenDecodeError."""
    cdef Py_ssize_t i, data_end, padding = 0, length, decoded
    cdef int last_value
    cdef uint8_t c
    if hi - lo >= NOGIL_MIN_BYTES:
        with nogil:
            i = <Py_ssize_t>fc_b64_alphabet_run(buf, lo, hi, fc_js_avx2)
    else:
        i = <Py_ssize_t>fc_b64_alphabet_run(buf, lo, hi, fc_js_avx2)
    data_end = i
    while i < hi and buf[i] == 0x3D and padding < 2:
        padding += 1
        i += 1
    if i < hi:
        if padding:
            raise TokenDecodeError(f"base64 padding '=' before the end of the data (byte {data_end})", data_end)
        raise TokenDecodeError(f"invalid base64 character {chr(buf[i])!r} (byte {i})", i)
    length = hi - lo
    if length % 4:
        raise TokenDecodeError(f"base64 length {length} is not a multiple of 4", None)
    if padding:
        if data_end == lo:
            raise TokenDecodeError(f"non-canonical base64 padding (byte {data_end - 1})", data_end - 1)
        c = buf[data_end - 1]
        if c >= 0x61:
            last_value = c - 0x61 + 26
        elif c >= 0x41:
            last_value = c - 0x41
        elif c >= 0x30:
            last_value = c - 0x30 + 52
        elif c == 0x2B:
            last_value = 62
        else:
            last_value = 63
        if last_value & (0x0F if padding == 2 else 0x03):
            raise TokenDecodeError(f"non-canonical base64 padding (byte {data_end - 1})", data_end - 1)
    decoded = length // 4 * 3 - padding
    if decoded % 4:
        raise TokenDecodeError(f"base64 decodes to {decoded} bytes, not a whole number of int32 ids", None)
    return decoded // 4


def check_token_b64(body, start=0, end=None):
    """Check that ``body[start:end]`` is ``prompt_token_ids_b64`` content; return the id count.

    Standard alphabet, ``=`` padding only at the end, length a multiple of 4,
    canonical (unused bits zero), decoding to a whole number of int32s; no
    escapes. Raises :class:`fastcore.TokenDecodeError` with the absolute offset.
    """
    cdef Py_buffer view
    cdef Py_ssize_t size
    _get_body(body, &view)
    try:
        size = view.len
        if end is None:
            end = size
        if not 0 <= start <= end <= size:
            raise ValueError(f"need 0 <= start <= end <= len(body) = {size}, got ({start}, {end})")
        return _check_b64(<const uint8_t *>view.buf, start, end)
    finally:
        PyBuffer_Release(&view)



# -- chunk hashes --------------------------------------------------------------------------------------
#
# The pure twin's section of the same name defines the hash; this is the same arithmetic in C (its
# constants are the twin's, checked at import below), four independent lanes per step.


import fastcore._jsonspan_py as _py_chunk

if (_py_chunk.CHUNK_LANE_SEEDS, _py_chunk.CHUNK_PRIMES, _py_chunk.CHUNK_CHAIN_SEED, _py_chunk.CHUNK_CHAIN_MUL) != (
    (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89),
    (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93),
    0x452821E638D01377,
    0x9FB21C651E98DF25,
):
    raise ImportError("fastcore._jsonspan: chunk hash constants differ from fastcore._jsonspan_py's")

cdef object _check_chunk_args = _py_chunk.check_chunk_args


def chunk_hashes(data, start, end, chunk):
    """The chained 64-bit hashes of the full ``chunk``-byte chunks of ``data[start:end]``.

    ``fastcore._jsonspan_py.chunk_hashes`` defines them (same ints, same errors).
    """
    cdef Py_buffer view
    cdef Py_ssize_t lo, hi, size, n, i
    cdef fc_u64 *out
    cdef list result
    _get_body(data, &view)
    try:
        lo, hi, size = _check_chunk_args(view.len, start, end, chunk)
        n = (hi - lo) // size
        result = PyList_New(n)
        if n == 0:
            return result
        out = <fc_u64 *>malloc(n * sizeof(fc_u64))
        if out == NULL:
            raise MemoryError()
        try:
            with nogil:
                fc_chunk_hashes(<const uint8_t *>view.buf + lo, n, size, out)
            for i in range(n):
                item = PyLong_FromUnsignedLongLong(out[i])
                Py_INCREF(item)
                PyList_SET_ITEM(result, i, item)
        finally:
            free(out)
        return result
    finally:
        PyBuffer_Release(&view)


# -- relay kernels -------------------------------------------------------------------------------------
#
# The pure twin's section of the same name states what each does (it is the reference); these take
# the same decisions in C: one scan with a path set compiled at import, spans kept in C arrays, small
# fields decoded from their bytes, each output built with one allocation. No Python object is made
# on the way but the results.

cdef enum:
    N_CLIENT = 13  # len(CLIENT_REQUEST_PATHS)
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
    N_CONTEXT = 12  # len(CONTEXT_RESPONSE_PATHS)
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
    STRIP_CHOICES = 8  # the choices the first strip scan covers
    MAX_PIECES = 24
    INLINE_MEMBERS = 2 + STRIP_CHOICES

import fastcore._jsonspan_py as _py

for _name, _value in (
    ("C_ROOT", C_ROOT), ("C_MESSAGES", C_MESSAGES), ("C_DISAGG", C_DISAGG), ("C_B64", C_B64), ("C_IDS", C_IDS),
    ("C_STREAM", C_STREAM), ("C_STREAM_OPTIONS", C_STREAM_OPTIONS), ("C_PROMPT", C_PROMPT),
    ("C_LAST_MESSAGE", C_LAST_MESSAGE), ("C_MODEL", C_MODEL), ("C_MAX_TOKENS", C_MAX_TOKENS),
    ("C_MAX_COMPLETION_TOKENS", C_MAX_COMPLETION_TOKENS), ("C_INCLUDE_USAGE", C_INCLUDE_USAGE),
    ("X_ROOT", X_ROOT), ("X_FINISH", X_FINISH), ("X_DP", X_DP), ("X_USAGE", X_USAGE), ("X_IDS", X_IDS),
    ("X_B64", X_B64), ("X_REQUEST_TYPE", X_REQUEST_TYPE), ("X_CTX_USAGE", X_CTX_USAGE),
    ("X_FIRST_CHOICE", X_FIRST_CHOICE), ("X_COMPLETION_TOKENS", X_COMPLETION_TOKENS),
    ("X_CTX_INFO_ENDPOINT", X_CTX_INFO_ENDPOINT), ("X_ENCODED_OPAQUE_STATE", X_ENCODED_OPAQUE_STATE),
):
    if getattr(_py, _name) != _value:  # the twins index the same path tuples
        raise ImportError(f"fastcore._jsonspan: {_name} differs from the pure twin's")
if len(_py.CLIENT_REQUEST_PATHS) != N_CLIENT or len(_py.CONTEXT_RESPONSE_PATHS) != N_CONTEXT:
    raise ImportError("fastcore._jsonspan: the relay path tables differ from the pure twin's")

from fastcore import protocol as _protocol
from fastcore.errors import RelayError
from json import loads as _json_loads

# The C below spells some of fastcore.protocol's names as literals (with their lengths) and reads the
# internal fields by span index: an import that would disagree with the protocol module fails here.
if (_py.CLIENT_INTERNAL != ((C_DISAGG, "disaggregated_params"), (C_B64, "prompt_token_ids_b64"),
                            (C_IDS, "prompt_token_ids"))
        or _protocol.CONTEXT_ONLY != "context_only" or _protocol.GENERATION_ONLY != "generation_only"
        or _protocol.RETURN_PROMPT_TOKEN_IDS_B64 != "return_prompt_token_ids_b64"
        or _protocol.GENERATION_FOLLOWS != ("length", "not_finished")
        or _protocol.COMMON_FINISH_REASONS != ("length", "not_finished", "stop", "abort", "tool_calls")):
    raise ImportError("fastcore._jsonspan: its literals differ from fastcore.protocol's names")

CLIENT_PATHS = _py.CLIENT_PATHS
CLIENT_REQUEST_PATHS = _py.CLIENT_REQUEST_PATHS
CONTEXT_PATHS = _py.CONTEXT_PATHS
CONTEXT_RESPONSE_PATHS = _py.CONTEXT_RESPONSE_PATHS
strip_paths = _py.strip_paths

cdef _PathSet _CLIENT_SET = _build_path_set(_py.CLIENT_REQUEST_PATHS)
cdef _PathSet _CONTEXT_SET = _build_path_set(_py.CONTEXT_RESPONSE_PATHS)
cdef _PathSet _STRIP_SET = _build_path_set(_py.strip_paths(STRIP_CHOICES))
cdef dict _strip_sets = {STRIP_CHOICES: _STRIP_SET}
cdef int _MAX_INT_DIGITS = _py.MAX_INT_DIGITS

cdef str _CONTEXT_502 = _py._CONTEXT_502


cdef struct Piece:
    const char *p
    Py_ssize_t n


cdef inline void _add(Piece *pieces, int *count, const char *p, Py_ssize_t n) noexcept:
    if n > 0:
        pieces[count[0]].p = p
        pieces[count[0]].n = n
        count[0] += 1


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
            raise RelayError(f"'{key}' must be an integer of at most {_MAX_INT_DIGITS} digits", key)
        if _integral(buf, start, end):
            return _int_of(data, buf, start, end)
    elif first == 0x6E:  # null
        return None
    raise RelayError(f"'{key}' must be an integer", key)


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
    raise RelayError(f"'{key}' must be a boolean", key)


cdef object _str_at(object data, const uint8_t *buf, Py_ssize_t start, Py_ssize_t end, str key):
    if start < 0:
        return None
    cdef uint8_t first = buf[start]
    if first == 0x6E:
        return None
    if first != 0x22:
        raise RelayError(f"'{key}' must be a string", key)
    if memchr(buf + start + 1, 0x5C, end - start - 2) == NULL:
        return PyUnicode_DecodeUTF8(<const char *>buf + start + 1, end - start - 2, NULL)  # UTF-8 checked
    return _json_loads(data[start:end])  # escapes: a short string, the stdlib decodes them right


cdef tuple _spans_tuple(const Py_ssize_t *starts, const Py_ssize_t *ends, Py_ssize_t count):
    return tuple([_span_tuple(starts[i], ends[i]) for i in range(count)])


@cython.no_gc  # holds bytes, str and int only: never in a reference cycle
@cython.auto_pickle(False)
cdef class ClientScan:
    """A client body read by :func:`read_client_request` (see the pure twin's ``ClientScan``)."""

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

    def _relay_key(self):
        return (self.body, self.chat, self.spans, self.empty, self.stream, self.include_usage, self.max_tokens,
                self.model)

    def __eq__(self, other):
        key = getattr(other, "_relay_key", None)
        if key is None or type(other).__name__ != "ClientScan":
            return NotImplemented
        return self._relay_key() == key()

    __hash__ = None

    def __repr__(self):
        return (f"ClientScan(chat={self.chat!r}, spans={self.spans!r}, empty={self.empty!r}, "
                f"stream={self.stream!r}, include_usage={self.include_usage!r}, "
                f"max_tokens={self.max_tokens!r}, model={self.model!r})")


@cython.no_gc
@cython.auto_pickle(False)
cdef class ContextScan:
    """A context response read by :func:`read_context_response` (see the pure twin's ``ContextScan``)."""

    cdef readonly object body
    cdef readonly object finish_reason
    cdef readonly bint finished
    cdef Py_ssize_t starts[N_CONTEXT]
    cdef Py_ssize_t ends[N_CONTEXT]

    @property
    def spans(self):
        return _spans_tuple(self.starts, self.ends, N_CONTEXT)

    def _relay_key(self):
        return (self.body, self.spans, self.finish_reason, self.finished)

    def auth_fields(self):
        """``ctx_info_endpoint`` and ``encoded_opaque_state`` of ``choices[0].disaggregated_params``,
        decoded when asked (see the pure twin)."""
        return (self._json_at(X_CTX_INFO_ENDPOINT), self._json_at(X_ENCODED_OPAQUE_STATE))

    cdef object _json_at(self, int index):
        if self.starts[index] < 0:
            return None
        return _json_loads(self.body[self.starts[index]:self.ends[index]])

    def __eq__(self, other):
        key = getattr(other, "_relay_key", None)
        if key is None or type(other).__name__ != "ContextScan":
            return NotImplemented
        return self._relay_key() == key()

    __hash__ = None

    def __repr__(self):
        return (f"ContextScan(spans={self.spans!r}, finish_reason={self.finish_reason!r}, "
                f"finished={self.finished!r})")


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
        raise RelayError("request body must be a JSON object")
    if st[C_DISAGG] >= 0 or st[C_B64] >= 0 or st[C_IDS] >= 0:
        # One of them is there: the one rule (which are internal on which route) decides.
        _py.check_internal_fields(_spans_tuple(st, en, N_CLIENT), is_chat)
    stream = _bool_at(buf, st[C_STREAM], "stream")
    if st[C_STREAM_OPTIONS] >= 0:
        first = buf[st[C_STREAM_OPTIONS]]
        if first == 0x7B:
            include_usage = _bool_at(buf, st[C_INCLUDE_USAGE], "include_usage")
        elif first != 0x6E:
            raise RelayError("'stream_options' must be an object", "stream_options")
    out.model = _str_at(data, buf, st[C_MODEL], en[C_MODEL], "model")
    if is_chat:
        if st[C_LAST_MESSAGE] < 0:  # absent, not an array, or empty
            raise RelayError("'messages' must be a non-empty array", "messages")
        completion = _max_tokens_at(data, buf, st[C_MAX_COMPLETION_TOKENS], en[C_MAX_COMPLETION_TOKENS],
                                    "max_completion_tokens")
        tokens = _max_tokens_at(data, buf, st[C_MAX_TOKENS], en[C_MAX_TOKENS], "max_tokens")
        if completion is not None:
            key, value = "max_completion_tokens", completion
        else:
            key, value = "max_tokens", tokens
    else:
        if st[C_PROMPT] < 0 or (buf[st[C_PROMPT]] != 0x22 and buf[st[C_PROMPT]] != 0x5B):
            raise RelayError("'prompt' must be a string or an array", "prompt")
        key, value = "max_tokens", _max_tokens_at(data, buf, st[C_MAX_TOKENS], en[C_MAX_TOKENS], "max_tokens")
    if value is not None and value < 1:
        raise RelayError(f"'{key}' must be at least 1, got {value}", key)
    out.body = data
    out.chat = is_chat
    out.empty = _is_empty(buf, st[C_ROOT], en[C_ROOT])
    out.stream = stream == 1
    out.include_usage = include_usage == 1
    out.max_tokens = value
    return out


cdef ClientScan _client_scan(object client):
    if type(client) is not ClientScan:
        raise TypeError(f"client must be a ClientScan of this twin, not {type(client).__name__}")
    return <ClientScan>client


cdef ContextScan _context_scan(object context):
    if type(context) is not ContextScan:
        raise TypeError(f"context must be a ContextScan of this twin, not {type(context).__name__}")
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
    """Leg (1) from a read client body (see the pure twin)."""
    cdef ClientScan c = _client_scan(client)
    cdef Piece pieces[MAX_PIECES]
    cdef int count = 0, overflow = 0, length
    cdef long long request_id
    cdef char digits[32]
    cdef const char *buf
    cdef const char *id_text
    cdef Py_ssize_t previous = 0, at
    cdef bint first_added = True
    if isinstance(disagg_request_id, bool) or not isinstance(disagg_request_id, int):
        raise TypeError("disagg_request_id must be an int")
    request_id = PyLong_AsLongLongAndOverflow(disagg_request_id, &overflow)
    if overflow:
        big = b"%d" % disagg_request_id
        id_text = <const char *>PyBytes_AS_STRING(big)
        length = <int>PyBytes_GET_SIZE(big)
    else:
        length = _decimal(request_id, digits)
        id_text = digits
    buf = PyBytes_AS_STRING(c.body)
    # stream and stream_options come before the root's end and after each other in body order.
    if c.starts[C_STREAM] >= 0 and c.starts[C_STREAM_OPTIONS] >= 0 and c.starts[C_STREAM_OPTIONS] < c.starts[C_STREAM]:
        _add(pieces, &count, buf, c.starts[C_STREAM_OPTIONS])
        _add(pieces, &count, "null", 4)
        _add(pieces, &count, buf + c.ends[C_STREAM_OPTIONS], c.starts[C_STREAM] - c.ends[C_STREAM_OPTIONS])
        _add(pieces, &count, "false", 5)
        previous = c.ends[C_STREAM]
    else:
        if c.starts[C_STREAM] >= 0:
            _add(pieces, &count, buf, c.starts[C_STREAM])
            _add(pieces, &count, "false", 5)
            previous = c.ends[C_STREAM]
        if c.starts[C_STREAM_OPTIONS] >= 0:
            _add(pieces, &count, buf + previous, c.starts[C_STREAM_OPTIONS] - previous)
            _add(pieces, &count, "null", 4)
            previous = c.ends[C_STREAM_OPTIONS]
    at = c.ends[C_ROOT] - 1
    _add(pieces, &count, buf + previous, at - previous)
    if not c.empty:
        _add(pieces, &count, ",", 1)
    if c.starts[C_STREAM] < 0:
        _add(pieces, &count, '"stream":false,', 15)
    if c.starts[C_STREAM_OPTIONS] < 0:
        _add(pieces, &count, '"stream_options":null,', 22)
    _add(pieces, &count, '"disaggregated_params":{"request_type":"context_only","disagg_request_id":', 74)
    _add(pieces, &count, id_text, length)
    if return_b64:
        _add(pieces, &count, ',"return_prompt_token_ids_b64":true', 35)
    _add(pieces, &count, "}", 1)
    _add(pieces, &count, buf + at, PyBytes_GET_SIZE(c.body) - at)
    return _join(pieces, count)


cdef inline bint _raw_is(const uint8_t *buf, Py_ssize_t start, Py_ssize_t end, const char *word, Py_ssize_t n) noexcept:
    return end - start == n and memcmp(buf + start, word, n) == 0


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
        raise RelayError(_CONTEXT_502 + "context response is not a JSON object")
    finish_reason = None
    start = st[X_FINISH]
    end = en[X_FINISH]
    if start >= 0:
        if _raw_is(buf, start, end, '"not_finished"', 14):
            finish_reason = "not_finished"
            follows = True
        elif _raw_is(buf, start, end, '"length"', 8):
            finish_reason = "length"
            follows = length = True
        elif _raw_is(buf, start, end, '"stop"', 6):
            finish_reason = "stop"
        elif _raw_is(buf, start, end, "null", 4):
            pass
        elif _raw_is(buf, start, end, '"abort"', 7):
            finish_reason = "abort"
        elif _raw_is(buf, start, end, '"tool_calls"', 12):
            finish_reason = "tool_calls"
        elif buf[start] == 0x22:
            finish_reason = _json_loads(data[start:end])  # a short string with escapes
            length = finish_reason == "length"
            follows = length or finish_reason == "not_finished"
        else:
            raise RelayError(_CONTEXT_502 + "context response: choices[0].finish_reason is not a string",
                             "finish_reason")
    if st[X_FIRST_CHOICE] < 0:
        raise RelayError("context worker response has no choices[0]", "choices")
    if length and max_tokens is not None:
        completion_tokens = _int_at(data, buf, st[X_COMPLETION_TOKENS], en[X_COMPLETION_TOKENS])
        if completion_tokens is not None:
            follows = completion_tokens < max_tokens
    if follows and (st[X_DP] < 0 or buf[st[X_DP]] != 0x7B):
        raise RelayError("context worker response lacks choices[0].disaggregated_params", "disaggregated_params")
    out.body = data
    out.finish_reason = finish_reason
    out.finished = not follows
    return out


def generation_request(client, context, tokids_b64, strip_history):
    """Leg (3) from a read client body and context response (see the pure twin)."""
    cdef ClientScan c = _client_scan(client)
    cdef ContextScan x = _context_scan(context)
    cdef Piece pieces[MAX_PIECES]
    cdef int count = 0
    cdef const char *body = PyBytes_AS_STRING(c.body)
    cdef const char *ctx = PyBytes_AS_STRING(x.body)
    cdef const uint8_t *cbuf = <const uint8_t *>ctx
    cdef Py_ssize_t previous = 0, at = c.ends[C_ROOT] - 1, dp0 = x.starts[X_DP], dp1 = x.ends[X_DP]
    cdef Py_ssize_t rt0 = x.starts[X_REQUEST_TYPE], rt1 = x.ends[X_REQUEST_TYPE]
    cdef Py_ssize_t cu0 = x.starts[X_CTX_USAGE], cu1 = x.ends[X_CTX_USAGE]
    cdef Py_ssize_t u0 = x.starts[X_USAGE], u1 = x.ends[X_USAGE], ids0 = -1, ids1 = -1, p
    cdef const char *usage = "null"
    cdef Py_ssize_t usage_len = 4
    cdef bint gate_b64 = tokids_b64, strip = strip_history, replace_prompt = False
    if dp0 < 0 or cbuf[dp0] != 0x7B:
        raise RelayError(_CONTEXT_502 + "context response has no choices[0].disaggregated_params object",
                         "disaggregated_params")
    if gate_b64:
        ids0 = x.starts[X_B64]
        ids1 = x.ends[X_B64]
        # The list fallback (see the pure twin's _token_b64): no b64 string (absent or null) but the list.
        if (ids0 < 0 or cbuf[ids0] == 0x6E) and x.starts[X_IDS] >= 0 and cbuf[x.starts[X_IDS]] == 0x5B:
            gate_b64 = False
        elif ids0 < 0 or cbuf[ids0] != 0x22:
            raise RelayError(
                _CONTEXT_502 + "context response has no prompt_token_ids_b64 string (is the context "
                "worker's return_prompt_token_ids_b64 support on?) and no prompt_token_ids list",
                "prompt_token_ids_b64")
        else:
            try:
                _check_b64(cbuf, ids0 + 1, ids1 - 1)
            except TokenDecodeError as exc:
                raise RelayError(_CONTEXT_502 + f"context response: invalid prompt_token_ids_b64: {exc}",
                                 "prompt_token_ids_b64") from exc
    if not gate_b64:
        ids0 = x.starts[X_IDS]
        ids1 = x.ends[X_IDS]
        if ids0 < 0 or cbuf[ids0] != 0x5B:
            raise RelayError(_CONTEXT_502 + "context response has no prompt_token_ids list", "prompt_token_ids")
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
        _add(pieces, &count, "[", 1)
        _add(pieces, &count, body + c.starts[C_LAST_MESSAGE], c.ends[C_LAST_MESSAGE] - c.starts[C_LAST_MESSAGE])
        _add(pieces, &count, "]", 1)
        previous = c.ends[C_MESSAGES]
    _add(pieces, &count, body + previous, at - previous)
    if c.empty:
        _add(pieces, &count, '"disaggregated_params":', 23)
    else:
        _add(pieces, &count, ',"disaggregated_params":', 24)
    # The context leg's disaggregated_params: request_type and ctx_usage replaced where present.
    previous = dp0
    if rt0 >= 0 and cu0 >= 0 and cu0 < rt0:
        _add(pieces, &count, ctx + previous, cu0 - previous)
        _add(pieces, &count, usage, usage_len)
        _add(pieces, &count, ctx + cu1, rt0 - cu1)
        _add(pieces, &count, '"generation_only"', 17)
        previous = rt1
    else:
        if rt0 >= 0:
            _add(pieces, &count, ctx + previous, rt0 - previous)
            _add(pieces, &count, '"generation_only"', 17)
            previous = rt1
        if cu0 >= 0:
            _add(pieces, &count, ctx + previous, cu0 - previous)
            _add(pieces, &count, usage, usage_len)
            previous = cu1
    if rt0 >= 0 and cu0 >= 0:
        _add(pieces, &count, ctx + previous, dp1 - previous)
    else:
        _add(pieces, &count, ctx + previous, dp1 - 1 - previous)
        if not _is_empty(cbuf, dp0, dp1):
            _add(pieces, &count, ",", 1)
        if rt0 < 0:
            _add(pieces, &count, '"request_type":"generation_only"', 32)
            if cu0 < 0:
                _add(pieces, &count, ",", 1)
        if cu0 < 0:
            _add(pieces, &count, '"ctx_usage":', 12)
            _add(pieces, &count, usage, usage_len)
        _add(pieces, &count, "}", 1)
    if gate_b64:
        _add(pieces, &count, ',"prompt_token_ids_b64":', 24)
        _add(pieces, &count, ctx + ids0, ids1 - ids0)
    elif not replace_prompt:
        if c.chat:
            _add(pieces, &count, ',"prompt_token_ids":', 20)
        else:
            _add(pieces, &count, ',"prompt":', 10)
        _add(pieces, &count, ctx + ids0, ids1 - ids0)
    _add(pieces, &count, body + at, PyBytes_GET_SIZE(c.body) - at)
    return _join(pieces, count)


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


def strip_internal_fields(body, validate=True):
    """``body`` without the internal fields (see the pure twin)."""
    cdef object data = _as_bytes(body)
    cdef const uint8_t *buf = _data(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t choices = STRIP_CHOICES, paths, count, i, j, runs, start, end, after, comma, previous
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
            raise RelayError("the response body must be a JSON object")
        # The members to cut (key-to-value spans), sorted, compacted into st/en from index 0.
        paths = compiled.n_paths
        count = 0
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
        if count == 0:
            return data
        # Adjacent members of one object go as one run.
        runs = 0
        for i in range(count):
            if runs and _separator_only(buf, en[runs - 1], st[i]):
                en[runs - 1] = en[i]
            else:
                st[runs] = st[i]
                en[runs] = en[i]
                runs += 1
        # Each run with exactly the comma it leaves: the one after it, or (the last member) before it.
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
