# C declarations for _codec.pyx: the base64 kernels (include/b64simd.h) and the helpers that
# read Python objects (include/codec_objects.h).
from cpython.object cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t


cdef extern from "b64simd.h" nogil:
    enum:
        FC_SIMD_SCALAR
        FC_SIMD_SSSE3
        FC_SIMD_AVX2
        FC_SIMD_AVX512VBMI
        FC_SIMD_COUNT
    enum:
        FC_B64_OK
        FC_B64_BAD_CHAR
        FC_B64_MISPLACED_PAD
        FC_B64_NONZERO_PAD_BITS

    void fc_b64_init()
    int fc_simd_available(int path)
    int fc_simd_select(int path)
    int fc_simd_selected()
    const char *fc_simd_name(int path)
    size_t fc_b64_encoded_len(size_t nbytes)
    void fc_b64_encode(const uint8_t *src, size_t nbytes, char *dst)
    int fc_b64_decode(const char *src, size_t length, int pad, uint8_t *dst, size_t *bad_offset)
    int64_t fc_encode_ints(const char *base, size_t count, Py_ssize_t stride, int itemsize, int is_signed,
                           int byteswap, char *dst)
    void fc_le32_to_host(int32_t *values, size_t count)
    size_t fc_b64_alphabet_run(const uint8_t *p, size_t i, size_t n, int path)


cdef extern from "codec_objects.h":
    int FC_HOST_LITTLE_ENDIAN
    bint fc_read_small_int(PyObject *o, long long *value)
    int32_t fc_to_le32(int32_t v) nogil
    int fc_unicode_ascii_data(object s, const char **data, Py_ssize_t *length) except -1
    int fc_fill_list(object lst, Py_ssize_t start, const int32_t *ids, Py_ssize_t n) except -1
    int fc_int_cache_init() except -1


# check_token_b64 on buf[lo:hi] (absolute offsets): the id count, or TokenDecodeError (the relay kernels).
cdef Py_ssize_t _check_b64(const uint8_t *buf, Py_ssize_t lo, Py_ssize_t hi) except -1
