/* The token codec's C helpers that touch Python objects (fastcore/_codec.pyx):
 * reading small ints straight from the object, a shared cache of small id
 * objects for decode_tokens_list, ASCII str data. The base64 kernels are
 * b64simd.c's, with no Python in them.
 */
#ifndef FASTCORE_CODEC_OBJECTS_H
#define FASTCORE_CODEC_OBJECTS_H

#include <Python.h>
#include <stdint.h>

#if PY_VERSION_HEX < 0x030B0000
#include "longintrepr.h"
#endif
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define FC_HOST_LITTLE_ENDIAN 0
#else
#define FC_HOST_LITTLE_ENDIAN 1
#endif

/* The value of an exact int (or bool) that fits in one or two digits,
 * read straight from the object: PyLong_AsLong's call and error
 * protocol cost more than the rest of the per-id work. Returns 0 for
 * anything else, which takes the slow path. */
static inline int fc_read_small_int(PyObject *o, long long *value) {
    if (!(PyLong_CheckExact(o) || PyBool_Check(o))) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o)) return 0;
    *value = (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
    return 1;
#else
    const digit *d = ((PyLongObject *)o)->ob_digit;
    switch (Py_SIZE(o)) {
    case 0: *value = 0; return 1;
    case 1: *value = (long long)d[0]; return 1;
    case -1: *value = -(long long)d[0]; return 1;
    case 2: *value = (long long)d[0] | (long long)d[1] << PyLong_SHIFT; return 1;
    case -2: *value = -((long long)d[0] | (long long)d[1] << PyLong_SHIFT); return 1;
    default: return 0;
    }
#endif
}

static inline int32_t fc_to_le32(int32_t v) {
#if FC_HOST_LITTLE_ENDIAN
    return v;
#else
    return (int32_t)__builtin_bswap32((uint32_t)v);
#endif
}

/* Token ids below this bound (2**18 covers the vocabularies of Llama 3,
 * Qwen 2 and Gemma) are turned into int objects once and shared after:
 * decode_tokens_list then costs an INCREF per id instead of an
 * allocation, which is most of what tolist() spends. The cache holds at
 * most 2**18 ints (about 10 MB) and only the ids actually seen. */
#define FC_INT_CACHE_SIZE (1 << 18)
static PyObject **fc_int_cache = NULL;

static inline PyObject *fc_id_to_int(int32_t v) {
    if ((uint32_t)v < FC_INT_CACHE_SIZE && fc_int_cache != NULL) {
        PyObject *o = fc_int_cache[v];
        if (o == NULL) {
            o = PyLong_FromLong(v);
            if (o == NULL) return NULL;
            fc_int_cache[v] = o;
        }
        Py_INCREF(o);
        return o;
    }
    return PyLong_FromLong(v);
}

/* Builds list[start:start+n] from ids; returns -1 with an exception set. */
static inline int fc_fill_list(PyObject *list, Py_ssize_t start, const int32_t *ids, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *o = fc_id_to_int(ids[k]);
        if (o == NULL) return -1;
        PyList_SET_ITEM(list, start + k, o);
    }
    return 0;
}

static inline int fc_int_cache_init(void) {
    if (fc_int_cache == NULL) {
        fc_int_cache = (PyObject **)PyMem_Calloc(FC_INT_CACHE_SIZE, sizeof(PyObject *));
        if (fc_int_cache == NULL) { PyErr_NoMemory(); return -1; }
    }
    return 0;
}

static inline int fc_unicode_ascii_data(PyObject *s, const char **data, Py_ssize_t *length) {
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(s) == -1) return -1;
#endif
    if (!PyUnicode_IS_ASCII(s)) return 0;
    *data = (const char *)PyUnicode_DATA(s);
    *length = PyUnicode_GET_LENGTH(s);
    return 1;
}

#endif
