"""``fastcore-serve up`` as a user runs it: a subprocess, real workers, a real request, Ctrl-C."""

from __future__ import annotations

import argparse
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
import urllib.request
from pathlib import Path

import pytest

from server import launcher

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 240.0


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def consecutive_free_ports(n: int) -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n < 65535 and all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


class Up:
    """``python -m server.cli up ...`` with its output read line by line on a thread."""

    def __init__(self, *extra: str) -> None:
        self.port = consecutive_free_ports(1)
        self.worker_base = consecutive_free_ports(2)
        argv = [sys.executable, "-m", "server.cli", "up", "--port", str(self.port)]
        argv += ["--worker-base-port", str(self.worker_base), *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


def _pids_with(*needles: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
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
