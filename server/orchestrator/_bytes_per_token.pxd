# The C types of bytes_per_token.py, compiled in Cython's pure-Python mode as
# server.orchestrator._bytes_per_token (setup.py): Cython looks this file up by the compiled
# module's name. Its constants, BytesPerToken's fields and observe's locals are C doubles (observe
# a cpdef to declare them; its arguments stay Python objects, as the pure twin takes them).

cimport cython

cdef double DEFAULT_BYTES_PER_TOKEN, MIN_BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN
cdef double DECAY, SEED_TOKENS, OUTLIER_FACTOR, MAX_STEP


cdef class BytesPerToken:
    cdef public double value
    cdef public double _bytes
    cdef public double _tokens
    cdef public long long observed

    @cython.locals(ratio=double, value=double, nbytes=double, ntokens=double, low=double, high=double,
                   tokens=double, target=double)
    cpdef observe(self, prompt_bytes, prompt_tokens)
