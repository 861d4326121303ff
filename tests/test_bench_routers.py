"""bench.routers' machinery, small and for real on 127.0.0.1; the PD mocks' protocol checks.

The harness run starts the raw floor and fastcore's orchestrator (both gates)
on synthetic workers, pinned as the benchmark pins them, drives a handful of
streaming and non-streaming requests through each and reads the JSON it
writes. The Rust routers run only where ``python -m bench.routers --install``
put them (CI has none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench import routers
from bench.deploy import free_port, wait_healthy
from bench.pd_mocks import ENGINE_ID, check_sglang, check_vllm_decode, check_vllm_prefill

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "--prompt-tokens",
    "250",
    "--concurrency",
    "2",
    "--requests",
    "12",
    "--warmup",
    "4",
    "--max-seconds",
    "20",
    "--timeout",
    "20",
    "--max-tokens",
    "4",
]


def _run(tmp_path: Path, fronts: str) -> dict:
    out = tmp_path / "routers.json"
    rc = routers.main(
        ["--fronts", fronts, *TINY, "--output", str(out), "--plot", str(tmp_path / "routers.png")]
    )
    data = json.loads(out.read_text())
    assert rc == 0, data
    assert (tmp_path / "routers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return data


def _check_rows(data: dict, fronts: list[str]) -> None:
    rows = data["rows"]
    assert {(r["front"], r["stream"]) for r in rows} == {(f, s) for f in fronts for s in (True, False)}
    for r in rows:
        assert r["requests"] == 12 and r["completed"] == 12 and r["errors"] == 0, r
        # 12 requests can fall between two 10 ms clock ticks: utime+stime may read 0, schedstat's ns do not
        assert r["cpu_ms_per_request"] is not None and r["cpu_ms_per_request"] >= 0, r
        assert r["sched_ms_per_request"] > 0, r
        assert r["completions_per_s"] > 0 and r["ttft_p50_ms"] > 0, r


@pytest.mark.slow
def test_the_harness_measures_the_raw_floor_and_fastcore(tmp_path: Path) -> None:
    data = _run(tmp_path, "rawfloor,fastcore:both-gates")
    _check_rows(data, ["rawfloor", "fastcore:both-gates"])
    assert data["meta"]["skipped"] == {}


@pytest.mark.slow
def test_the_harness_measures_the_installed_rust_routers(tmp_path: Path) -> None:
    installed = [r.name for r in routers.RUST_ROUTERS.values() if r.installed_version(routers.VENVS)]
    if not installed:
        pytest.skip(f"no Rust router installed in {routers.VENVS} (python -m bench.routers --install)")
    data = _run(tmp_path, ",".join(installed))
    _check_rows(data, installed)
    assert all(r["violations"] == 0 for r in data["rows"])


def test_a_missing_router_is_skipped_with_a_note(tmp_path: Path) -> None:
    args = routers.build_parser().parse_args(["--venvs", str(tmp_path)])
    assert "not installed" in (routers.check_front("sglang-router", args) or "")
    assert "no --fastcore-root" in (routers.check_front("fastcore-before:both-gates", args) or "")
    assert "unknown" in (routers.check_front("fastcore:no-such-mode", args) or "")
    assert (
        routers.check_front("rawfloor", args) is None and routers.check_front("fastcore:parsed", args) is None
    )


# -- the PD mocks' protocol checks --------------------------------------------------


def test_vllm_checks_want_the_prefill_and_decode_fields() -> None:
    good_prefill = {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    assert check_vllm_prefill(good_prefill) == []
    assert check_vllm_prefill({"max_tokens": 1, "stream": False})  # no kv_transfer_params
    assert check_vllm_prefill({**good_prefill, "max_tokens": 16})
    assert check_vllm_prefill({**good_prefill, "stream": True})
    ktp = {"do_remote_prefill": True, "remote_engine_id": ENGINE_ID, "remote_block_ids": [7]}
    issued = {7}
    assert check_vllm_decode({"max_tokens": 16, "kv_transfer_params": ktp}, issued) == []
    assert check_vllm_decode({"max_tokens": 16, "kv_transfer_params": ktp}, issued)  # block 7 used twice
    assert check_vllm_decode({"max_tokens": 16}, {7})  # nothing copied from the prefill


def test_sglang_checks_want_the_bootstrap_fields() -> None:
    good = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}
    assert check_sglang(good) == []
    for missing in good:
        assert check_sglang({k: v for k, v in good.items() if k != missing})


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read()


def _stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/mock_stats", timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture
def mocks(request: pytest.FixtureRequest):
    def start(flavor: str) -> tuple[int, int]:
        prefill, decode = free_port(), free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.pd_mocks",
                "--flavor",
                flavor,
                "--prefill-port",
                str(prefill),
                "--decode-port",
                str(decode),
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        request.addfinalizer(lambda: (proc.terminate(), proc.wait(10)))
        wait_healthy(f"http://127.0.0.1:{decode}/health", [], timeout=30)
        return prefill, decode

    return start


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_live_vllm_mocks_count_a_decode_without_kv_transfer_params(mocks) -> None:
    prefill, decode = mocks("vllm")
    answer = json.loads(
        _post(
            f"http://127.0.0.1:{prefill}/v1/chat/completions",
            {**CHAT, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}},
        )
    )
    ktp = answer["kv_transfer_params"]
    assert ktp["do_remote_prefill"] is True and ktp["remote_engine_id"] == ENGINE_ID
    _post(f"http://127.0.0.1:{decode}/v1/chat/completions", {**CHAT, "kv_transfer_params": ktp})
    assert _stats(prefill)["violations"] == 0
    _post(f"http://127.0.0.1:{decode}/v1/chat/completions", CHAT)  # the router forgot the prefill's params
    stats = _stats(decode)
    assert (stats["prefill"], stats["decode"], stats["violations"]) == (1, 2, 1)
    assert "kv_transfer_params" in stats["samples"][0]


def test_live_sglang_mocks_count_missing_bootstrap_fields_and_stream_sse(mocks) -> None:
    prefill, decode = mocks("sglang")
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 99}
    for port in (prefill, decode):
        _post(f"http://127.0.0.1:{port}/v1/chat/completions", {**CHAT, **boot})
    stream = _post(
        f"http://127.0.0.1:{decode}/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = [e for e in stream.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(bool(c["choices"] and c["choices"][0]["delta"].get("content")) for c in chunks) == 4
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    time.sleep(0.05)
    stats = _stats(prefill)
    assert stats["violations"] == 1 and "bootstrap" in stats["samples"][0]  # the stream had none
    assert stats["unpaired"] == 0  # room 99 arrived on both sides
