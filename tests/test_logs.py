"""server/logs.py: one log format for every process (issue 41 item 5), text and JSON lines.

The processes' own output (the launcher's, each child's) is read in tests/test_launcher.py."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest

from server import logs

TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z orchestrator\[\d+\] WARNING fastcore\.test: (.*)$"
)


@pytest.fixture
def root_handlers():
    """The root logger's handlers and level, put back after the test (configure replaces them)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_text_lines_carry_the_time_the_role_and_pid_the_level_and_the_logger(root_handlers) -> None:
    out = io.StringIO()
    logs.configure("orchestrator", "INFO", "text", stream=out)
    logging.getLogger("fastcore.test").warning("drain: %d left", 3)
    logging.getLogger("fastcore.test").debug("not at INFO")
    (line,) = out.getvalue().splitlines()
    match = TEXT_LINE.match(line)
    assert match and match.group(1) == "drain: 3 left", line


def test_json_lines_are_one_object_each_with_the_exception(root_handlers) -> None:
    out = io.StringIO()
    logs.configure("context-worker", logging.INFO, "json", stream=out)
    log = logging.getLogger("fastcore.worker")
    log.info('two\nlines and a "quote"')
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert set(first) == {"time", "role", "pid", "level", "logger", "message"}
    assert (
        first["role"] == "context-worker"
        and first["level"] == "INFO"
        and first["logger"] == "fastcore.worker"
    )
    assert first["message"] == 'two\nlines and a "quote"' and isinstance(first["pid"], int)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert second["level"] == "ERROR" and "ValueError: bad" in second["exception"]


def test_configure_replaces_the_handler_and_refuses_an_unknown_format(root_handlers) -> None:
    first, second = io.StringIO(), io.StringIO()
    logs.configure("launcher", "INFO", "text", stream=first)
    logs.configure("launcher", "INFO", "json", stream=second)
    logging.getLogger("fastcore.test").info("once")
    assert first.getvalue() == "" and json.loads(second.getvalue())["message"] == "once"
    with pytest.raises(ValueError, match="log format must be one of text, json, got 'xml'"):
        logs.configure("launcher", "INFO", "xml")


def test_features_say_on_off_or_the_value() -> None:
    assert logs.features(api_keys=True, admission=False, cluster=None, relay="fast", processes=2) == (
        "api_keys=on admission=off cluster=off relay=fast processes=2"
    )
