# The JSON span scanner (_scan.pyx): its C state, the C it calls (include/), and what the relay kernels
# (_relay.pyx) and the chunk hashes (_hash.pyx) cimport of it.
from libc.stdint cimport uint8_t


cdef extern from "scan_simd.h":
    void fc_js_init() noexcept
    const char *fc_js_kernel() noexcept
    bint fc_js_avx2
    bint fc_js_avx512
    Py_ssize_t fc_js_plain_run(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil
    Py_ssize_t fc_js_quote_or_backslash(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil


cdef struct Node:
    # One step of the compiled path set (see _jsonspan_py._Node).
    int first_child
    int next_sibling
    bint is_key  # reached from its parent by a key (else by an index)
    const char *key  # the key as UTF-8 (lone surrogates kept), owned by the compiled path set
    Py_ssize_t key_len  # -1 on an index node
    Py_ssize_t index
    bint has_keys
    bint has_items
    bint last  # some path ends with -1 here
    bint terminal  # some path ends here
    # Per scan:
    bint seen
    Py_ssize_t start
    Py_ssize_t end
    Py_ssize_t key_start
    Py_ssize_t last_start
    Py_ssize_t last_end


cdef struct Frame:
    # One open container.
    int node  # -1: not on a requested path
    bint is_object
    bint has_last
    Py_ssize_t start
    Py_ssize_t index
    Py_ssize_t elem_start
    Py_ssize_t last_start
    Py_ssize_t last_end


cdef struct Scanner:
    const uint8_t *buf
    Py_ssize_t n
    bint validate
    Node *nodes  # NULL: no paths, validate only
    Frame *frames
    Py_ssize_t depth
    Py_ssize_t capacity
    bint frames_on_heap
    uint8_t *scratch  # unescaped keys
    Py_ssize_t scratch_capacity
    Py_ssize_t error_offset
    int error_node


cdef enum:
    INLINE_FRAMES = 64
    INLINE_NODES = 32
    # Below this size releasing the GIL costs more than it frees.
    NOGIL_MIN_BYTES = 65536


cdef class _PathSet:
    cdef Node *nodes
    cdef int count
    cdef int *end_nodes  # per path: the index of its end node
    cdef uint8_t *end_kinds  # per path: END_*
    cdef Py_ssize_t n_paths
    cdef object source  # the paths as given (the identity cache checks it)
    cdef list keys  # owns the key bytes the nodes point into
    cdef list labels  # the str key of each node (for the duplicate-key message), or None


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


# One scan over a body: begin, run (raises the scan's error), read each path's span, end.
cdef _PathSet _build_path_set(object paths)
cdef int _scan_begin(Scanner *s, _PathSet compiled, const uint8_t *buf, Py_ssize_t n, bint validate,
                     Frame *inline_frames, Node *inline_nodes) except -1
cdef int _scan_run(Scanner *s, _PathSet compiled) except -1
cdef void _span_of(Scanner *s, _PathSet compiled, Py_ssize_t path, bint members,
                   Py_ssize_t *start, Py_ssize_t *end) noexcept
cdef void _scan_end(Scanner *s, Node *inline_nodes) noexcept
cdef int _get_body(object body, Py_buffer *view) except -1
cdef object _span_tuple(Py_ssize_t start, Py_ssize_t end)
