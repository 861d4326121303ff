"""server.auth: signed internal requests with a timestamp and nonce inside the MAC, refused replays."""

from __future__ import annotations

import pytest

import hashlib
import hmac

from server.auth import (
    SECRET_ENV,
    WRONG_DESTINATION,
    Verifier,
    check_trtllm_disagg_auth,
    read_secret,
    sign_body,
    sign_pieces,
    trtllm_disagg_auth,
    trtllm_disagg_message,
)

SECRET = b"s3cret"
BODY = b'{"model":"tiny","disaggregated_params":{"request_type":"context_only"}}'
NOW = 1_800_000_000.0


def test_signature_carries_timestamp_nonce_and_digest() -> None:
    header = sign_body(SECRET, BODY, now=NOW, nonce="ab" * 16)
    t, n, d = header.split(",")
    assert t == f"t={int(NOW)}" and n == "n=" + "ab" * 16
    assert d.startswith("sha256=") and len(d) == len("sha256=") + 64
    # Two signatures of one body differ (fresh nonce), and pieces sign as their concatenation.
    assert sign_body(SECRET, BODY) != sign_body(SECRET, BODY)
    assert sign_pieces(SECRET, [BODY[:10], memoryview(BODY[10:])], now=NOW, nonce="ab" * 16) == header


def test_valid_signature_accepted_once() -> None:
    verifier = Verifier(SECRET)
    header = sign_body(SECRET, BODY, now=NOW)
    assert verifier.check(BODY, header, now=NOW + 1) is None
    assert verifier.check(BODY, header, now=NOW + 2) == "replayed"
    # The header as str or bytes, the body in pieces: the same answer.
    other = sign_body(SECRET, BODY, now=NOW)
    assert verifier.check([BODY[:5], BODY[5:]], other.encode(), now=NOW) is None


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda h: h.replace("t=", "t=1"), "bad signature"),  # the timestamp is inside the MAC
        (lambda h: h[:-1] + ("0" if h[-1] != "0" else "1"), "bad signature"),
        (lambda h: h.replace(",n=", ",n=ff"), "bad signature"),  # so is the nonce
        (lambda h: h.split(",", 1)[1], "malformed"),
        (lambda h: "sha256=" + h.rsplit("=", 1)[1], "malformed"),  # the old, replayable format
        (lambda h: h.replace("t=", "t=-"), "malformed"),
        (lambda h: h + ",x=1", "malformed"),
        (lambda h: "", "missing"),
    ],
)
def test_tampered_or_malformed_headers_are_refused(mutate, reason) -> None:
    header = sign_body(SECRET, BODY, now=NOW)
    assert Verifier(SECRET).check(BODY, mutate(header), now=NOW) == reason


def test_wrong_secret_or_body_refused() -> None:
    header = sign_body(b"other", BODY, now=NOW)
    assert Verifier(SECRET).check(BODY, header, now=NOW) == "bad signature"
    header = sign_body(SECRET, BODY, now=NOW)
    assert Verifier(SECRET).check(BODY + b" ", header, now=NOW) == "bad signature"
    assert Verifier(SECRET).check(BODY, None, now=NOW) == "missing"


@pytest.mark.parametrize(
    "header", [b"\xc3\xa9", "\u00e9", b"t=1,n=\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8,sha256=00", b"\x00" * 64]
)
def test_non_ascii_headers_are_malformed_not_errors(header) -> None:
    assert Verifier(SECRET).check(BODY, header, now=NOW) == "malformed"


def test_timestamps_outside_the_window_are_stale() -> None:
    verifier = Verifier(SECRET, window_s=60)
    assert verifier.check(BODY, sign_body(SECRET, BODY, now=NOW - 61), now=NOW) == "stale timestamp"
    assert verifier.check(BODY, sign_body(SECRET, BODY, now=NOW + 61), now=NOW) == "stale timestamp"
    assert verifier.check(BODY, sign_body(SECRET, BODY, now=NOW - 59), now=NOW) is None


def test_nonces_are_forgotten_after_the_window_and_bounded() -> None:
    verifier = Verifier(SECRET, window_s=10, max_nonces=3)
    for i in range(3):
        assert verifier.check(BODY, sign_body(SECRET, BODY, now=NOW), now=NOW + i) is None
    # Full: a fourth fresh signature is refused rather than forgetting a nonce still replayable.
    assert verifier.check(BODY, sign_body(SECRET, BODY, now=NOW), now=NOW + 3) == (
        "too many signed requests in the replay window"
    )
    # Past the window the old nonces go (their requests are stale anyway) and room returns.
    assert verifier.check(BODY, sign_body(SECRET, BODY, now=NOW + 20), now=NOW + 20) is None
    assert len(verifier._seen) == 1


def test_read_secret_prefers_file_then_value_then_environment(tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"from-file\n")
    assert read_secret("from-flag", str(path), {SECRET_ENV: "env"}) == b"from-file"
    assert read_secret("from-flag", None, {SECRET_ENV: "env"}) == b"from-flag"
    assert read_secret(None, None, {SECRET_ENV: "env"}) == b"env"
    assert read_secret(None, None, {}) is None
    path.write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        read_secret(None, str(path), {})


def test_trtllm_disagg_auth_matches_the_protocol_example() -> None:
    # PROTOCOL: key k, E "tcp://h:1", S "AAAA".
    message = b'{"ctx_info_endpoint":"tcp://h:1","encoded_opaque_state":"AAAA"}'
    assert trtllm_disagg_message("tcp://h:1", "AAAA") == message
    expected = "sha256=" + hmac.new(b"k", message, hashlib.sha256).hexdigest()
    assert trtllm_disagg_auth(b"k", "tcp://h:1", "AAAA") == expected
    # A list endpoint signs its first element; absent values are null.
    assert trtllm_disagg_auth(b"k", ["tcp://h:1", "tcp://h:2"], "AAAA") == expected
    assert trtllm_disagg_message(None, None) == b'{"ctx_info_endpoint":null,"encoded_opaque_state":null}'
    assert trtllm_disagg_message("http://h/kv/1", None) == (
        b'{"ctx_info_endpoint":"http://h/kv/1","encoded_opaque_state":null}'
    )


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (lambda good: good, True),
        (lambda good: good.encode(), True),
        (lambda good: good[:-1] + ("0" if good[-1] != "0" else "1"), False),
        (lambda good: good.replace("sha256=", ""), False),
        (lambda good: "\u00e9", False),
        (lambda good: b"\xc3\xa9", False),
        (lambda good: None, False),
        (lambda good: "", False),
    ],
)
def test_check_trtllm_disagg_auth(header, ok) -> None:
    good = trtllm_disagg_auth(b"k", "tcp://h:1", "AAAA")
    assert check_trtllm_disagg_auth(b"k", "tcp://h:1", "AAAA", header(good)) is ok
    assert not check_trtllm_disagg_auth(b"other", "tcp://h:1", "AAAA", good)
    assert not check_trtllm_disagg_auth(b"k", "tcp://h:2", "AAAA", good)


# -- the destination (issue 19): nonces are per process, so a signature names its receiver


def test_a_signature_bound_to_a_destination_passes_there_only() -> None:
    header = sign_body(SECRET, BODY, now=NOW, nonce="ab" * 16, destination="a" * 32)
    assert header.split(",")[2] == "d=" + "a" * 32
    # Replayed to another worker (its own nonce memory is empty): refused.
    assert Verifier(SECRET).check(BODY, header, now=NOW, destination="b" * 32) == WRONG_DESTINATION
    assert (
        Verifier(SECRET).check(BODY, header, now=NOW, destination="b" * 32, bound=True) == WRONG_DESTINATION
    )
    # A receiver that does not know its own id cannot honour a binding.
    assert Verifier(SECRET).check(BODY, header, now=NOW) == WRONG_DESTINATION
    verifier = Verifier(SECRET)
    assert verifier.check(BODY, header, now=NOW, destination="a" * 32, bound=True) is None
    assert verifier.check(BODY, header, now=NOW, destination="a" * 32, bound=True) == "replayed"


def test_the_destination_is_inside_the_mac_and_legs_must_carry_one() -> None:
    header = sign_body(SECRET, BODY, now=NOW, destination="a" * 32)
    moved = header.replace("d=" + "a" * 32, "d=" + "b" * 32)
    assert Verifier(SECRET).check(BODY, moved, now=NOW, destination="b" * 32) == "bad signature"
    dropped = ",".join(p for p in header.split(",") if not p.startswith("d="))
    assert Verifier(SECRET).check(BODY, dropped, now=NOW, destination="a" * 32) == "bad signature"
    # Unbound: refused where a binding is required (legs), accepted where not (KV fetches).
    unbound = sign_body(SECRET, BODY, now=NOW)
    assert (
        Verifier(SECRET).check(BODY, unbound, now=NOW, destination="a" * 32, bound=True) == WRONG_DESTINATION
    )
    assert Verifier(SECRET).check(BODY, unbound, now=NOW, destination="a" * 32) is None
    for bad in ("d=", "d=a/b", "d=" + "a" * 129, "d=a b"):
        forged = header.replace("d=" + "a" * 32, bad)
        assert Verifier(SECRET).check(BODY, forged, now=NOW, destination="a" * 32) == "malformed", bad
    with pytest.raises(ValueError, match="destination"):
        sign_body(SECRET, BODY, destination="a,b")


def test_a_bound_signature_has_a_worked_example() -> None:
    """docs/protocol.md's example, recomputed."""
    header = sign_body(
        b"k", b'{"a":1}', now=1_700_000_000, nonce="0123456789abcdef" * 2, destination="f" * 32
    )
    stamp = b"t=1700000000,n=" + b"0123456789abcdef" * 2 + b",d=" + b"f" * 32
    digest = hmac.new(b"k", stamp + b"\n" + b'{"a":1}', hashlib.sha256).hexdigest()
    assert header == stamp.decode() + ",sha256=" + digest
