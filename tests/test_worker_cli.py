"""``fastcore-serve worker`` as a real process: flags, the shared secret from the environment, clean shutdown."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the torch worker: skipped where the [worker] extra is not installed

import torch
from helpers import free_port, http_post

from server.auth import SIGNATURE_HEADER, TRTLLM_AUTH_HEADER, sign_body, trtllm_disagg_auth

ROOT = Path(__file__).resolve().parent.parent


def worker_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "server.cli", "worker", *flags]


@pytest.mark.slow
def test_worker_process_serves_and_stops_cleanly() -> None:
    port = free_port()
    env = {**os.environ, "FASTCORE_SHARED_SECRET": "from-env", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        worker_cmd("--role", "context", "--port", str(port), "--torch-threads", "1", "--device", "cpu"),
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # bounded: 60 s for torch to import and the model to build
            if proc.poll() is not None:
                pytest.fail(
                    f"worker exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
                )
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("worker never became healthy")
        with urllib.request.urlopen(url + "/server_info", timeout=5) as resp:
            info = json.loads(resp.read())
        assert info["role"] == "context" and info["device"] == "cpu" and info["model"] == "tiny"
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0,
                           "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 1}}).encode()  # fmt: skip
        status, resp_body = http_post(url + "/v1/completions", body)
        assert status == 403, resp_body
        status, resp_body = http_post(
            url + "/v1/completions",
            body,
            {SIGNATURE_HEADER: sign_body(b"from-env", body, destination=instance_of(url))},
        )
        assert status == 200 and resp_body["choices"][0]["finish_reason"] == "not_finished"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0
    assert proc.stderr is not None
    # Scripts take the URL up to the first blank (tests/test_faults.py's worker_process does): a
    # ';' glued to it made the orchestrator dial "http://127.0.0.1:N;".
    said = re.findall(r"listening on (http://\S+)", proc.stderr.read())
    assert said == [f"http://127.0.0.1:{port}"], said


def run_worker(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(worker_cmd(*flags), cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip


def test_help_lists_the_roles() -> None:
    done = run_worker("--help")
    assert done.returncode == 0 and "{both,context,generation}" in done.stdout


@pytest.mark.slow
def test_a_model_directory_that_cannot_load_is_reported(tmp_path: Path) -> None:
    done = run_worker(
        "--model", str(tmp_path), "--port", str(free_port()), "--device", "cpu"
    )  # no config.json
    assert done.returncode == 2
    assert "cannot load model" in done.stderr and "config.json" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_a_gpu_is_refused() -> None:
    """One line with the command's prefix and exit 2, as every other refusal of the worker."""
    done = run_worker("--device", "cuda", "--port", str(free_port()))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "fastcore-serve worker: --device cuda: torch sees no CUDA device (without a GPU: --device cpu or auto)"
    ]


@pytest.mark.slow
def test_a_hub_id_says_weights_are_not_downloaded_and_what_to_pass(tmp_path: Path) -> None:
    """--model Qwen/Qwen2-0.5B (a hub id, no such directory): the weights are not downloaded here;
    the line says so and what to pass instead, not only "not a directory"."""
    done = subprocess.run(worker_cmd("--model", "Qwen/Qwen2-0.5B", "--port", str(free_port()), "--device", "cpu"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line == (
        "fastcore-serve worker: cannot load model 'Qwen/Qwen2-0.5B': no such directory, and a Hugging "
        "Face hub id is not downloaded here: download the checkpoint first (huggingface-cli download "
        "Qwen/Qwen2-0.5B --local-dir Qwen2-0.5B) and pass its directory (--model Qwen2-0.5B)"
    )


def start_synthetic(port: int, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = worker_cmd(
        "--model", "synthetic", "--prompt-tokens", "8", "--role", "context", "--port", str(port), *flags
    )
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def instance_of(url: str) -> str:
    """The worker's instance id (its /health): what a leg's signature is bound to."""
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        return str(json.loads(resp.read())["instance"])


def wait_healthy(proc: subprocess.Popen[str], url: str) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            pytest.fail(f"worker exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    pytest.fail("worker never became healthy")


def test_the_secret_from_a_file_stays_off_the_command_line(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-a-file\n")
    port = free_port()
    # The file wins over the environment; the trailing newline is not part of the secret.
    proc = start_synthetic(
        port, "--shared-secret-file", str(secret_file), env={"FASTCORE_SHARED_SECRET": "env"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"from-a-file" not in cmdline
        body = json.dumps({"prompt": "hi", "max_tokens": 2,
                           "disaggregated_params": {"request_type": "context_only"}}).encode()  # fmt: skip
        here = instance_of(url)
        signed = {SIGNATURE_HEADER: sign_body(b"env", body, destination=here)}
        assert http_post(url + "/v1/completions", body, signed)[0] == 403
        signed = {SIGNATURE_HEADER: sign_body(b"from-a-file", body, destination=here)}
        status, _ = http_post(url + "/v1/completions", body, signed)
        assert status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--shared-secret-file", "/nonexistent/secret"), "cannot read the shared secret"),
        (("--kv-allow", "host/path"), "is not HOST[:PORT]"),
        (("--max-parked-fraction", "1.5"), "max_parked_fraction must be within [0, 1]"),
    ],
)
def test_bad_hardening_flags_are_refused(flags: tuple[str, ...], message: str, tmp_path: Path) -> None:
    done = run_worker("--model", "synthetic", "--port", str(free_port()), *flags)
    assert done.returncode == 2 and message in done.stderr


def test_an_empty_secret_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    done = run_worker("--model", "synthetic", "--port", str(free_port()), "--shared-secret-file", str(empty))
    assert done.returncode == 2 and "is empty" in done.stderr


def test_the_trtllm_key_from_a_file_and_the_trtllm_orchestrator_flag(tmp_path: Path) -> None:
    """--internal-request-auth-key-file: a key apart from the shared secret (never the env's
    secret in its place); --accept-trtllm-orchestrator: unsigned legs, completions' ids as a list."""
    key_file = tmp_path / "trtllm-key"
    key_file.write_text("trtllm-key\n")
    port = free_port()
    proc = start_synthetic(port, "--internal-request-auth-key-file", str(key_file), "--accept-trtllm-orchestrator",
                           env={"FASTCORE_SHARED_SECRET": "env"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        with urllib.request.urlopen(url + "/server_info", timeout=10) as resp:
            info = json.loads(resp.read())
        assert info["internal_auth"] == {"fastcore_signature": True, "trtllm_disagg_auth": True,
                                         "accept_trtllm_orchestrator": True}  # fmt: skip
        assert info["prompt_token_ids_b64_completions"] is False
        body = json.dumps({"prompt": "hi", "max_tokens": 2, "disaggregated_params": {
            "request_type": "context_only", "return_prompt_token_ids_b64": True}}).encode()  # fmt: skip
        status, doc = http_post(url + "/v1/completions", body)  # unsigned, as trtllm's orchestrator sends it
        assert (
            status == 200 and isinstance(doc["prompt_token_ids"], list) and "prompt_token_ids_b64" not in doc
        )
        # The trtllm header is checked under the file's key (before the role: this is a context worker).
        endpoint = "http://127.0.0.1:1/kv/5"
        leg = json.dumps({"prompt": [1, 2], "max_tokens": 2, "disaggregated_params": {
            "request_type": "generation_only", "first_gen_tokens": [3], "ctx_info_endpoint": endpoint}}).encode()  # fmt: skip
        for key, want in ((b"env", 403), (b"trtllm-key", 400)):
            status, doc = http_post(
                url + "/v1/completions", leg, {TRTLLM_AUTH_HEADER: trtllm_disagg_auth(key, endpoint, None)}
            )
            assert status == want, doc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_an_empty_trtllm_key_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    done = run_worker(
        "--model", "synthetic", "--port", str(free_port()), "--internal-request-auth-key-file", str(empty)
    )
    assert (
        done.returncode == 2
        and "cannot read the internal request auth key" in done.stderr
        and "is empty" in done.stderr
    )


def test_each_flag_that_fills_a_worker_setting_defaults_to_the_settings_own() -> None:
    """One home for each default (issue 24): the flags read WorkerSettings' defaults, which read the
    HTTP ones from server/http/limits.py; the settings built from no flags are the default settings."""
    import argparse
    import dataclasses

    from server.http import limits
    from server.worker import cli
    from server.worker.app import WorkerSettings

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    defaults = WorkerSettings()
    for dest, field in cli._SETTINGS.items():
        assert getattr(args, dest) == getattr(defaults, field), dest
    assert set(cli._SETTINGS.values()) <= {f.name for f in dataclasses.fields(WorkerSettings)}
    from server.worker.engine_api import EngineRequest

    park_ttl = next(f for f in dataclasses.fields(EngineRequest) if f.name == "park_ttl_s")
    assert park_ttl.default == defaults.kv_ttl_s == args.kv_ttl  # the app sets it from the settings
    assert defaults.limits() == limits.Limits(
        max_body_bytes=limits.WORKER_MAX_BODY_BYTES,
        keepalive_timeout_s=limits.WORKER_KEEPALIVE_TIMEOUT_S,
        max_inflight_body_bytes=limits.WORKER_MAX_INFLIGHT_BODY_BYTES,
    )
    # the user-visible defaults the worker had before they moved to server/http/limits.py
    assert (args.max_body_bytes, args.max_inflight_body_bytes, args.keepalive_timeout) == (
        64 << 20,
        1 << 30,
        75.0,
    )
    help_text = " ".join(parser.format_help().split())  # argparse wraps at the terminal's width
    assert "(default 64 MiB)" in help_text and "(default 1 GiB)" in help_text


def test_the_engine_flags_default_to_the_torch_engines_own() -> None:
    import argparse
    import inspect

    from server import launcher
    from server.worker import cli
    from server.worker.engine import TorchEngine

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    engine = inspect.signature(TorchEngine).parameters
    for flag in (
        "block_size",
        "max_num_seqs",
        "prefix_caching",
        "prefill_chunk_tokens",
        "prefill_step_ratio",
    ):
        assert getattr(args, flag) == engine[flag].default, flag
    assert args.kv_tokens is None and engine["kv_tokens"].default == cli.DEFAULT_KV_TOKENS  # tiny's
    help_text = " ".join(parser.format_help().split())
    assert f"(default: {engine['kv_tokens'].default} for tiny" in help_text
    up = argparse.ArgumentParser()
    launcher.add_arguments(up)
    assert up.parse_args([]).model == args.model == cli.DEFAULT_MODEL


def test_a_synthetic_worker_from_no_flags_is_the_synthetic_engines_defaults() -> None:
    import argparse
    import inspect

    from server.worker import cli, synthetic

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    engine, name, _ = cli.build_engine(parser.parse_args(["--model", "synthetic"]))
    defaults = inspect.signature(synthetic.SyntheticEngine).parameters
    assert name == "synthetic"
    assert engine.max_num_seqs == defaults["max_num_seqs"].default == synthetic.MAX_NUM_SEQS
    assert engine.cache.capacity_tokens == defaults["kv_tokens"].default == synthetic.KV_TOKENS
    from server.worker.engine import TorchEngine

    # the prefix cache it models has the torch engine's blocks
    assert synthetic.BLOCK_SIZE == inspect.signature(TorchEngine).parameters["block_size"].default
