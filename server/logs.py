"""One log format for every process (issue 41 item 5): the orchestrator (and each of its
``--workers N`` processes), the workers and ``fastcore-serve up`` itself.

Text, one line per record (UTC, milliseconds; the role and pid tell the processes of one
deployment apart in one terminal)::

    2026-12-06T06:27:02.123Z orchestrator[4242] INFO fastcore.orchestrator: listening on http://...

``--log-format json``: one JSON object per line for log shippers (Vector, Fluent Bit, Loki's
promtail read it without a parser of their own): ``time``, ``role``, ``pid``, ``level``,
``logger``, ``message`` and, with a traceback, ``exception``.

Each process says at start what is on (:func:`features`) and when it is told to stop, has drained
and exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import TextIO

#: --log-format's choices
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(role)s[%(process)d] %(levelname)s %(name)s: %(message)s"


def _utc(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__(TEXT_FORMAT)
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        record.role = self.role
        return super().format(record)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _utc(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a message's newlines are escaped)."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": _utc(record),
            "role": self.role,
            "pid": record.process,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure(
    role: str, level: str | int = "INFO", log_format: str = "text", stream: TextIO | None = None
) -> None:
    """This process's logging: one handler on the root logger, to stderr, in ``log_format``
    (``ValueError`` for another). Replaces a handler set before (a spawned process sets its own)."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream) if stream is not None else _Stderr()
    handler.setFormatter(TextFormatter(role) if log_format == "text" else JsonFormatter(role))
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    for old in root.handlers[:]:
        if old.get_name() == _HANDLER_NAME:  # ours, from a configure before; others' are theirs
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


#: the name of the handler :func:`configure` adds (and replaces)
_HANDLER_NAME = "fastcore"


class _Stderr(logging.StreamHandler):
    """``sys.stderr`` as it is when a line is written, as logging's own last resort does: code that
    swaps ``sys.stderr`` (pytest's capture, in a process that configured logging before) keeps its
    lines, and none goes to a stream closed since."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="text (default): timestamp, role[pid], level, logger, message; json: one object per line",
    )


def features(**on: object) -> str:
    """``name=value`` for each feature, in order: a bool as on/off, None as off."""
    return " ".join(f"{name}={_word(value)}" for name, value in on.items())


def _word(value: object) -> str:
    if value is None or value is False:
        return "off"
    return "on" if value is True else str(value)
