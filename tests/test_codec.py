"""Token codec: both twins (``codec`` fixture), every SIMD kernel the CPU has
(``kernel`` fixture), the stdlib as the reference.

Reference (what servers do without fastcore):
    encode: base64.b64encode(np.asarray(ids, np.int32).tobytes())
    decode: np.frombuffer(base64.b64decode(s, validate=True), np.int32)
"""

from __future__ import annotations

import array
import base64
import binascii
import os
import threading
from types import ModuleType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastcore
from fastcore import TokenDecodeError
from fastcore import _codec_py as py_twin

try:
    from fastcore import _codec as compiled_twin
except ImportError:
    compiled_twin = None  # type: ignore[assignment]

REQUIRE_EXTENSIONS = os.environ.get("FASTCORE_REQUIRE_EXTENSIONS", "") not in ("", "0")  # as in conftest

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
KERNELS = ["scalar", "ssse3", "avx2", "avx512vbmi"]

# The fixtures hand back a module; nothing in it changes between examples.
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
int32s = st.integers(INT32_MIN, INT32_MAX)
id_lists = st.lists(int32s, max_size=300)


def reference_encode(ids: object) -> bytes:
    return base64.b64encode(np.asarray(ids, np.int32).tobytes())


def reference_decode(data: bytes | str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data, validate=True), np.int32)


def outcome(fn, *args, **kwargs) -> tuple[str, object]:
    """A call's result, or its exception as (type name, message, offset)."""
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        return "raised", (type(exc).__name__, str(exc), getattr(exc, "offset", None))
    if isinstance(result, np.ndarray):
        return "array", (result.dtype.str, result.tolist())
    return "value", result


@pytest.fixture(params=KERNELS)
def kernel(request: pytest.FixtureRequest):
    """The compiled twin switched to one SIMD kernel (restored afterwards)."""
    if fastcore.NO_EXTENSIONS:
        pytest.skip("FASTCORE_NO_EXTENSIONS=1")
    if compiled_twin is None:
        if REQUIRE_EXTENSIONS:
            pytest.fail("fastcore._codec required but not built")
        pytest.skip("fastcore._codec not built")
    if request.param not in compiled_twin._available_simd_paths():
        pytest.skip(f"this CPU cannot run the {request.param} kernel")
    before = compiled_twin._get_simd_path()
    compiled_twin._set_simd_path(request.param)
    yield compiled_twin
    compiled_twin._set_simd_path(before)


@pytest.fixture
def both_twins() -> tuple[ModuleType, ModuleType]:
    if fastcore.NO_EXTENSIONS or compiled_twin is None:
        if REQUIRE_EXTENSIONS and not fastcore.NO_EXTENSIONS:
            pytest.fail("fastcore._codec required but not built")
        pytest.skip("needs the compiled twin")
    return py_twin, compiled_twin


# ------------------------------------------------------- property tests


@fixture_ok
@given(ids=id_lists)
def test_encode_matches_stdlib_for_every_input_kind(codec: ModuleType, ids: list[int]) -> None:
    expected = reference_encode(ids)
    as_int32 = np.array(ids, np.int32)
    assert codec.encode_tokens(ids) == expected
    assert codec.encode_tokens(tuple(ids)) == expected
    assert codec.encode_tokens(as_int32) == expected
    assert codec.encode_tokens(as_int32.astype(np.int64)) == expected
    assert codec.encode_tokens(array.array("i", ids)) == expected
    assert codec.encode_tokens(memoryview(as_int32)) == expected


@fixture_ok
@given(ids=id_lists)
def test_decode_matches_stdlib_for_every_output_kind(codec: ModuleType, ids: list[int]) -> None:
    encoded = reference_encode(ids)
    expected = reference_decode(encoded)
    for data in (encoded, encoded.decode("ascii"), bytearray(encoded), memoryview(encoded)):
        decoded = codec.decode_tokens(data)
        assert decoded.dtype == np.int32 and decoded.ndim == 1
        assert np.array_equal(decoded, expected)
        assert codec.decode_tokens_list(data) == ids
        out = np.full(len(ids) + 3, -7, np.int32)
        assert codec.decode_tokens_into(data, out) == len(ids)
        assert out[: len(ids)].tolist() == ids and out[len(ids) :].tolist() == [-7, -7, -7]


# Mostly base64 characters, with a little of everything that must be refused.
noisy_base64 = st.lists(
    st.sampled_from(list(ALPHABET[:8]) + list(b"+/=*-_ \n\x00\x80\xff")), max_size=40
).map(bytes)


@fixture_ok
@given(data=st.one_of(noisy_base64, st.binary(max_size=40)))
def test_decode_accepts_exactly_what_stdlib_accepts_minus_the_strict_rules(
    codec: ModuleType, data: bytes
) -> None:
    try:
        stdlib = base64.b64decode(data, validate=True)
    except binascii.Error:
        stdlib = None
    try:
        ours = codec.decode_tokens(data)
    except TokenDecodeError as exc:
        # Our extra rules: whole int32s, canonical (zero) bits under the padding.
        if stdlib is not None:
            assert len(stdlib) % 4 != 0 or "padding bits" in str(exc)
        return
    assert stdlib is not None
    assert ours.tobytes() == stdlib


@fixture_ok
@given(
    data=st.one_of(noisy_base64, st.binary(max_size=40), st.text(max_size=20)),
    limit=st.none() | st.integers(0, 5),
)
def test_twins_agree_on_any_decode_input(both_twins, data, limit) -> None:
    py, c = both_twins
    for name in ("decode_tokens", "decode_tokens_list"):
        assert outcome(getattr(py, name), data, max_tokens=limit) == outcome(
            getattr(c, name), data, max_tokens=limit
        )
    out_py, out_c = np.zeros(4, np.int32), np.zeros(4, np.int32)
    assert outcome(py.decode_tokens_into, data, out_py, max_tokens=limit) == outcome(
        c.decode_tokens_into, data, out_c, max_tokens=limit
    )


id_items = st.one_of(
    int32s,
    st.integers(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.none(),
    st.text(max_size=2),
    st.integers(INT32_MIN, INT32_MAX).map(np.int64),
)


@fixture_ok
@given(items=st.lists(id_items, max_size=8))
def test_twins_agree_on_any_encode_input(both_twins, items) -> None:
    py, c = both_twins
    assert outcome(py.encode_tokens, items) == outcome(c.encode_tokens, items)
    assert outcome(py.encode_tokens, tuple(items)) == outcome(c.encode_tokens, tuple(items))


# ---------------------------------------------------------------- kernels


def test_every_kernel_round_trips_every_length_and_tail(kernel: ModuleType) -> None:
    # 0..199 ids covers every tail length of every block size (SSSE3 12/16,
    # AVX2 24/32, AVX-512 48/64 bytes) several times over; 256..320 the same
    # past the scalar groups that align the output to 64 bytes first (from
    # 1024 input bytes); the 1536-id boundaries are the chunking of the list
    # and strided paths.
    rng = np.random.default_rng(7)
    for count in [*range(200), *range(256, 321), 1535, 1536, 1537, 3071, 3072, 3073, 4095, 4096, 4097]:
        ids = rng.integers(INT32_MIN, INT32_MAX, count, dtype=np.int64, endpoint=True).astype(np.int32)
        expected = reference_encode(ids)
        assert kernel.encode_tokens(ids) == expected, count
        assert kernel.encode_tokens(ids.tolist()) == expected, count
        assert kernel.encode_tokens(ids.astype(np.int64)) == expected, count
        assert kernel.encode_tokens(ids.astype(">i4")) == expected, count
        assert np.array_equal(kernel.decode_tokens(expected), ids), count
        assert kernel.decode_tokens_list(expected) == ids.tolist(), count


def test_every_kernel_reports_the_exact_offset_of_a_bad_byte_anywhere(kernel: ModuleType) -> None:
    # 101 ids = 540 characters ending in one "=": every position is in a vector
    # block for some kernel, in a scalar tail for others, or in the padded quad.
    encoded = reference_encode(np.arange(1000, 1101, dtype=np.int32))
    assert encoded.endswith(b"=") and not encoded.endswith(b"==")
    for position in range(len(encoded) - 1):
        for bad in (b"*", b"\x80", b"\xff", b"\n"):
            corrupt = encoded[:position] + bad + encoded[position + 1 :]
            with pytest.raises(TokenDecodeError) as info:
                kernel.decode_tokens(corrupt)
            assert info.value.offset == position
            assert str(info.value) == f"Invalid base64 character 0x{bad[0]:02x} at byte {position}"
        if position < len(encoded) - 3:
            corrupt = encoded[:position] + b"=" + encoded[position + 1 :]
            with pytest.raises(
                TokenDecodeError, match=f"Misplaced padding character '=' at byte {position}$"
            ):
                kernel.decode_tokens(corrupt)


def test_every_kernel_classifies_every_byte_value_like_the_stdlib(kernel: ModuleType) -> None:
    encoded = bytearray(reference_encode(np.arange(5000, 5159, dtype=np.int32)))  # 848 chars, no padding
    assert not encoded.endswith(b"=")
    for position in (0, 3, 15, 16, 31, 32, 47, 63, 64, 100, 830, 847):
        for byte in range(256):
            if byte == ord("=") and position >= len(encoded) - 2:
                continue  # that is padding, tested elsewhere
            data = bytearray(encoded)
            data[position] = byte
            if byte in ALPHABET:
                assert kernel.decode_tokens(bytes(data)).tobytes() == base64.b64decode(
                    bytes(data), validate=True
                )
            else:
                with pytest.raises(TokenDecodeError) as info:
                    kernel.decode_tokens(bytes(data))
                assert info.value.offset == position, (position, byte)


def test_every_kernel_checks_relayed_base64_like_the_pure_twin(kernel: ModuleType) -> None:
    # check_token_b64's alphabet run has its own kernels (AVX-512 VBMI, AVX2, SSE2, scalar tail): every
    # byte value at the lane edges of their 64- and 16-byte steps, and in the tail, at an offset.
    encoded = reference_encode(np.arange(5000, 5159, dtype=np.int32))  # 848 chars
    for position in (0, 15, 16, 63, 64, 127, 128, 500, 831, 832, 845, 847):
        for byte in range(256):
            data = bytearray(encoded)
            data[position] = byte
            body = b'"' + bytes(data) + b'"'
            got = outcome(kernel.check_token_b64, body, 1, 1 + len(data))
            assert got == outcome(py_twin.check_token_b64, body, 1, 1 + len(data)), (position, byte)
            if byte != ord("=") or position < len(data) - 2:  # there, padding: tested elsewhere
                assert (got[0] == "value") == (byte in ALPHABET), (position, byte, got)


def test_every_kernel_reports_the_first_of_several_bad_bytes(kernel: ModuleType) -> None:
    encoded = bytearray(reference_encode(np.arange(300, dtype=np.int32)))
    for first in (5, 40, 70, 130, 600):
        data = bytearray(encoded)
        data[first] = ord("*")
        data[first + 1] = ord("-")
        data[first + 90] = ord("_")
        with pytest.raises(TokenDecodeError, match=f"0x2a at byte {first}$"):
            kernel.decode_tokens(bytes(data))
        with pytest.raises(TokenDecodeError, match=f"0x2a at byte {first}$"):
            kernel.decode_tokens_list(bytes(data))


def test_a_bad_byte_in_a_later_list_chunk_is_reported_at_its_absolute_offset(codec: ModuleType) -> None:
    encoded = bytearray(reference_encode(np.arange(5000, dtype=np.int32)))
    for position in (8191, 8192, 8193, 16384 + 5, len(encoded) - 2):
        data = bytearray(encoded)
        data[position] = ord("?")
        with pytest.raises(TokenDecodeError, match=f"0x3f at byte {position}$"):
            codec.decode_tokens_list(bytes(data))


def test_simd_path_selection(both_twins) -> None:
    _, c = both_twins
    available = c._available_simd_paths()
    assert available[0] == "scalar" and c.SIMD_PATH == available[-1]
    assert fastcore.backend == f"cython ({c.SIMD_PATH})" or fastcore.backend == "python"
    with pytest.raises(ValueError, match="not available"):
        c._set_simd_path("neon")
    assert c._get_simd_path() == c.SIMD_PATH


# ------------------------------------------------------------- edge cases


@pytest.mark.parametrize(
    "ids",
    [
        [],
        [0],
        [1, 2],
        [3, 4, 5],
        [INT32_MIN],
        [INT32_MAX],
        [INT32_MIN, INT32_MAX, -1, 0],
        [-5, -300, -(2**30)],
    ],
)
def test_small_and_extreme_values(codec: ModuleType, ids: list[int]) -> None:
    encoded = codec.encode_tokens(ids)
    assert encoded == reference_encode(ids)
    assert codec.decode_tokens_list(encoded) == ids
    assert codec.decode_tokens(encoded).tolist() == ids


def test_protocol_example(codec: ModuleType) -> None:
    assert codec.encode_tokens([1, 9038, 2501, 29871, 13]) == b"AQAAAE4jAADFCQAAr3QAAA0AAAA="
    assert codec.decode_tokens_list("AQAAAE4jAADFCQAAr3QAAA0AAAA=") == [1, 9038, 2501, 29871, 13]


@pytest.mark.slow
def test_a_million_tokens(codec: ModuleType) -> None:
    ids = np.random.default_rng(3).integers(0, 200_000, 1_000_000, dtype=np.int32)
    expected = reference_encode(ids)
    assert codec.encode_tokens(ids) == expected
    as_list = ids.tolist()
    assert codec.encode_tokens(as_list) == expected
    assert np.array_equal(codec.decode_tokens(expected), ids)
    assert codec.decode_tokens_list(expected) == as_list


def test_decoded_array_owns_its_memory_and_torch_shares_it(codec: ModuleType) -> None:
    torch = pytest.importorskip("torch")
    decoded = codec.decode_tokens(reference_encode([10, 20, 30]))
    assert decoded.flags.owndata and decoded.flags.writeable and decoded.flags.c_contiguous
    tensor = torch.from_numpy(decoded)
    tensor[0] = 99
    assert decoded[0] == 99  # zero-copy


def test_integer_like_items(codec: ModuleType) -> None:
    class Index:
        def __index__(self) -> int:
            return 70000

    class MyInt(int):
        pass

    ids = [
        True,
        False,
        np.int64(-4),
        np.int32(5),
        np.uint16(6),
        Index(),
        MyInt(2**31 - 1),
        2**30,
        -(2**30) - 1,
    ]
    assert codec.encode_tokens(ids) == reference_encode(
        [1, 0, -4, 5, 6, 70000, 2**31 - 1, 2**30, -(2**30) - 1]
    )


def test_buffers_of_every_integer_layout(codec: ModuleType) -> None:
    base = np.arange(-50, 50, 3, dtype=np.int64)
    expected = reference_encode(base)
    for dtype in ("<i4", ">i4", "<i8", ">i8", "i2", ">i2", "i1"):
        assert codec.encode_tokens(base.astype(dtype)) == expected, dtype
    positive = np.arange(0, 200, 7)
    for dtype in ("u1", "u2", "<u4", ">u4", "u8"):
        assert codec.encode_tokens(positive.astype(dtype)) == reference_encode(positive), dtype
    flags = np.array([True, False, True])
    assert codec.encode_tokens(flags) == reference_encode([1, 0, 1])
    assert codec.encode_tokens(array.array("q", [1, -2, 3])) == reference_encode([1, -2, 3])


def test_non_contiguous_buffers(codec: ModuleType) -> None:
    ids = np.arange(-3000, 3000, 7, dtype=np.int32)
    for view in (
        ids[::2],
        ids[::-1],
        ids[5:900:3],
        ids.astype(np.int64)[::5],
        np.stack([ids, ids], axis=1)[:, 0],
    ):
        assert codec.encode_tokens(view) == reference_encode(view.copy())
    assert codec.encode_tokens(memoryview(ids)[::3]) == reference_encode(ids[::3])


def test_torch_tensors(codec: ModuleType) -> None:
    torch = pytest.importorskip("torch")
    ids = torch.arange(-100, 9000, 13, dtype=torch.int64)
    expected = reference_encode(ids.numpy())
    assert codec.encode_tokens(ids) == expected
    assert codec.encode_tokens(ids.to(torch.int32)) == expected
    assert codec.encode_tokens(ids[::3]) == reference_encode(ids.numpy()[::3])
    assert codec.encode_tokens(ids.flip(0)) == reference_encode(ids.numpy()[::-1])
    out = torch.zeros(len(ids), dtype=torch.int32)
    assert codec.decode_tokens_into(expected, out) == len(ids)
    assert torch.equal(out, ids.to(torch.int32))


def test_large_inputs_from_several_threads(codec: ModuleType) -> None:
    # The kernels run without the GIL above 4096 ids: concurrent calls must
    # each get their own, right answer.
    arrays = [np.random.default_rng(seed).integers(0, 2**31 - 1, 50_000, dtype=np.int32) for seed in range(4)]
    expected = [reference_encode(a) for a in arrays]
    failures: list[int] = []

    def work(k: int) -> None:
        for _ in range(5):
            if codec.encode_tokens(arrays[k]) != expected[k] or not np.array_equal(
                codec.decode_tokens(expected[k]), arrays[k]
            ):
                failures.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures and not any(t.is_alive() for t in threads)


# --------------------------------------------------------- encode errors


@pytest.mark.parametrize(
    ("ids", "index"),
    [([1, 2**31], 1), ([INT32_MIN - 1], 0), ([0, 0, 10**100], 2), ([0, -(10**30)], 1), ([5, True, 2**40], 2)],
)
def test_encode_out_of_int32_names_the_index(codec: ModuleType, ids: list[int], index: int) -> None:
    with pytest.raises(OverflowError, match=rf"^token id at index {index} is outside the int32 range"):
        codec.encode_tokens(ids)
    with pytest.raises(OverflowError, match=rf"^token id at index {index} is outside"):
        codec.encode_tokens(tuple(ids))


@pytest.mark.parametrize("dtype", ["int64", ">i8", "uint32", "uint64"])
def test_encode_buffer_out_of_int32_names_the_index(codec: ModuleType, dtype: str) -> None:
    ids = np.zeros(5000, dtype=dtype)
    ids[4321] = 2**31
    with pytest.raises(OverflowError, match=r"^token id at index 4321 is outside"):
        codec.encode_tokens(ids)
    with pytest.raises(OverflowError, match=r"^token id at index 2160 is outside"):
        codec.encode_tokens(ids[1::2])


@pytest.mark.parametrize(
    ("item", "type_name"),
    [(1.0, "float"), (None, "NoneType"), ("7", "str"), (np.float64(2), "float64"), ([1], "list")],
)
def test_encode_non_integer_item_is_a_type_error(codec: ModuleType, item: object, type_name: str) -> None:
    with pytest.raises(TypeError, match=rf"^token id at index 2 must be an integer, not {type_name}$"):
        codec.encode_tokens([1, 2, item, 4])


@pytest.mark.parametrize(
    "bad", [3, None, "AQAAAA==", b"\x01\x00", bytearray(4), {1: 2}, iter([1]), range(3), 1.5]
)
def test_encode_rejects_what_is_not_ids(codec: ModuleType, bad: object) -> None:
    with pytest.raises(TypeError, match=r"^ids must be a list or tuple of int, an int32/int64 buffer"):
        codec.encode_tokens(bad)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "complex64"])
def test_encode_float_buffers_are_a_type_error(codec: ModuleType, dtype: str) -> None:
    with pytest.raises(TypeError, match=r"^ids must hold integers, not a buffer of format"):
        codec.encode_tokens(np.zeros(3, dtype=dtype))


def test_encode_unsupported_buffer_format(codec: ModuleType) -> None:
    with pytest.raises(TypeError, match=r"^unsupported ids buffer format 'T\{"):
        codec.encode_tokens(np.zeros(2, dtype=[("a", "i4")]))


def test_encode_multi_dimensional_buffers_are_a_value_error(codec: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^token ids must be 1-dimensional, got 2 dimensions$"):
        codec.encode_tokens(np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match=r"got 0 dimensions$"):
        codec.encode_tokens(np.int32(5))


def test_encode_torch_errors(codec: ModuleType) -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^ids must hold integers, not a tensor of torch.float32$"):
        codec.encode_tokens(torch.zeros(3))
    with pytest.raises(TypeError, match=r"^ids is a meta tensor: move it to the CPU first$"):
        codec.encode_tokens(torch.zeros(3, dtype=torch.int32, device="meta"))


def test_encode_list_changed_by_index_is_an_error_not_a_crash(codec: ModuleType) -> None:
    ids: list[object] = []

    class Shrinker:
        def __index__(self) -> int:
            ids.clear()
            return 1

    ids.extend([1, Shrinker(), *range(5000)])
    with pytest.raises(RuntimeError, match=r"^ids changed size during encode_tokens$"):
        codec.encode_tokens(ids)


def test_encode_propagates_errors_raised_by_index(codec: ModuleType) -> None:
    class Broken:
        def __index__(self) -> int:
            raise ZeroDivisionError("broken id")

    with pytest.raises(ZeroDivisionError, match="broken id"):
        codec.encode_tokens([1, Broken()])


# --------------------------------------------------------- decode errors


def decode_error(codec: ModuleType, data: object, **kwargs: object) -> TokenDecodeError:
    with pytest.raises(TokenDecodeError) as info:
        codec.decode_tokens(data, **kwargs)
    for other in (
        codec.decode_tokens_list,
        lambda d, **k: codec.decode_tokens_into(d, np.zeros(64, np.int32), **k),
    ):
        with pytest.raises(TokenDecodeError) as again:
            other(data, **kwargs)
        assert str(again.value) == str(info.value) and again.value.offset == info.value.offset
    return info.value


def test_token_decode_error_is_a_binascii_error(codec: ModuleType) -> None:
    error = decode_error(codec, b"AQAAAA=")
    assert isinstance(error, binascii.Error) and isinstance(error, ValueError)


@pytest.mark.parametrize(
    ("data", "message", "offset"),
    [
        (b"AQAAAA=", "Invalid base64 length 7: not a multiple of 4", None),
        (b"AQAA A==", "Invalid base64 character 0x20 at byte 4", 4),
        # a bad character is named before any length problem (the scanner's check_token_b64 agrees)
        (b"AQAAAA==\n", "Misplaced padding character '=' at byte 6", 6),
        (b"AAAA!AAAAAAA", "Invalid base64 character 0x21 at byte 4", 4),
        (b"AA!", "Invalid base64 character 0x21 at byte 2", 2),
        (b"AQAAA\n", "Invalid base64 character 0x0a at byte 5", 5),
        (b"AQAA\nA==", "Invalid base64 character 0x0a at byte 4", 4),
        (b"AQAAAAIA*AA=", "Invalid base64 character 0x2a at byte 8", 8),
        (b"AQAAAAIA-AA=", "Invalid base64 character 0x2d at byte 8", 8),  # URL-safe alphabet
        (b"AQAAAAIA_AA=", "Invalid base64 character 0x5f at byte 8", 8),
        (b"AQ=AAA==", "Misplaced padding character '=' at byte 2", 2),
        (b"AQAAA===", "Misplaced padding character '=' at byte 5", 5),
        (b"=QAAAA==", "Misplaced padding character '=' at byte 0", 0),
        (
            b"AQAAAB==",
            "Non-zero padding bits in base64 character 'B' at byte 5 (not the canonical encoding)",
            5,
        ),
        (
            b"AQAAAAEAAAB=",
            "Non-zero padding bits in base64 character 'B' at byte 10 (not the canonical encoding)",
            10,
        ),
        (b"AQAA", "Invalid token data: 3 bytes decoded, not a whole number of int32 ids", None),
        (b"AQAAAA=A", "Misplaced padding character '=' at byte 6", 6),
        (b"AQAAAQ", "Invalid base64 length 6: not a multiple of 4", None),
        (b"AQA=", "Invalid token data: 2 bytes decoded, not a whole number of int32 ids", None),
        ("AQAAAé==", "Non-ASCII character U+00E9 at byte 5", 5),
    ],
)
def test_decode_errors(codec: ModuleType, data: bytes | str, message: str, offset: int | None) -> None:
    error = decode_error(codec, data)
    assert str(error) == message
    assert error.offset == offset


def test_non_canonical_encodings_are_refused_where_the_stdlib_accepts_them(codec: ModuleType) -> None:
    assert base64.b64decode(b"AQAAAB==", validate=True) == b"\x01\x00\x00\x00"
    decode_error(codec, b"AQAAAB==")


def test_max_tokens(codec: ModuleType) -> None:
    data = reference_encode(range(10))
    assert codec.decode_tokens(data, max_tokens=10).tolist() == list(range(10))
    error = decode_error(codec, data, max_tokens=9)
    assert str(error) == "base64 data holds 10 token ids, more than max_tokens=9" and error.offset is None
    # Too many ids, decided from the length; a bad byte is named first.
    error = decode_error(codec, b"A" * 4000, max_tokens=100)
    assert "more than max_tokens=100" in str(error) and error.offset is None
    error = decode_error(codec, b"A" * 3999 + b"*", max_tokens=100)
    assert str(error) == "Invalid base64 character 0x2a at byte 3999" and error.offset == 3999
    assert codec.decode_tokens_list(b"", max_tokens=0) == []
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 0, got -1$"):
        codec.decode_tokens(data, max_tokens=-1)
    with pytest.raises(TypeError):
        codec.decode_tokens(data, max_tokens=2.5)


@pytest.mark.parametrize("bad", [None, 12, [b"AQAAAA=="], 1.0])
def test_decode_rejects_what_is_not_data(codec: ModuleType, bad: object) -> None:
    for fn in (codec.decode_tokens, codec.decode_tokens_list):
        with pytest.raises(
            TypeError, match=r"^data must be bytes, bytearray, memoryview or an ASCII str, not "
        ):
            fn(bad)


def test_decode_non_contiguous_data_buffer(codec: ModuleType) -> None:
    with pytest.raises(TypeError, match=r"^data buffer must be C-contiguous$"):
        codec.decode_tokens(memoryview(b"AQAAAA==AQAAAA==")[::2])


def test_decode_subclasses_of_bytes_and_str(codec: ModuleType) -> None:
    class B(bytes):
        pass

    class S(str):
        pass

    assert codec.decode_tokens_list(B(b"AQAAAA==")) == [1]
    assert codec.decode_tokens_list(S("AQAAAA==")) == [1]


# ------------------------------------------------------ decode_tokens_into


def test_decode_into_too_small_leaves_out_untouched(codec: ModuleType) -> None:
    out = np.full(4, 42, np.int32)
    with pytest.raises(ValueError, match=r"^out holds 4 int32 values, need 5$"):
        codec.decode_tokens_into(reference_encode(range(5)), out)
    assert out.tolist() == [42] * 4
    assert codec.decode_tokens_into(b"", np.zeros(0, np.int32)) == 0


def test_decode_into_contiguous_buffers_of_any_shape(codec: ModuleType) -> None:
    out = np.zeros((2, 3), np.int32)
    assert codec.decode_tokens_into(reference_encode(range(5)), out) == 5
    assert out.ravel().tolist() == [0, 1, 2, 3, 4, 0]
    buf = array.array("i", [0] * 3)
    assert codec.decode_tokens_into("AQAAAAIAAAA=", buf) == 2 and buf.tolist() == [1, 2, 0]


def test_decode_into_rejects_bad_out(codec: ModuleType) -> None:
    data = reference_encode([1, 2])
    readonly = np.zeros(4, np.int32)
    readonly.flags.writeable = False
    cases = [
        (readonly, r"^out buffer is read-only$"),
        (b"\x00" * 16, r"^out buffer is read-only$"),
        (np.zeros(4, np.int64), r"^out must hold int32, not a buffer of format 'l' \(itemsize 8\)$"),
        (np.zeros(4, np.uint32), r"^out must hold int32, not a buffer of format 'I'"),
        (np.zeros(4, ">i4"), r"^out must hold int32, not a buffer of format '>i'"),
        (np.zeros(4, np.float32), r"^out must hold integers, not a buffer of format 'f'$"),
        (np.zeros(8, np.int32)[::2], r"^out buffer must be C-contiguous$"),
        ([0, 0], r"^out must be a writable int32 buffer, not list$"),
    ]
    for out, message in cases:
        with pytest.raises(TypeError, match=message):
            codec.decode_tokens_into(data, out)


# ----------------------------------------------------------- the package


def test_package_exports_the_active_twin() -> None:
    assert fastcore.encode_tokens([7]) == b"BwAAAA=="
    assert fastcore.decode_tokens_list(b"BwAAAA==") == [7]
    if fastcore.NO_EXTENSIONS:
        assert fastcore.backend == "python"
        assert fastcore.encode_tokens is py_twin.encode_tokens
    elif compiled_twin is not None and fastcore.backend != "python":
        assert fastcore.backend == f"cython ({compiled_twin.SIMD_PATH})"


def test_python_m_fastcore_benchmark_names_the_backend() -> None:
    """The installed short benchmark runs, checks its answers first, and names the active backend."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "fastcore", "benchmark", "--ids", "1000", "--min-time", "0.01"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    import fastcore

    assert f"backend: {fastcore.backend}" in out
    for case in ("encode from list", "encode from ndarray", "decode to ndarray", "decode to list"):
        assert case in out
