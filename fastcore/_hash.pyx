# cython: freethreading_compatible = False
"""Compiled twin of ``fastcore._hash_py``: chained 64-bit hashes of fixed-size chunks, the routers'
prefix keys. The pure twin defines the hash; include/chunk_hash.h is the same arithmetic in C, four
independent lanes per step (its constants are checked against the twin's at import)."""

from cpython.buffer cimport PyBuffer_Release
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint8_t
from libc.stdlib cimport free, malloc

from fastcore._scan cimport _get_body


cdef extern from "chunk_hash.h":
    ctypedef unsigned long long fc_u64 "uint64_t"
    void fc_chunk_hashes(const uint8_t *p, Py_ssize_t n, Py_ssize_t chunk, fc_u64 *out) noexcept nogil
    const fc_u64 FC_CH_SEED0, FC_CH_SEED1, FC_CH_SEED2, FC_CH_SEED3
    const fc_u64 FC_CH_P0, FC_CH_P1, FC_CH_P2, FC_CH_P3
    const fc_u64 FC_CH_CHAIN_SEED, FC_CH_CHAIN_MUL


import fastcore._hash_py as _py_chunk

if (_py_chunk.CHUNK_LANE_SEEDS, _py_chunk.CHUNK_PRIMES, _py_chunk.CHUNK_CHAIN_SEED, _py_chunk.CHUNK_CHAIN_MUL) != (
    (FC_CH_SEED0, FC_CH_SEED1, FC_CH_SEED2, FC_CH_SEED3),
    (FC_CH_P0, FC_CH_P1, FC_CH_P2, FC_CH_P3),
    FC_CH_CHAIN_SEED,
    FC_CH_CHAIN_MUL,
):
    raise ImportError("fastcore._hash: the constants of include/chunk_hash.h differ from fastcore._hash_py's")

cdef object _check_chunk_args = _py_chunk.check_chunk_args


def chunk_hashes(data, start, end, chunk):
    """The chained 64-bit hashes of the full ``chunk``-byte chunks of ``data[start:end]``.

    ``fastcore._hash_py.chunk_hashes`` defines them (same ints, same errors).
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
