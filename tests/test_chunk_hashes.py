"""``chunk_hashes``: the routers' prefix keys, both twins against a plain-int reference and each other."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle.chunk_hashes import reference

import fastcore
from fastcore import _hash_py as py

STATELESS = [HealthCheck.function_scoped_fixture]


def compiled() -> ModuleType:
    if fastcore.NO_EXTENSIONS:
        pytest.skip("FASTCORE_NO_EXTENSIONS=1")
    try:
        return importlib.import_module("fastcore._hash")
    except ImportError as exc:
        if os.environ.get("FASTCORE_REQUIRE_EXTENSIONS", "") not in ("", "0"):
            pytest.fail(f"compiled twin required: {exc}")
        pytest.skip(f"not built: {exc}")


def test_pinned_values(hash_twin: ModuleType) -> None:
    # Pinned: a change to the hash in both twins at once would silently re-key every index.
    data = bytes(range(256)) * 2
    assert hash_twin.chunk_hashes(data, 0, len(data), 128) == reference(data, 128)
    assert hash_twin.chunk_hashes(b"a" * 64, 0, 64, 32) == [3166170903052033512, 1337699356004011599]


@given(st.binary(max_size=700), st.integers(0, 40), st.integers(0, 40), st.sampled_from([32, 64, 96, 160]))
@settings(suppress_health_check=STATELESS, max_examples=150)
def test_matches_reference(hash_twin: ModuleType, data: bytes, lo: int, cut: int, chunk: int) -> None:
    start = min(lo, len(data))
    end = max(start, len(data) - cut)
    assert hash_twin.chunk_hashes(data, start, end, chunk) == reference(data[start:end], chunk)


@given(st.binary(max_size=3000), st.integers(0, 64), st.sampled_from([32, 64, 128, 256, 512]))
@settings(max_examples=200)
def test_twins_agree(data: bytes, start: int, chunk: int) -> None:
    c = compiled()
    start = min(start, len(data))
    for buf in (data, bytearray(data), memoryview(data)):
        assert c.chunk_hashes(buf, start, len(data), chunk) == py.chunk_hashes(buf, start, len(data), chunk)


def test_prefix_property_and_tail(hash_twin: ModuleType) -> None:
    data = os.urandom(64 * 20 + 17)
    full = hash_twin.chunk_hashes(data, 0, len(data), 64)
    assert len(full) == 20  # the 17-byte tail has no hash
    assert len(set(full)) == 20
    for k in (0, 1, 7, 20):
        assert hash_twin.chunk_hashes(data, 0, 64 * k + 5, 64) == full[:k]
    # One byte changed in chunk 9: hashes 0..8 stay, 9.. all change (the chain).
    changed = bytearray(data)
    changed[9 * 64 + 33] ^= 0x80
    other = hash_twin.chunk_hashes(changed, 0, len(data), 64)
    assert other[:9] == full[:9]
    assert all(a != b for a, b in zip(other[9:], full[9:]))
    # Same chunk bytes at another position of the chain: another hash.
    same = b"x" * 128
    first, second = hash_twin.chunk_hashes(same, 0, 128, 64)
    assert first != second


def test_offset_window(hash_twin: ModuleType) -> None:
    data = b'{"messages":' + os.urandom(300) + b"}"
    assert hash_twin.chunk_hashes(data, 12, 312, 32) == hash_twin.chunk_hashes(data[12:312], 0, 300, 32)
    assert hash_twin.chunk_hashes(data, 5, 5, 32) == []


@pytest.mark.parametrize(
    ("start", "end", "chunk", "name"),
    [
        (-1, 10, 32, "start"),
        (101, 101, 32, "start"),
        (10, 5, 32, "end"),
        (0, 101, 32, "end"),
        (0, 100, 0, "chunk"),
        (0, 100, -32, "chunk"),
        (0, 100, 31, "chunk"),
        (0, 100, 48, "chunk"),
        (0, 100, py.CHUNK_MAX + 32, "chunk"),
    ],
)
def test_bad_bounds_name_the_argument(
    hash_twin: ModuleType, start: int, end: int, chunk: int, name: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        hash_twin.chunk_hashes(b"x" * 100, start, end, chunk)


def test_bad_types(hash_twin: ModuleType) -> None:
    with pytest.raises(TypeError, match="bytes-like"):
        hash_twin.chunk_hashes("text", 0, 4, 32)
    with pytest.raises(TypeError):
        hash_twin.chunk_hashes(b"x" * 64, 0.0, 64, 32)
    with pytest.raises(BufferError):
        hash_twin.chunk_hashes(memoryview(b"x" * 128)[::2], 0, 64, 32)


def test_exported() -> None:
    impl = fastcore._hash_impl
    assert fastcore.chunk_hashes is impl.chunk_hashes
