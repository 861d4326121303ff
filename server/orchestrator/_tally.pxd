# The C types of tally.py, compiled in Cython's pure-Python mode as server.orchestrator._tally
# (setup.py): Cython looks this file up by the compiled module's name. The classes are cdef
# classes: a counter's count a C integer, a histogram's sum a C double, its flag a C flag and its
# bucket counts a typed view of the pure twin's array('q') (a C increment, no int object); observe
# a cpdef to declare its amount a double and its bisection's locals C numbers.

cimport cython


cdef class TallyOne:
    cdef public object native
    cdef public object _value
    cdef public long long n


cdef class TallyHistogram:
    cdef public object native
    cdef public tuple _bounds
    cdef public tuple _buckets
    cdef public object _sum
    cdef public long long[:] counts
    cdef public double sum
    cdef public bint pending

    @cython.locals(bounds=tuple, lo=Py_ssize_t, hi=Py_ssize_t, mid=Py_ssize_t, bound=double)
    cpdef observe(self, double amount)


cdef class NoClock:
    pass
