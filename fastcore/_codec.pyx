# cython: freethreading_compatible = False
"""Compiled twin of ``fastcore._codec_py``: the int32 <-> base64 token codec.

Same inputs, exceptions and messages as the pure-Python twin (whose message
builders it imports); the work is done by the C kernels in include/b64simd.c, which
pick an SSSE3 / AVX2 / AVX-512 VBMI / scalar kernel once, at import.
Token ids never become a Python list unless the caller asks for one.
"""

from cpython.buffer cimport (
    PyBUF_RECORDS_RO,
    PyBUF_SIMPLE,
    PyBUF_WRITABLE,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyObject_CheckBuffer,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.list cimport PyList_New
from cpython.object cimport PyObject
from libc.stdint cimport INT32_MAX, INT32_MIN, int32_t, int64_t, uint8_t

from fastcore.errors import TokenDecodeError

from fastcore._codec_py import (
    _changed_size_error,
    _char_error,
    _check_out_format,
    _data_type_error,
    _decode_error,
    _ids_type_error,
    _int_format,
    _length_error,
    _max_tokens_limit,
    _ndim_error,
    _non_ascii_error,
    _not_integer_error,
    _out_capacity_error,
    _out_of_range_error,
    _partial_id_error,
    _tensor_as_numpy,
    _too_many_error,
)


cdef extern from "Python.h":
    PyObject **PySequence_Fast_ITEMS(object o)
    Py_ssize_t PySequence_Fast_GET_SIZE(object o)
    bint PyList_Check(object o)
    bint PyTuple_Check(object o)
    bint PyUnicode_Check(object o)
    bint PyBytes_CheckExact(object o)
    bint PyBytes_Check(object o)
    bint PyByteArray_Check(object o)
    bint PyIndex_Check(object o)
    Py_ssize_t PyBytes_GET_SIZE(object o)
    object PyNumber_Index(object o)
    long long PyLong_AsLongLongAndOverflow(object o, int *overflow) except? -1


cdef enum:
    # Ids per stack chunk: 1536 * 4 bytes is a multiple of 3, so chunks encode
    # back to back with no padding between them (and decode from whole quads).
    CHUNK_IDS = 1536
    # Above this many ids the kernels run with the GIL released: below it, the
    # release/re-acquire costs more than other threads could gain.
    NOGIL_MIN_IDS = 4096
    # The same for check_token_b64, in bytes.
    NOGIL_CHECK_BYTES = 65536

fc_b64_init()

import fastcore._codec_py as _py

# b64simd.h's status codes are the numbers the pure twin's _decode_error words: held to each other here.
if (FC_B64_BAD_CHAR, FC_B64_MISPLACED_PAD, FC_B64_NONZERO_PAD_BITS) != (
    _py.BAD_CHAR, _py.MISPLACED_PAD, _py.NONZERO_PAD_BITS
):
    raise ImportError("fastcore._codec: include/b64simd.h's FC_B64_* codes differ from fastcore._codec_py's")

cdef dict _PATH_IDS = {fc_simd_name(p).decode(): p for p in range(FC_SIMD_COUNT)}

#: The kernel the run-time dispatch chose (``"avx512vbmi"``, ``"avx2"``,
#: ``"ssse3"`` or ``"scalar"``).
SIMD_PATH = fc_simd_name(fc_simd_selected()).decode()

cdef object _np_empty = None
cdef object _np_int32 = None


def _available_simd_paths():
    """Names of the kernels this CPU can run, best last (for tests and benchmarks)."""
    return [fc_simd_name(p).decode() for p in range(FC_SIMD_COUNT) if fc_simd_available(p)]


def _get_simd_path():
    """The kernel in use now."""
    return fc_simd_name(fc_simd_selected()).decode()


def _set_simd_path(name):
    """Switches every later call to kernel ``name`` (tests and benchmarks only)."""
    if name not in _PATH_IDS or fc_simd_select(_PATH_IDS[name]) != 0:
        raise ValueError(f"SIMD path {name!r} is not available here; available: {_available_simd_paths()}")


# ------------------------------------------------------------------ encode


cdef int _slow_int_value(object ids, Py_ssize_t index, long long *value) except -1:
    """Value of ids[index] when it is not a small exact int: __index__ objects,
    int subclasses, big ints; TypeError for floats, None, str ..."""
    cdef int overflow = 0
    item = ids[index]
    if not PyIndex_Check(item):
        raise _not_integer_error(index, item)
    number = PyNumber_Index(item)
    value[0] = PyLong_AsLongLongAndOverflow(number, &overflow)
    if overflow:
        raise _out_of_range_error(index)
    return 0


cdef bytes _encode_sequence(object ids):
    cdef Py_ssize_t count = PySequence_Fast_GET_SIZE(ids)
    cdef Py_ssize_t start, k, n
    cdef long long value = 0
    cdef PyObject **items
    cdef int32_t chunk[CHUNK_IDS]
    if count > (<Py_ssize_t>1 << 60):
        raise OverflowError("too many token ids")
    out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>fc_b64_encoded_len(<size_t>count * 4))
    cdef char *dst = PyBytes_AS_STRING(out)
    for start in range(0, count, CHUNK_IDS):
        n = min(<Py_ssize_t>CHUNK_IDS, count - start)
        items = PySequence_Fast_ITEMS(ids)
        for k in range(n):
            if not fc_read_small_int(items[start + k], &value):
                _slow_int_value(ids, start + k, &value)
                # __index__ is arbitrary code: the list may have moved or shrunk.
                if PySequence_Fast_GET_SIZE(ids) != count:
                    raise _changed_size_error()
                items = PySequence_Fast_ITEMS(ids)
            if value < INT32_MIN or value > INT32_MAX:
                raise _out_of_range_error(start + k)
            chunk[k] = fc_to_le32(<int32_t>value)
        fc_b64_encode(<const uint8_t *>chunk, <size_t>n * 4, dst)
        dst += n * 4 // 3 * 4  # exact for every chunk but the last, which needs no more
    return out


cdef inline bint _is_native_int32(const char *fmt, Py_ssize_t itemsize):
    # The one format worth a C-level shortcut: numpy/array int32 ("i", "<i", "=i").
    if itemsize != 4 or not FC_HOST_LITTLE_ENDIAN:
        return False
    if fmt[0] == b'@' or fmt[0] == b'=' or fmt[0] == b'<':
        fmt += 1
    return (fmt[0] == b'i' or fmt[0] == b'l') and fmt[1] == 0


cdef bytes _encode_buffer(object obj):
    cdef Py_buffer view
    cdef Py_ssize_t count
    cdef int64_t bad = -1
    cdef bint signed = True, byteswap = False
    cdef char *dst
    PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO)
    try:
        if view.ndim != 1:
            raise _ndim_error(view.ndim)
        if not _is_native_int32(view.format, view.itemsize):
            signed, byteswap = _int_format(view.format.decode("ascii", "replace"), view.itemsize, "ids")
        count = view.shape[0]
        out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>fc_b64_encoded_len(<size_t>count * 4))
        dst = PyBytes_AS_STRING(out)
        if view.itemsize == 4 and signed and not byteswap and view.strides[0] == 4 and FC_HOST_LITTLE_ENDIAN:
            if count >= NOGIL_MIN_IDS:
                with nogil:
                    fc_b64_encode(<const uint8_t *>view.buf, <size_t>count * 4, dst)
            else:
                fc_b64_encode(<const uint8_t *>view.buf, <size_t>count * 4, dst)
        else:
            if count >= NOGIL_MIN_IDS:
                with nogil:
                    bad = fc_encode_ints(<const char *>view.buf, <size_t>count, view.strides[0],
                                         <int>view.itemsize, signed, byteswap, dst)
            else:
                bad = fc_encode_ints(<const char *>view.buf, <size_t>count, view.strides[0],
                                     <int>view.itemsize, signed, byteswap, dst)
            if bad >= 0:
                raise _out_of_range_error(bad)
        return out
    finally:
        PyBuffer_Release(&view)


def encode_tokens(ids):
    """Standard base64 (RFC 4648, padded) of ``ids`` as little-endian int32.

    ``ids``: list or tuple of int, a 1-D buffer of integers (numpy array,
    array.array, memoryview; strided is fine), or a CPU torch tensor.
    OverflowError names the first id outside int32; TypeError for
    non-integers.
    """
    if PyList_Check(ids) or PyTuple_Check(ids):
        return _encode_sequence(ids)
    # bytes are base64 input or text, never ids: most likely a mix-up.
    if PyObject_CheckBuffer(ids) and not (PyBytes_Check(ids) or PyByteArray_Check(ids)):
        return _encode_buffer(ids)
    tensor = _tensor_as_numpy(ids, "ids")
    if tensor is None:
        raise _ids_type_error(ids)
    return _encode_buffer(tensor)


# ------------------------------------------------------------------ decode


cdef struct Source:
    const char *data
    Py_ssize_t length
    bint has_view
    Py_buffer view


cdef int _open_source(object data, Source *src) except -1:
    src.has_view = False
    if PyUnicode_Check(data):
        if not fc_unicode_ascii_data(data, &src.data, &src.length):
            raise _non_ascii_error(data)
        return 0
    if PyBytes_CheckExact(data):
        src.data = PyBytes_AS_STRING(data)
        src.length = PyBytes_GET_SIZE(data)
        return 0
    if not PyObject_CheckBuffer(data):
        raise _data_type_error(data)
    # A buffer export also stops a bytearray from being resized under us
    # while the GIL is released.
    PyObject_GetBuffer(data, &src.view, PyBUF_RECORDS_RO)
    src.has_view = True
    if not PyBuffer_IsContiguous(&src.view, b'C'):
        _close_source(src)
        raise TypeError("data buffer must be C-contiguous")
    src.data = <const char *>src.view.buf
    src.length = src.view.len
    return 0


cdef inline void _close_source(Source *src):
    if src.has_view:
        PyBuffer_Release(&src.view)
        src.has_view = False


cdef inline int _pad_count(const Source *src):
    if src.length == 0 or src.data[src.length - 1] != b'=':
        return 0
    return 2 if src.data[src.length - 2] == b'=' else 1


cdef Py_ssize_t _token_count(const Source *src, object max_tokens) except -1:
    """Everything the length alone decides, before any allocation."""
    cdef Py_ssize_t limit = -1 if max_tokens is None else _max_tokens_limit(max_tokens)
    cdef Py_ssize_t nbytes
    # A length problem is raised only after a look for a bad character (error path only: a
    # copy and one scan), which is what a caller needs to hear about first.
    if src.length % 4:
        raise _char_error(src.data[:src.length]) or _length_error(src.length)
    nbytes = src.length // 4 * 3 - _pad_count(src)
    if limit >= 0 and nbytes // 4 > limit:
        raise _char_error(src.data[:src.length]) or _too_many_error(nbytes // 4, limit)
    if nbytes % 4:
        raise _char_error(src.data[:src.length]) or _partial_id_error(nbytes)
    return nbytes // 4


cdef int _decode_into(const Source *src, Py_ssize_t count, void *dst) except -1:
    cdef size_t bad_offset = 0
    cdef int status
    cdef int pad = _pad_count(src)
    if count >= NOGIL_MIN_IDS:
        with nogil:
            status = fc_b64_decode(src.data, <size_t>src.length, pad, <uint8_t *>dst, &bad_offset)
    else:
        status = fc_b64_decode(src.data, <size_t>src.length, pad, <uint8_t *>dst, &bad_offset)
    if status != FC_B64_OK:
        raise _decode_error(status, bad_offset, <uint8_t>src.data[bad_offset])
    fc_le32_to_host(<int32_t *>dst, <size_t>count)
    return 0


def decode_tokens(data, *, max_tokens=None):
    """The ids in ``data`` as a new 1-D int32 numpy array that owns its memory.

    ``data``: bytes, bytearray, memoryview or ASCII str. TokenDecodeError (a
    binascii.Error) names the byte offset of the first bad character.
    """
    global _np_empty, _np_int32
    cdef Source src
    cdef Py_buffer out_view
    cdef Py_ssize_t count
    if _np_empty is None:
        import numpy
        _np_empty, _np_int32 = numpy.empty, numpy.dtype(numpy.int32)
    _open_source(data, &src)
    try:
        count = _token_count(&src, max_tokens)
        array = _np_empty(count, _np_int32)
        PyObject_GetBuffer(array, &out_view, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            _decode_into(&src, count, out_view.buf)
        finally:
            PyBuffer_Release(&out_view)
        return array
    finally:
        _close_source(&src)


def decode_tokens_list(data, *, max_tokens=None):
    """The ids in ``data`` as a list of int (decoded a stack chunk at a time)."""
    cdef Source src
    cdef Source piece
    cdef Py_ssize_t count, start, n
    cdef size_t bad_offset = 0
    cdef int status, pad
    cdef int32_t chunk[CHUNK_IDS]
    fc_int_cache_init()
    _open_source(data, &src)
    try:
        count = _token_count(&src, max_tokens)
        pad = _pad_count(&src)
        ids = PyList_New(count)
        for start in range(0, count, CHUNK_IDS):
            n = min(<Py_ssize_t>CHUNK_IDS, count - start)
            piece.data = src.data + start // 3 * 16
            if start + n == count:  # the last chunk owns the padding
                piece.length = src.length - start // 3 * 16
                status = fc_b64_decode(piece.data, <size_t>piece.length, pad, <uint8_t *>chunk, &bad_offset)
            else:
                piece.length = n // 3 * 16
                status = fc_b64_decode(piece.data, <size_t>piece.length, 0, <uint8_t *>chunk, &bad_offset)
            if status != FC_B64_OK:
                raise _decode_error(status, start // 3 * 16 + bad_offset,
                                    <uint8_t>piece.data[bad_offset])
            fc_le32_to_host(chunk, <size_t>n)
            fc_fill_list(ids, start, chunk, n)
        return ids
    finally:
        _close_source(&src)


def decode_tokens_into(data, out, *, max_tokens=None):
    """Decodes ``data`` into the writable, C-contiguous int32 buffer ``out``.

    Returns the id count; ValueError if ``out`` is too small (checked before
    anything is written). On a decode error the contents of ``out`` are
    unspecified.
    """
    cdef Source src
    cdef Py_buffer out_view
    cdef Py_ssize_t count, capacity
    _open_source(data, &src)
    try:
        if not PyObject_CheckBuffer(out):
            tensor = _tensor_as_numpy(out, "out")
            if tensor is None:
                raise TypeError(f"out must be a writable int32 buffer, not {type(out).__name__}")
            out = tensor
        PyObject_GetBuffer(out, &out_view, PyBUF_RECORDS_RO)
        try:
            if out_view.readonly:
                raise TypeError("out buffer is read-only")
            if not _is_native_int32(out_view.format, out_view.itemsize):
                _check_out_format(out_view.format.decode("ascii", "replace"), out_view.itemsize)
            if not PyBuffer_IsContiguous(&out_view, b'C'):
                raise TypeError("out buffer must be C-contiguous")
            count = _token_count(&src, max_tokens)
            capacity = out_view.len // 4
            if count > capacity:
                raise _out_capacity_error(capacity, count)
            _decode_into(&src, count, out_view.buf)
            return count
        finally:
            PyBuffer_Release(&out_view)
    finally:
        _close_source(&src)


# ------------------------------------------------------- relayed base64 check


cdef Py_ssize_t _check_b64(const uint8_t *buf, Py_ssize_t lo, Py_ssize_t hi) except -1:
    """check_token_b64 on ``buf[lo:hi]`` (offsets absolute): the id count, or TokenDecodeError."""
    cdef Py_ssize_t i, data_end, padding = 0, length, decoded
    cdef int last_value
    cdef uint8_t c
    cdef int path = fc_simd_selected()
    if hi - lo >= NOGIL_CHECK_BYTES:
        with nogil:
            i = <Py_ssize_t>fc_b64_alphabet_run(buf, lo, hi, path)
    else:
        i = <Py_ssize_t>fc_b64_alphabet_run(buf, lo, hi, path)
    data_end = i
    while i < hi and buf[i] == 0x3D and padding < 2:
        padding += 1
        i += 1
    if i < hi:
        if padding:
            raise TokenDecodeError(f"base64 padding '=' before the end of the data (byte {data_end})", data_end)
        raise TokenDecodeError(f"invalid base64 character {chr(buf[i])!r} (byte {i})", i)
    length = hi - lo
    if length % 4:
        raise TokenDecodeError(f"base64 length {length} is not a multiple of 4", None)
    if padding:
        if data_end == lo:
            raise TokenDecodeError(f"non-canonical base64 padding (byte {data_end - 1})", data_end - 1)
        c = buf[data_end - 1]
        if c >= 0x61:
            last_value = c - 0x61 + 26
        elif c >= 0x41:
            last_value = c - 0x41
        elif c >= 0x30:
            last_value = c - 0x30 + 52
        elif c == 0x2B:
            last_value = 62
        else:
            last_value = 63
        if last_value & (0x0F if padding == 2 else 0x03):
            raise TokenDecodeError(f"non-canonical base64 padding (byte {data_end - 1})", data_end - 1)
    decoded = length // 4 * 3 - padding
    if decoded % 4:
        raise TokenDecodeError(f"base64 decodes to {decoded} bytes, not a whole number of int32 ids", None)
    return decoded // 4


def check_token_b64(body, start=0, end=None):
    """Check that ``body[start:end]`` is ``prompt_token_ids_b64`` content; return the id count.

    Standard alphabet, ``=`` padding only at the end, length a multiple of 4,
    canonical (unused bits zero), decoding to a whole number of int32s; no
    escapes. Raises :class:`fastcore.TokenDecodeError` with the absolute offset.
    """
    cdef Py_buffer view
    cdef Py_ssize_t size
    try:
        PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    except TypeError:
        raise TypeError(f"body must be bytes-like, not {type(body).__name__}") from None
    except BufferError:
        raise BufferError("body must be a contiguous buffer") from None
    try:
        size = view.len
        if end is None:
            end = size
        if not 0 <= start <= end <= size:
            raise ValueError(f"need 0 <= start <= end <= len(body) = {size}, got ({start}, {end})")
        return _check_b64(<const uint8_t *>view.buf, start, end)
    finally:
        PyBuffer_Release(&view)
