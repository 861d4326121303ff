# cython: freethreading_compatible = False
"""Compiled twin of ``fastcore._scan_py``: the JSON span scanner, ``splice`` and the token base64 check.

The same state machine, byte for byte, in C without the GIL: identical spans,
exceptions, messages and offsets on every input (the pure-Python twin's
docstring states the semantics; its ``_compile`` and ``make_error`` are
reused here so paths and errors cannot drift apart). The long runs that
dominate our bodies (string contents, base64 data) are consumed 16 bytes at
a time with SSE2, the x86-64 baseline, or 64 with AVX2 or AVX-512 (include/scan_simd.h);
other targets take the scalar loop.

It knows JSON, not the protocol: the relay kernels (``fastcore._relay``) and
the chunk hashes (``fastcore._hash``) cimport the scan from ``_scan.pxd``.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint8_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy

from fastcore._scan_py import _compile, make_error
from fastcore.limits import JSON_MAX_DEPTH, JSON_MAX_NUMBER_CHARS



fc_js_init()

#: The string kernel this CPU runs: ``"avx512"``, ``"avx2"``, ``"sse2"`` or ``"scalar"``.
KERNEL = fc_js_kernel().decode()


def _set_kernel(name):
    """Tests and benchmarks only: force ``"avx512"`` or ``"avx2"`` (if supported), or the ``"sse2"`` fallback."""
    global KERNEL, fc_js_avx2, fc_js_avx512
    fc_js_init()
    if name == "sse2":
        fc_js_avx2 = fc_js_avx512 = False
    elif name == "avx2" and fc_js_avx2:
        fc_js_avx512 = False
    elif name != "avx512" or not fc_js_avx512:
        raise ValueError(f"kernel {name!r} is not available here")
    KERNEL = fc_js_kernel().decode()


import fastcore._scan_py as _py

# The status codes as compile-time constants of the scan. Their numbers are the pure twin's E_* (whose
# make_error words them): here they follow from the order, from 1, and the check below holds the two
# to each other both ways. Read from it at import as C globals instead (one declaration), they cost
# the scan 8% more instructions on a 280 KB id list, 3% on a chat body (callgrind), though only error
# paths name them.
cpdef enum Status:
    E_EOF = 1
    E_VALUE
    E_OBJECT_SEPARATOR
    E_ARRAY_SEPARATOR
    E_KEY
    E_COLON
    E_TRAILING
    E_CONTROL
    E_ESCAPE
    E_UNICODE_ESCAPE
    E_UTF8
    E_DIGIT
    E_LITERAL
    E_DUPLICATE_KEY
    E_DEPTH
    E_NUMBER_LENGTH

if {m.name: int(m) for m in Status} != {k: v for k, v in vars(_py).items() if k.startswith("E_")}:
    raise ImportError("fastcore._scan: its status codes differ from fastcore._scan_py's E_* constants")

cdef enum:
    # The compiled twin's own results, outside the pure twin's codes (1..99).
    E_NO_MEMORY = 100
    DOCUMENT_END = -1  # after_value: the document ended where it should
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


cdef inline Py_ssize_t number_scan(const uint8_t *buf, Py_ssize_t i, Py_ssize_t n, Py_ssize_t *at) noexcept nogil:
    """Past the number at ``i``, or minus the status code with its offset in ``at``: a malformed
    number fails where it breaks, a long one at ``i``."""
    cdef Py_ssize_t start = i
    if buf[i] == 0x2D:  # '-'
        i += 1
    if i >= n:
        at[0] = n
        return -E_EOF
    if buf[i] == 0x30:
        i += 1
    elif is_digit(buf[i]):
        i += 1
        while i < n and is_digit(buf[i]):
            i += 1
    else:
        at[0] = i
        return -E_DIGIT
    if i < n and buf[i] == 0x2E:  # '.'
        i += 1
        if i >= n or not is_digit(buf[i]):
            at[0] = i
            return -<int>(E_EOF if i >= n else E_DIGIT)  # Status may be unsigned in C
        while i < n and is_digit(buf[i]):
            i += 1
    if i < n and (buf[i] == 0x65 or buf[i] == 0x45):  # 'e' 'E'
        i += 1
        if i < n and (buf[i] == 0x2B or buf[i] == 0x2D):
            i += 1
        if i >= n or not is_digit(buf[i]):
            at[0] = i
            return -<int>(E_EOF if i >= n else E_DIGIT)  # Status may be unsigned in C
        while i < n and is_digit(buf[i]):
            i += 1
    if i - start > _MAX_NUMBER_CHARS:
        at[0] = start
        return -E_NUMBER_LENGTH
    return i


cdef inline int scan_number(Scanner *s, Py_ssize_t i, Py_ssize_t *end) noexcept nogil:
    cdef Py_ssize_t at = 0
    cdef Py_ssize_t past = number_scan(s.buf, i, s.n, &at)
    if past < 0:
        return fail(s, <int>-past, at)
    end[0] = past
    return 0


cdef inline Py_ssize_t number_end(const uint8_t *buf, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """Past the well-formed number at ``i`` within the length limit, or -1 (scan_number says what
    is wrong)."""
    cdef Py_ssize_t at = 0
    cdef Py_ssize_t past = number_scan(buf, i, n, &at)
    return past if past >= 0 else -1


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


cdef inline int read_key(Scanner *s, Frame *frame, Py_ssize_t *at, int *found) noexcept nogil:
    """The member key at ``at[0]`` of the object ``frame`` (its first non-blank byte), through its
    colon to the value's first non-blank byte; ``found``: its path node, or -1. 0 or a status code."""
    cdef const uint8_t *buf = s.buf
    cdef Node *nodes = s.nodes
    cdef Py_ssize_t n = s.n, pos = at[0], key_start = pos
    cdef bint escaped
    cdef int code, node = -1
    if pos >= n:
        return fail(s, E_EOF, n)
    if buf[pos] != 0x22:
        return fail(s, E_KEY, pos)
    code = scan_string(s, buf, n, s.validate, pos, &pos, &escaped)
    if code:
        return code
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
    at[0] = skip_ws(buf, pos + 1, n)
    found[0] = node
    return 0


cdef inline int after_value(Scanner *s, Frame *frames, Py_ssize_t *depth_at, Py_ssize_t *at, int *node,
                            bint *expecting_key) noexcept nogil:
    """Past the separators and closers after a value at ``at[0]``, possibly several levels up, to the
    next member (``expecting_key``) or element (``node``: its path node): 0, DOCUMENT_END after the
    document's last byte, or a status code."""
    cdef const uint8_t *buf = s.buf
    cdef Node *nodes = s.nodes
    cdef Py_ssize_t n = s.n, pos = at[0], depth = depth_at[0]
    cdef Frame *frame
    cdef uint8_t c
    while True:
        if depth == 0:
            pos = skip_ws(buf, pos, n)
            if pos != n:
                return fail(s, E_TRAILING, pos)
            return DOCUMENT_END
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
                expecting_key[0] = True
            else:
                frame.index += 1
                node[0] = index_child(s, frame.node, frame.index)
                frame.elem_start = pos
            at[0] = pos
            depth_at[0] = depth
            return 0
        if frame.is_object:
            if c != 0x7D:
                return fail(s, E_OBJECT_SEPARATOR, pos)
        elif c != 0x5D:
            return fail(s, E_ARRAY_SEPARATOR, pos)
        pos += 1
        depth -= 1
        close_frame(nodes, frame, pos)


cdef int run(Scanner *s) noexcept nogil:
    """Validate (as ``s.validate`` asks) and record the spans of the nodes; 0 or a status code."""
    # The scanner's fields live in locals here: every store through a Node or Frame pointer could
    # alias them otherwise (the build has -fno-strict-aliasing), and they would be reloaded each time.
    cdef const uint8_t *buf = s.buf
    cdef Py_ssize_t n = s.n, pos, start, depth = 0, array_end
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
            code = read_key(s, &frames[depth - 1], &pos, &node)
            if code:
                return code
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
        code = after_value(s, frames, &depth, &pos, &node, &expecting_key)
        if code:
            return 0 if code == DOCUMENT_END else code


# -- compiled path sets --------------------------------------------------------------------------------

cdef enum:
    # How the span of a path is read off its end node.
    END_VALUE = 0
    END_LAST = 1  # the path ends with -1: the last element's span
    END_KEY = 2  # the path ends with a key (find_member_spans: the member spans key to value)


cdef class _PathSet:
    """Paths compiled to a flat node array (fields in _scan.pxd); cached, so a hot caller pays for it once."""

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


cdef void _scan_end(Scanner *s, Node *inline_nodes) noexcept:
    if s.frames_on_heap:
        free(s.frames)
    free(s.scratch)
    if s.nodes != inline_nodes:
        free(s.nodes)


cdef void _span_of(Scanner *s, _PathSet compiled, Py_ssize_t path, bint members,
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


cdef object _span_tuple(Py_ssize_t start, Py_ssize_t end):
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
