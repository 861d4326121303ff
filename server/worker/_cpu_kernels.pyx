# cython: language_level=3, auto_pickle=False
"""The worker forward's CPU kernels in C (server/worker/cpu_decode.c): the compiled twin of
:mod:`.cpu_kernels`, which documents each function and picks this module where it is built.

Each function checks what it is given (float32 CPU tensors, the shapes and strides the C reads)
and raises ValueError naming the argument, so a wrong call is an error, never a read out of
bounds; then runs the C without the GIL (the event loop thread goes on meanwhile).
"""

from libc.math cimport pow
from libc.stdint cimport int64_t, uintptr_t

import torch

cdef extern from "cpu_decode.h" nogil:
    int FC_DECODE_GENERIC
    int FC_DECODE_AVX2
    int fc_decode_path()
    int fc_decode_use(int path)
    int fc_decode_supported(int path)
    void fc_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps)
    void fc_add_rms_norm(float *x, float *residual, const float *w, int64_t rows, int64_t dim, float eps)
    void fc_silu_mul(const float *gu, float *out, int64_t rows, int64_t inner)
    int fc_rope(float *x, int64_t rows, int64_t heads, int64_t row_stride, int64_t dim, const float *cos,
                const float *signed_sin, const int64_t *positions, int64_t table_rows)
    int fc_paged_decode(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                        float *pool_k, float *pool_v, int64_t slots, const int64_t *table, int64_t width,
                        int64_t block_size, const int64_t *lengths, int64_t batch, int64_t heads,
                        int64_t kv_heads, int64_t dim, float scale, float *out)

cdef object _F32 = torch.float32
cdef object _I64 = torch.int64

#: the kernel builds by name (FC_DECODE_*), for tests and the bench
PATHS = {"generic": FC_DECODE_GENERIC, "avx2": FC_DECODE_AVX2}


def path():
    """The name of the build that runs."""
    return "avx2" if fc_decode_path() == FC_DECODE_AVX2 else "generic"


def supported(str name):
    return bool(fc_decode_supported(PATHS[name]))


def use(str name):
    """Run the ``name`` build from now on (tests compare them); ValueError where this CPU lacks it."""
    if fc_decode_use(PATHS[name]) != 0:
        raise ValueError(f"this CPU cannot run the {name} kernels")


cdef uintptr_t _data(object t, str name, object dtype, bint contiguous) except 0:
    if t.dtype is not dtype or not t.is_cpu:
        raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    cdef uintptr_t p = t.data_ptr()
    if p == 0:  # an empty tensor: no caller passes one (rows are checked before)
        raise ValueError(f"{name} is empty")
    return p


cdef void _same_shape(object a, str a_name, object b, str b_name) except *:
    if a.shape != b.shape:
        raise ValueError(f"{a_name} {tuple(a.shape)} and {b_name} {tuple(b.shape)} differ")


cdef int64_t _rows_of(object x, str name, object weight) except -1:
    if x.dim() < 1 or weight.dim() != 1 or x.size(-1) != weight.shape[0]:
        raise ValueError(f"{name} {tuple(x.shape)} does not end in weight's {tuple(weight.shape)}")
    return x.numel() // weight.shape[0]


def rms_norm(x, weight, float eps):
    cdef int64_t dim = weight.shape[0]
    cdef int64_t rows = _rows_of(x, "x", weight)
    out = x.new_empty(x.shape)
    if rows == 0:
        return out
    cdef const float *px = <const float *>_data(x, "x", _F32, True)
    cdef const float *pw = <const float *>_data(weight, "weight", _F32, True)
    cdef float *po = <float *>_data(out, "out", _F32, True)
    with nogil:
        fc_rms_norm(px, pw, po, rows, dim, eps)
    return out


def add_rms_norm_(x, residual, weight, float eps):
    cdef int64_t dim = weight.shape[0]
    cdef int64_t rows = _rows_of(x, "x", weight)
    _same_shape(x, "x", residual, "residual")
    if rows == 0:
        return
    cdef float *px = <float *>_data(x, "x", _F32, True)
    cdef float *pr = <float *>_data(residual, "residual", _F32, True)
    cdef const float *pw = <const float *>_data(weight, "weight", _F32, True)
    if px == pr:
        raise ValueError("x and residual must not share memory")
    with nogil:
        fc_add_rms_norm(px, pr, pw, rows, dim, eps)


def silu_mul(gate_up):
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2 * inner], got {tuple(gate_up.shape)}")
    cdef int64_t rows = gate_up.shape[0], inner = gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inner))
    if rows == 0 or inner == 0:
        return out
    cdef const float *pg = <const float *>_data(gate_up, "gate_up", _F32, True)
    cdef float *po = <float *>_data(out, "out", _F32, True)
    with nogil:
        fc_silu_mul(pg, po, rows, inner)
    return out


def rope_(x, int64_t heads, cos, signed_sin, positions=None):
    if x.dim() != 3 or heads < 0 or heads > x.shape[1] or x.shape[2] % 2:
        raise ValueError(f"x must be [rows, heads >= {heads}, even head_dim], got {tuple(x.shape)}")
    cdef int64_t rows = x.shape[0], dim = x.shape[2]
    cdef int64_t table_rows = rows if positions is None else cos.numel() // max(dim, 1)
    if (cos.numel() != table_rows * dim or signed_sin.numel() != table_rows * dim or cos.size(-1) != dim
            or signed_sin.size(-1) != dim):
        raise ValueError(f"cos and signed_sin must hold [{'rows' if positions is None else 'positions'}, {dim}], "
                         f"got {tuple(cos.shape)} and {tuple(signed_sin.shape)}")
    if positions is not None and (positions.dim() != 1 or positions.shape[0] != rows):
        raise ValueError(f"positions must be [{rows}], got {tuple(positions.shape)}")
    if rows == 0 or heads == 0:
        return
    cdef float *px = <float *>_data(x, "x", _F32, True)
    cdef const float *pc = <const float *>_data(cos, "cos", _F32, True)
    cdef const float *ps = <const float *>_data(signed_sin, "signed_sin", _F32, True)
    cdef const int64_t *pp = NULL
    if positions is not None:
        pp = <const int64_t *>_data(positions, "positions", _I64, True)
    cdef int64_t row_stride = x.shape[1] * dim
    cdef int rc
    with nogil:
        rc = fc_rope(px, rows, heads, row_stride, dim, pc, ps, pp, table_rows)
    if rc:
        raise ValueError(f"positions[{rc - 1}] = {int(positions[rc - 1])} outside the tables' {table_rows} rows")


cdef int64_t _head_rows(object t, str name, int64_t batch, int64_t dim) except -1:
    if t.dim() != 3 or t.shape[0] != batch or t.shape[2] != dim or t.stride(2) != 1 or t.stride(1) != dim:
        raise ValueError(f"{name} must be [{batch}, heads, {dim}] with rows of whole heads, got "
                         f"{tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def paged_decode(q, k, v, pool_k, pool_v, table, lengths, int64_t block_size, out):
    if q.dim() != 3 or k.dim() != 3 or pool_k.dim() != 3:
        raise ValueError(f"q, k and pool_k must be 3-d, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(pool_k.shape)}")
    cdef int64_t batch = q.shape[0], heads = q.shape[1], dim = q.shape[2], kv_heads = k.shape[1]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q's {heads} heads are not a multiple of k's {kv_heads}")
    cdef int64_t q_stride = _head_rows(q, "q", batch, dim)
    cdef int64_t kv_stride = _head_rows(k, "k", batch, dim)
    if _head_rows(v, "v", batch, dim) != kv_stride or v.shape[1] != kv_heads:
        raise ValueError(f"v {tuple(v.shape)} must be laid out as k {tuple(k.shape)}")
    if tuple(pool_k.shape[1:]) != (kv_heads, dim):
        raise ValueError(f"pool_k must be [slots, {kv_heads}, {dim}], got {tuple(pool_k.shape)}")
    _same_shape(pool_k, "pool_k", pool_v, "pool_v")
    if table.dim() != 2 or table.shape[0] != batch or lengths.dim() != 1 or lengths.shape[0] != batch:
        raise ValueError(f"table must be [{batch}, width] and lengths [{batch}], got {tuple(table.shape)} "
                         f"and {tuple(lengths.shape)}")
    _same_shape(out, "out", q, "q")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if batch == 0:
        return
    cdef float *ppk = <float *>_data(pool_k, "pool_k", _F32, True)
    cdef float *ppv = <float *>_data(pool_v, "pool_v", _F32, True)
    cdef const int64_t *pt = <const int64_t *>_data(table, "table", _I64, True)
    cdef const int64_t *pl = <const int64_t *>_data(lengths, "lengths", _I64, True)
    _decode(q, k, v, out, ppk, ppv, pool_k.shape[0], pt, table.shape[1], block_size, pl, batch, heads, kv_heads,
            dim)


cdef int _decode(object q, object k, object v, object out, float *pool_k, float *pool_v, int64_t slots,
                 const int64_t *table, int64_t width, int64_t block_size, const int64_t *lengths, int64_t batch,
                 int64_t heads, int64_t kv_heads, int64_t dim) except -1:
    """The C on checked shapes (both callers'): q, k, v's and out's data, then fc_paged_decode."""
    cdef const float *pq = <const float *>_data(q, "q", _F32, False)
    cdef const float *pk = <const float *>_data(k, "k", _F32, False)
    cdef const float *pv = <const float *>_data(v, "v", _F32, False)
    cdef float *po = <float *>_data(out, "out", _F32, True)
    cdef int64_t q_stride = q.stride(0), kv_stride = k.stride(0)
    cdef float scale = <float>pow(<double>dim, -0.5)  # Python's d ** -0.5, as the torch path scales
    cdef int rc
    with nogil:
        rc = fc_paged_decode(pq, q_stride, pk, pv, kv_stride, pool_k, pool_v, slots, table, width, block_size,
                             lengths, batch, heads, kv_heads, dim, scale, po)
    if rc == -1:
        raise MemoryError("paged_decode: no memory for the scores")
    if rc:
        raise ValueError(f"sequence {rc - 1}: length {lengths[rc - 1]} or its blocks lie outside the "
                         f"table ({width} blocks of {block_size}) or the pool ({slots} slots)")
    return 0


cdef class PagedDecode:
    """:func:`paged_decode` for one batch at every layer, what stays the same checked once: the
    pools (``[layers, slots, kv_heads, dim]``, the KV cache's), the block ``table`` and ``lengths``
    (their tensors kept; the caller moves lengths on in place, which the C checks against the
    table at every call). A call checks only the step's ``q``, ``k``, ``v`` and ``out``."""

    cdef object _keep
    cdef float *pool_k
    cdef float *pool_v
    cdef const int64_t *table
    cdef const int64_t *lengths
    cdef int64_t layers, slots, kv_heads, dim, width, batch, block_size

    def __init__(self, pool_k, pool_v, table, lengths, int64_t block_size):
        if pool_k.dim() != 4 or pool_k.shape != pool_v.shape:
            raise ValueError(f"pool_k and pool_v must be one [layers, slots, kv_heads, dim] shape, got "
                             f"{tuple(pool_k.shape)} and {tuple(pool_v.shape)}")
        if table.dim() != 2 or lengths.dim() != 1 or lengths.shape[0] != table.shape[0]:
            raise ValueError(f"table must be [batch, width] and lengths [batch], got {tuple(table.shape)} "
                             f"and {tuple(lengths.shape)}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.layers, self.slots, self.kv_heads, self.dim = pool_k.shape
        self.batch, self.width = table.shape
        self.block_size = block_size
        if self.kv_heads < 1 or self.dim < 1:
            raise ValueError(f"pool_k {tuple(pool_k.shape)} holds no heads")
        self.pool_k = <float *>_data(pool_k, "pool_k", _F32, True)
        self.pool_v = <float *>_data(pool_v, "pool_v", _F32, True)
        self.table = self.lengths = NULL
        if self.batch:
            self.table = <const int64_t *>_data(table, "table", _I64, True)
            self.lengths = <const int64_t *>_data(lengths, "lengths", _I64, True)
        self._keep = (pool_k, pool_v, table, lengths)

    def __call__(self, int64_t layer, q, k, v, out):
        """Layer ``layer``'s new ``k``/``v`` written and ``out`` = the attention of ``q``, as
        :func:`paged_decode`."""
        if layer < 0 or layer >= self.layers:
            raise ValueError(f"layer {layer} outside the pools' {self.layers}")
        cdef int64_t batch = self.batch, kv_heads = self.kv_heads, dim = self.dim
        cdef int64_t heads = _decode_rows(q, "q", batch, -1, dim)
        if heads % kv_heads:
            raise ValueError(f"q's {heads} heads are not a multiple of the pools' {kv_heads}")
        _decode_rows(k, "k", batch, kv_heads, dim)
        _decode_rows(v, "v", batch, kv_heads, dim)
        if k.stride() != v.stride():
            raise ValueError(f"v {tuple(v.stride())} must be laid out as k {tuple(k.stride())}")
        if out.shape != q.shape or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {tuple(q.shape)}, got {tuple(out.shape)}")
        if batch == 0:
            return
        cdef int64_t offset = layer * self.slots * kv_heads * dim
        _decode(q, k, v, out, self.pool_k + offset, self.pool_v + offset, self.slots, self.table, self.width,
                self.block_size, self.lengths, batch, heads, kv_heads, dim)


cdef int64_t _decode_rows(object t, str name, int64_t batch, int64_t heads, int64_t dim) except -1:
    """``t`` as [batch, heads (any where -1), dim] rows of whole heads; its heads."""
    shape = t.shape
    stride = t.stride()
    if (len(shape) != 3 or shape[0] != batch or shape[2] != dim or (heads >= 0 and shape[1] != heads)
            or stride[2] != 1 or stride[1] != dim):
        raise ValueError(f"{name} must be [{batch}, {'heads' if heads < 0 else heads}, {dim}] with rows of "
                         f"whole heads, got {tuple(shape)} strides {stride}")
    return shape[1]
