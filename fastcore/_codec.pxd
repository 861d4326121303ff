# C declarations of the base64 kernels (_b64simd.h) for _codec.pyx.
from libc.stdint cimport int32_t, int64_t, uint8_t


cdef extern from "_b64simd.h" nogil:
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
