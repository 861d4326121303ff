# The C types of breaker.py, compiled in Cython's pure-Python mode as server.orchestrator._breaker
# (setup.py): Cython looks this file up by the compiled module's name. The states are C ints,
# the breaker a cdef class (its state an int, its open time a double, probing a C flag); the
# counts and the configured figures stay Python objects, as the pure twin has them.

cdef int _CLOSED, _HALF_OPEN, _OPEN
cdef list _epoch


cdef class CircuitBreaker:
    cdef public object threshold
    cdef public object open_s
    cdef public int _state
    cdef public object failures
    cdef public object open_for
    cdef public double opened_at
    cdef public bint probing
    cdef public object opened
