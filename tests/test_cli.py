"""``fastcore-serve`` as a newcomer meets it: the bare wheel (no extras), ``--version``, unusable ports.

The bare wheel is a real process whose imports of the optional dependencies
fail, as they do where only ``pip install fastcore-serve`` ran: an import hook
installed before ``server.cli`` is imported makes those modules unfindable.
Ports are real sockets on 127.0.0.1 held by the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, free_ports

import fastcore
from server import cli, ports

ROOT = Path(__file__).resolve().parent.parent
#: every third-party module of the server and worker extras
EXTRAS_MODULES = ("yaml", "pydantic", "aiohttp", "httptools", "simdjson", "msgspec", "uvloop",
                  "prometheus_client", "torch", "safetensors", "tokenizers", "jinja2")  # fmt: skip

BARE = r"""
import importlib.abc, importlib.util, sys
BLOCKED = set(sys.argv[1].split(","))

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.partition(".")[0] in BLOCKED else _find_spec(name, *a)
from server.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run_cli(
    *argv: str, without: tuple[str, ...] = (), timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = BARE if without else "import sys; from server.cli import main; sys.exit(main(sys.argv[2:]))"
    return subprocess.run(
        [sys.executable, "-c", code, ",".join(without), *argv],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False,
    )  # fmt: skip


def test_the_bare_wheel_prints_help_naming_the_extra_each_command_needs() -> None:
    done = run_cli("--help", without=EXTRAS_MODULES)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = " ".join(done.stdout.split())
    assert "up start a local deployment" in lines and "[needs the worker extra]" in lines
    assert "orchestrator run the disaggregated-serving orchestrator [needs the server extra]" in lines
    assert "worker run a worker (torch model or synthetic) [needs the server extra]" in lines


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        ((), "worker"),  # the default command is up, on the built-in torch model
        (("up", "--port", "8123"), "worker"),
        (("orchestrator", "-c", "missing.yaml", "--port", "8123"), "server"),
        (("worker", "--model", "synthetic"), "server"),
        (
            (
                "register",
                "--url",
                "http://127.0.0.1:9",
                "--role",
                "context",
                "--protocol",
                "vllm",
                "--cluster-uri",
                "etcd://127.0.0.1:1",
            ),
            "server",
        ),
    ],
)
def test_each_command_of_the_bare_wheel_says_what_to_install(argv: tuple[str, ...], extra: str) -> None:
    done = run_cli(*argv, without=EXTRAS_MODULES)
    assert done.returncode == 2
    assert done.stdout == ""
    command = argv[0] if argv else "up"
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"fastcore-serve {command}: ") and " is not installed; " in line
    assert line.endswith(f"pip install 'fastcore-serve[{extra}]'")


def test_a_command_help_of_the_bare_wheel_says_what_to_install() -> None:
    done = run_cli("orchestrator", "--help", without=EXTRAS_MODULES)
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert "pip install 'fastcore-serve[server]'" in " ".join(done.stdout.split())


@pytest.mark.parametrize("argv", [("worker", "--model", "tiny", "--port", "0"), ("up", "--port", "8123")])
def test_without_torch_the_torch_commands_say_to_install_the_worker_extra(argv: tuple[str, ...]) -> None:
    """The server extra alone: the synthetic worker runs, a torch model says what is missing."""
    done = run_cli(*argv, without=("torch",))
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line == f"fastcore-serve {argv[0]}: torch is not installed; this needs the worker extra: " \
        "pip install 'fastcore-serve[worker]'"  # fmt: skip


def test_version_names_the_package_and_the_backend() -> None:
    done = run_cli("--version", without=EXTRAS_MODULES)
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.strip() == f"fastcore-serve {fastcore.__version__} (fastcore backend: {fastcore.backend})"
    )


def test_missing_modules_of_our_own_keep_their_traceback() -> None:
    """Only our optional dependencies are explained: a missing module of ours is a bug to see."""
    assert cli.missing_extra(ModuleNotFoundError(name="server.nothing")) is None
    assert cli.missing_extra(ModuleNotFoundError(name="fastcore._gone")) is None
    assert cli.missing_extra(ModuleNotFoundError(name=None)) is None
    assert cli.extra_for(ModuleNotFoundError(name="torch.cuda")) == "worker"
    assert cli.extra_for(ModuleNotFoundError(name="yaml")) == "server"
    assert cli.extra_for(ModuleNotFoundError(name="yaml"), "up") == "worker"


# ---------------------------------------------------------------- unusable ports


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    return line


def test_a_worker_on_a_busy_port_is_one_line_naming_the_port_and_the_flag(busy_port: int) -> None:
    line = one_line(run_cli("worker", "--model", "synthetic", "--port", str(busy_port)))
    assert line == f"fastcore-serve worker: cannot listen on 127.0.0.1:{busy_port}: the port is already " \
        "in use; choose another with --port"  # fmt: skip


def test_an_orchestrator_on_a_busy_port_is_one_line_naming_the_port_and_the_flag(busy_port: int) -> None:
    line = one_line(run_cli("orchestrator", "--port", str(busy_port), "--context-urls", "127.0.0.1:1",
                            "--generation-urls", "127.0.0.1:2"))  # fmt: skip
    assert line == f"fastcore-serve orchestrator: cannot listen on 127.0.0.1:{busy_port}: the port is " \
        "already in use; choose another with --port"  # fmt: skip


def test_up_checks_every_port_before_it_starts_anything(busy_port: int) -> None:
    """Every port the plan needs is checked, and every busy one named, whatever else the machine
    holds: the other ports are held for the test (free_ports), the orchestrator's is busy."""
    workers = free_ports(2)
    line = one_line(run_cli("up", "--model", "synthetic", "--port", str(busy_port),
                            "--worker-base-port", str(workers)))  # fmt: skip
    assert line == f"fastcore-serve up: cannot listen on 127.0.0.1:{busy_port}: the port is already in use " \
        "(the orchestrator); choose another with --port"  # fmt: skip
    # A listener with SO_REUSEADDR may join our reservation of the context worker's port (see
    # server.ports): that port is busy, the generation worker's next to it stays held for us.
    with socket.socket() as context:
        context.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        context.bind(("127.0.0.1", workers))
        context.listen()
        line = one_line(run_cli("up", "--model", "synthetic", "--port", str(free_port()),
                                "--worker-base-port", str(workers)))  # fmt: skip
    assert line == f"fastcore-serve up: cannot listen on 127.0.0.1:{workers}: the port is already in use " \
        "(the context worker 0); choose another with --worker-base-port"  # fmt: skip


def test_up_names_every_busy_port_not_only_the_first() -> None:
    orchestrator, workers = free_port(), free_ports(2)
    with socket.socket() as a, socket.socket() as b:
        for held, port in ((a, orchestrator), (b, workers + 1)):
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.bind(("127.0.0.1", port))
            held.listen()
        done = run_cli(
            "up", "--model", "synthetic", "--port", str(orchestrator), "--worker-base-port", str(workers)
        )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"fastcore-serve up: cannot listen on 127.0.0.1:{workers + 1}: the port is already in use (the "
        "generation worker 0); choose another with --worker-base-port",
        f"fastcore-serve up: cannot listen on 127.0.0.1:{orchestrator}: the port is already in use (the "
        "orchestrator); choose another with --port",
    ]


def test_an_address_not_of_this_machine_points_at_host() -> None:
    line = one_line(run_cli("worker", "--model", "synthetic", "--host", "192.0.2.1", "--port", "8123"))
    assert line == "fastcore-serve worker: cannot listen on 192.0.2.1:8123: the address is not one of " \
        "this machine's; choose another with --host"  # fmt: skip


def test_a_port_taken_between_the_check_and_the_bind_is_one_line_too(busy_port: int) -> None:
    """The real bind's error reads the same as the early check's."""
    error = OSError(98, "Address already in use")
    assert ports.listen_problem(error) == "the port is already in use"
    assert ports.listen_problem(OSError(2, "No such file")) is None
    assert ports.port_problem("127.0.0.1", busy_port) == "the port is already in use"
    assert ports.port_problem("127.0.0.1", 0) is None


# ---------------------------------------------------------------- another project's fastcore


@pytest.mark.parametrize("argv", [("--help",), ("--version",), ("up", "--model", "synthetic")])
def test_another_projects_fastcore_first_on_the_path_is_one_line_naming_it(
    argv: tuple[str, ...], tmp_path: Path
) -> None:
    """fast.ai's ``fastcore`` (2.x) installed over ours, or first on the import path: every command,
    even --help, says so in one line with the fix and exits 2 (each died of an AttributeError)."""
    foreign = tmp_path / "fastcore"
    foreign.mkdir()
    (foreign / "__init__.py").write_text('__version__ = "2.0.0"\n')
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(tmp_path), str(ROOT)))}, check=False,
    )  # fmt: skip
    line = one_line(done)
    assert line.startswith(
        "fastcore-serve: `import fastcore` finds another project's package (version 2.0.0, "
    )
    assert str(foreign / "__init__.py") in line and "virtual environment" in line


def test_a_run_of_free_ports_is_found_when_the_kernel_never_offers_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every port the kernel picks has its next one busy (as when every odd port of the ephemeral
    range is held): reserve_ports scans for a run by binding, outside the ephemeral range too, and
    holds it; the scan never joins a port another socket holds (a plain bind there fails)."""
    blockers: list[socket.socket] = []
    picks: list[int] = []
    hold = ports._hold

    def kernel_pick_with_its_next_port_busy(host: str, port: int) -> socket.socket | None:
        held = hold(host, port)
        if port == 0 and held is not None:
            picked = held.getsockname()[1]
            picks.append(picked)
            blocker = socket.socket()
            try:
                blocker.bind((host, picked + 1))
                blockers.append(blocker)
            except (OSError, OverflowError):
                blocker.close()  # busy already (or past 65535): busy either way
        return held

    monkeypatch.setattr(ports, "_hold", kernel_pick_with_its_next_port_busy)
    try:
        base = ports.reserve_ports(2, consecutive=True)[0]
        assert picks and base not in picks  # the kernel's picks were all refused: the scan found it
        for port in (base, base + 1):
            with socket.socket() as other, pytest.raises(OSError):  # held by us
                other.bind(("127.0.0.1", port))
        ports.release_ports([base, base + 1])
    finally:
        for blocker in blockers:
            blocker.close()
