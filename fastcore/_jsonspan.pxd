# C state of the JSON span scanner (_jsonspan.pyx) and the C it calls (include/).
from libc.stdint cimport uint8_t


cdef extern from "scan_simd.h":
    void fc_js_init() noexcept
    const char *fc_js_kernel() noexcept
    bint fc_js_avx2
    Py_ssize_t fc_js_plain_run(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil
    Py_ssize_t fc_js_quote_or_backslash(const uint8_t *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil


cdef extern from "b64simd.h":
    size_t fc_b64_alphabet_run(const uint8_t *p, size_t i, size_t n, int use_avx2) noexcept nogil


cdef extern from "chunk_hash.h":
    ctypedef unsigned long long fc_u64 "uint64_t"
    void fc_chunk_hashes(const uint8_t *p, Py_ssize_t n, Py_ssize_t chunk, fc_u64 *out) noexcept nogil


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
