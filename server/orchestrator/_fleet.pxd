from libc.stdint cimport int64_t


cdef extern from "fleet_atomics.h" nogil:
    int64_t fc_load(int64_t *p)
    int64_t fc_fetch_add(int64_t *p, int64_t v)
    int64_t fc_exchange(int64_t *p, int64_t v)
    int fc_cas(int64_t *p, int64_t *expected, int64_t desired)
