"""``python -m bench.load --abuse``: its bodies and report, and a quick run end to end.

The end-to-end test starts what ``fastcore-serve up`` starts (tiny torch
workers, an orchestrator with short client timeouts) on 127.0.0.1 and runs the
quick abuse mode against it: every attacker must have run and got the answer
its kind calls for (413 for oversized bodies, 408 or a close for slow and idle
connections, at the configured timeouts), and no honest request may fail.
"""

from __future__ import annotations

import json
import time
from itertools import islice
from pathlib import Path

import pytest

from bench import abuse, load
from bench.load import LevelResult


def test_bodies_are_what_the_attackers_claim() -> None:
    big = abuse.large_body(3 << 20)
    assert abs(len(big) - (3 << 20)) < 64
    parsed = json.loads(big)
    assert parsed["messages"][0]["role"] == "user" and parsed["stream"] is False
    chat = json.loads(abuse.tiny_chat_body(500, max_tokens=7))
    assert [m["role"] for m in chat["messages"]] == ["system", "user"]
    assert 450 <= sum(len(m["content"]) for m in chat["messages"]) <= 560
    assert chat["max_tokens"] == 7 and chat["stream"] is True
    trickle = b"".join(islice(abuse.slow_header_bytes("h"), 5000))
    assert trickle.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\n")
    assert b"\r\n\r\n" not in trickle  # the headers never end


def test_settings_take_the_flags_and_the_quick_preset() -> None:
    args = load.build_parser().parse_args(["--abuse", "--quick", "--concurrency", "3,9", "--slowloris", "7"])
    s = abuse.settings_from_args(args)
    assert (s.concurrency, s.slowloris) == (3, 7)
    assert s.header_timeout_s == abuse.QUICK_LIMITS["client_header_timeout_s"]
    assert s.min_window_s > max(abuse.QUICK_LIMITS.values())
    full = abuse.settings_from_args(load.build_parser().parse_args(["--abuse"]))
    assert full.max_body_bytes == abuse.DEFAULTS.max_body_bytes
    assert full.min_window_s > abuse.DEFAULTS.client_header_timeout_s


def test_phase_table_has_the_ratio_row() -> None:
    def level(label: str, ttft: float, e2e: float) -> LevelResult:
        return LevelResult(label, 8, None, 10, 0, 0, 1.0, 10.0, ttft, ttft, 2 * ttft, e2e, e2e, 2 * e2e)

    text = abuse.phase_table(level("clean", 10.0, 100.0), level("abuse", 30.0, 150.0))
    ratio_row = text.splitlines()[-1]
    assert ratio_row.startswith("| abuse/clean")
    assert [c.strip() for c in ratio_row.split("|")[5:9]] == ["3.00x", "3.00x", "1.50x", "1.50x"]


@pytest.mark.slow
def test_quick_abuse_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "abuse.json"
    t0 = time.monotonic()
    rc = load.main(["--abuse", "--quick", "--output", str(out)])
    elapsed = time.monotonic() - t0
    data = json.loads(out.read_text())
    clean, attacked = data["levels"]
    meta = data["meta"]
    s, a = meta["settings"], meta["attack"]

    # honest traffic: all of it served, in both phases
    for lv in (clean, attacked):
        assert lv["requests"] == s["requests"], lv
        assert (lv["errors"], lv["timeouts"]) == (0, 0), lv["error_samples"]
        assert lv["ttft_p50_ms"] and lv["latency_p99_ms"]
    assert rc == 0

    # abandon flood: every round sent whole; nothing answered within the 50 ms (the context leg runs)
    assert a["abandon_rounds"] >= 2 and a["abandon_sent"] == a["abandon_rounds"] * s["abandon_batch"]
    assert a["abandon_connect_errors"] == 0
    # slowloris: every slot dropped by the server with a 408, at the header timeout
    header, keepalive = s["header_timeout_s"], s["keepalive_timeout_s"]
    sl = a["slowloris"]
    assert sl["outcomes"].get("408", 0) >= s["slowloris"], sl["outcomes"]
    assert all(header - 0.1 <= h <= header + 1.5 for h in sl["held_s"]), sl["held_s"]
    # idle connections closed silently at the header timeout, idle keep-alive ones at the keep-alive timeout
    for kind, count, limit in (("idle", s["idle"], header), ("keepalive", s["keepalive"], keepalive)):
        c = a[kind]
        assert c["outcomes"].get("closed", 0) >= count, (kind, c["outcomes"])
        assert all(limit - 0.1 <= h <= limit + 1.5 for h in c["held_s"]), (kind, c["held_s"])
    # oversized bodies: 413 for all of them; the large allowed ones relayed and refused by the worker (400)
    rounds = a["oversize_rounds"]
    assert rounds >= 1
    assert a["oversized"]["content-length"] == {"413": rounds * s["oversize_content_length"]}
    assert a["oversized"]["chunked"] == {"413": rounds * s["oversize_chunked"]}
    assert a["oversized"]["large-allowed"] == {"400": rounds * s["large_allowed"]}
    assert max(a["oversized_answer_s"]["content-length"]) < 2.0  # refused on the headers
    assert a["crashed"] == []

    # the servers afterwards: no KV left on the context worker but parked entries (an abandoned
    # request whose context leg ended before its hang-up reached the worker), every process measured
    kv = meta["kv"]
    assert kv["at_end"] - (kv["parked_tokens_at_end"] or 0) == 0, kv
    assert set(meta["rss"]) == {"before", "after clean", "end of abuse", "at end"}
    assert all(v > 0 for v in meta["rss"]["at end"].values()) and len(meta["rss"]["at end"]) == 3
    assert elapsed < 60
