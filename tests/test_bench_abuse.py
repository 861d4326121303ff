"""``python -m bench.load --abuse``: its bodies and report, and quick runs end to end.

The end-to-end test starts what ``fastcore-serve up`` starts (tiny torch
workers, an orchestrator with short client timeouts) on 127.0.0.1 and runs the
quick abuse mode against it: every attacker must have run and got the answer
its kind calls for (413 for oversized bodies, 408 or a close for slow and idle
connections, at the configured timeouts), and no honest request may fail.
"""

from __future__ import annotations

import json
import os
import time
from itertools import islice
from pathlib import Path

import pytest

from bench import abuse, abuse_http, abuse_tenants, load
from bench.loadgen import LevelResult, RequestResult
from server.errors import error_body
from server.orchestrator.config import OrchestratorConfig
from server.orchestrator.tenants import read_key_file


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


def test_http_phase_table_has_success_ratio_and_rss() -> None:
    def phase(name: str, ok: int, failed: int, p99: float) -> abuse_http.PhaseResult:
        level = LevelResult(
            name, 4, None, ok + failed, failed, 0, 1.0, 10.0, 5.0, 6.0, 7.0, p99 / 2, p99, p99
        )
        return abuse_http.PhaseResult(name, level, 100 << 20, 300 << 20, 110 << 20, 1.5)

    rows = abuse_http.phase_table([phase("clean", 100, 0, 40.0), phase("trailers", 96, 4, 60.0)]).splitlines()
    cells = [c.strip() for c in rows[-1].split("|")[1:-1]]
    assert cells[0] == "trailers" and cells[2] == "96.0%" and cells[7] == "1.50x"
    assert cells[8] == "100 / 300 / 110" and cells[9] == "1.5 s"


@pytest.mark.slow
def test_quick_abuse_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "abuse.json"
    t0 = time.monotonic()
    rc = load.main(["--abuse", "--quick", "--no-tenants", "--output", str(out)])
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

    # the HTTP layer's phases (issue 19): honest load served through each attack, attackers refused
    http = meta["http_phases"]
    phases = {p["name"]: p for p in http["phases"]}
    assert list(phases) == ["clean", "trailers", "body hold", "slowloris at cap", "large bodies", "mixed"]
    for p in phases.values():
        assert p["success"] >= abuse_http.MIN_SUCCESS, (p["name"], p["honest"]["error_samples"])
        assert p["rss_settle_s"] is not None, p  # RSS back within 64 MiB of where the phase began
    trailers = phases["trailers"]["outcomes"]["trailers"]
    assert sum(n for k, n in trailers.items() if k.startswith("431")) >= 1, trailers
    assert not any(k.split()[0] not in ("431", "open", "reset") for k in trailers), trailers
    hold = phases["body hold"]["outcomes"]["body hold"]  # 3/4 of the budget at most, the rest refused
    assert hold.get("429", 0) >= 1 and hold.get("open at stop", 0) <= 12, hold
    slow = phases["slowloris at cap"]["outcomes"]["slowloris"]
    assert slow.get("429", 0) >= 1 and slow.get("open at stop", 0) <= 3 * meta["http_max_connections"] // 4, (
        slow
    )
    assert set(phases["large bodies"]["outcomes"]["large bodies"]) <= {"404", "429", "503"}
    assert phases["large bodies"]["rss_peak"] > phases["large bodies"]["rss_before"]
    framing = http["framing"]
    assert [framing[k].split()[0] for k in ("no Host", "two Hosts", "4 GiB chunk declared")] == [
        "400",
        "400",
        "413",
    ]
    assert framing["half-closed GET /health"].startswith("200") and framing[
        "half-closed GET /health"
    ].endswith("then closed")
    assert elapsed < 90


# -- the tenant phases (bench/abuse_tenants.py, issue 36)


def test_tenant_bodies_are_what_the_attackers_claim() -> None:
    s = abuse_tenants.TenantAbuseSettings.quick()
    claimed = json.loads(
        abuse_tenants.chat_body(50, max_tokens=3, stream=True, priority=abuse_tenants.MIN_PRIORITY)
    )
    assert claimed["priority"] == -(2**63) and claimed["stream"] is True and claimed["max_tokens"] == 3
    plain = json.loads(abuse_tenants.chat_body(s.pad_prompt_tokens, max_tokens=1, stream=False))
    padded_bytes = abuse_tenants.padded_body(s)
    padded = json.loads(padded_bytes)  # still JSON, the same request: only whitespace added
    assert padded == plain
    assert abs(len(padded_bytes) - s.pad_bytes_per_token * s.pad_prompt_tokens) < 8
    assert padded_bytes.count(b" \n\t\r") > 1000
    # larger than a minute of the limit at any bytes per token up to the default 4
    assert s.over_minute_bytes / 4 > s.attacker_prompt_tokens_per_minute
    # the breaker request's decode fits tiny's context: it is refused for time, never for length
    pytest.importorskip("torch")
    from server.worker.tiny import tiny_config

    assert abuse_tenants.TINY_CONTEXT == tiny_config().max_position_embeddings
    assert s.breaker_prompt_tokens + s.breaker_max_tokens < abuse_tenants.TINY_CONTEXT


@pytest.mark.parametrize("preset", ["quick", "full"])
def test_tenant_deployment_config_loads(tmp_path: Path, preset: str) -> None:
    s = getattr(abuse_tenants.TenantAbuseSettings, preset)()
    keys_file = abuse_tenants.write_keys_file(str(tmp_path))
    tenants = {t.name for t in read_key_file(keys_file).values()}
    assert tenants == {"honest", *abuse_tenants.ATTACKER_TENANTS}
    config = OrchestratorConfig.model_validate(abuse_tenants.deployment_config(s, keys_file))
    assert config.admission is not None and config.request_timeout_s == s.request_timeout_s
    limits = config.admission.rate_limits
    assert set(limits) == set(abuse_tenants.LIMITED_TENANTS) == {"attacker", "attacker-2"}
    assert all(v.prompt_tokens_per_minute == s.attacker_prompt_tokens_per_minute for v in limits.values())


def test_tenant_outcomes_name_the_status_and_the_code() -> None:
    outcome = abuse_tenants.outcome
    assert outcome(503, error_body(503, "no healthy", code="no_healthy_worker")) == "503 no_healthy_worker"
    assert outcome(429, b"not json") == "429"
    assert outcome(200, b'data: {"choices": []}\n\ndata: [DONE]\n\n') == "200"
    event = b'data: {"error": {"message": "x", "code": "upstream_error"}}\n\n'
    assert outcome(200, event) == "200 stream error upstream_error"
    text = "HTTP 503: " + error_body(503, "none", code="no_healthy_worker").decode()
    assert abuse_tenants.honest_error_kind(RequestResult(False, error=text)) == "503 no_healthy_worker"
    assert abuse_tenants.honest_error_kind(RequestResult(False, timed_out=True, error="t")) == "timeout"
    assert (
        abuse_tenants.honest_error_kind(RequestResult(False, error="ClientOSError: reset")) == "ClientOSError"
    )


def test_attackers_get_a_core_of_their_own() -> None:
    assert abuse_tenants.split_cores({0, 1}) == (1, {0})
    assert abuse_tenants.split_cores(set(range(16))) == (15, set(range(15)))
    assert abuse_tenants.split_cores({3}) == (None, {3})  # one core: nothing to split


def test_tenant_report_has_the_ratios_and_the_verdict() -> None:
    def level(label: str, n: int, errors: int, ttft_p99: float) -> LevelResult:
        return LevelResult(label, 4, None, n, errors, 0, 1.0, 10.0, 5.0, 6.0, ttft_p99, 10.0, 12.0, 14.0)

    def run(*mixes: LevelResult) -> abuse_tenants.TenantRun:
        phases = [abuse_tenants.MixPhase(m, existing=i > 0) for i, m in enumerate(mixes)]
        s = abuse_tenants.TenantAbuseSettings.quick()
        return abuse_tenants.TenantRun(level("clean", 100, 0, 20.0), phases, s)

    passing = run(level("mix 3/5/6", 100, 0, 30.0), level("mix", 100, 4, 39.0))
    rows = abuse_tenants.phase_table(passing).splitlines()
    cells = [c.strip() for c in rows[-1].split("|")[1:-1]]
    assert cells[0] == "mix / clean" and cells[4] == "1.95x"
    assert rows[-2].split("|")[1].strip() == "mix 3/5/6 / clean" and "96.0%" in rows[-3]
    assert passing.meets_targets and abuse_tenants.verdict(passing).count("PASS") == 4
    # the target is the whole mix's; items 3, 5 and 6 alone get their own verdict line
    failing = run(level("mix 3/5/6", 100, 0, 30.0), level("mix", 100, 6, 41.0))
    assert not failing.meets_targets
    assert [line.count("FAIL") for line in abuse_tenants.verdict(failing).splitlines()] == [0, 2]
    parser = load.build_parser()
    assert parser.parse_args(["--abuse", "--tenants-only"]).tenants_only
    assert parser.parse_args(["--abuse", "--no-tenants"]).no_tenants


@pytest.mark.slow
def test_quick_tenant_phases_end_to_end(tmp_path: Path) -> None:
    """The keyed deployment, the clean phase and the mix: every attacker ran and was answered.

    Not the targets (success, TTFT ratio): those are what the benchmark measures, on a machine of its own."""
    out = tmp_path / "tenants.json"
    load.main(["--abuse", "--tenants-only", "--quick", "--output", str(out)])
    data = json.loads(out.read_text())
    labels = ["clean", "mix 3/5/6", "mix"]
    assert [lv["label"] for lv in data["levels"]] == labels
    assert all(lv["requests"] > 0 for lv in data["levels"])
    run = data["meta"]["tenant_phases"]
    assert list(run["success"]) == labels and list(run["ttft_p99_ratio"]) == labels[1:]
    assert "meets_targets" in run
    kinds = {"breaker", "priority -2^63", "over a minute's tokens", "whitespace-padded", "long-prompt flood"}
    for phase in run["mixes"]:
        attack = phase["attack"]
        assert set(attack["tenants"]) == kinds, attack["tenants"]
        for kind, counts in attack["tenants"].items():  # each answered with an HTTP status
            assert any(k.split()[0].isdigit() for k in counts), (kind, counts)
        assert len(attack["breaker_s"]) >= 1
        # every tenant was known by its key: admitted, or refused by its own limits (not a 401)
        counted = [k for k in phase["counters"] if k.startswith("fastcore_orchestrator_tenant_")]
        for tenant in ("honest", *abuse_tenants.ATTACKER_TENANTS):
            assert any(f'tenant="{tenant}"' in k for k in counted), (tenant, counted)
        assert phase["idle_inflight"] is not None
    alone, everything = run["mixes"]
    assert (alone["existing"], everything["existing"]) == (False, True)
    assert "existing" not in alone["attack"] and "http" not in alone["attack"]
    existing = everything["attack"]["existing"]
    assert existing["abandon_sent"] > 0 and existing["crashed"] == [], existing["crashed"]
    assert existing["slowloris"]["opened"] > 0 and existing["oversized"]
    assert set(everything["attack"]["http"]) == {"trailers", "body hold"}
    if len(os.sched_getaffinity(0)) >= 2:
        assert run["attacker_core"] is not None and run["attacker_core"] not in run["other_cores"]


def test_abuse_runs_the_tenant_phases_after_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    monkeypatch.setattr(abuse, "_main_clients", lambda args: ran.append("clients") or 0)
    monkeypatch.setattr(abuse_tenants, "main", lambda args: ran.append("tenants") or 1)

    def main(*flags: str) -> int:
        ran.clear()
        return load.main(["--abuse", *flags])

    assert (main(), ran) == (1, ["clients", "tenants"])  # the worse exit status of the two
    assert (main("--no-tenants"), ran) == (0, ["clients"])
    assert (main("--tenants-only"), ran) == (1, ["tenants"])
    assert (main("--url", "http://127.0.0.1:9"), ran) == (0, ["clients"])  # keys and limits not ours
