"""``log_format``: every log line carries its time in ISO 8601 UTC with milliseconds, as text or
as one JSON object a line (time, level, logger, message, exc_info)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest

from kv_slot_tracker.log_format import JsonFormatter, TextFormatter, logging_config
from tests.servers import PYTHON, REPO

# 2026-12-04T21:44:01.123 UTC
CREATED = 1_796_420_641.123
ISO = "2026-12-04T21:44:01.123Z"
ISO_PATTERN = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("the stream is gone")
        except ValueError:
            exc_info = sys.exc_info()
    r = logging.LogRecord("kv_slot_tracker.replication.redis.reader", logging.WARNING,
                          __file__, 1, msg, args, exc_info)  # fmt: skip
    r.created, r.msecs = CREATED, 123.0
    return r


def test_text_lines_start_with_the_utc_time_in_milliseconds() -> None:
    line = TextFormatter("%(asctime)s %(levelprefix)s %(message)s", use_colors=False).format(
        record("reading on from %s", "1-0")
    )
    assert line == f"{ISO} WARNING:  reading on from 1-0"


def test_json_lines_carry_the_fields_a_log_pipeline_expects() -> None:
    fmt = JsonFormatter()
    assert json.loads(fmt.format(record("reading on from %s", "1-0"))) == {
        "time": ISO,
        "level": "WARNING",
        "logger": "kv_slot_tracker.replication.redis.reader",
        "message": "reading on from 1-0",
    }
    line = fmt.format(record("failed", exc=True))
    assert "\n" not in line  # one line, the traceback escaped inside it
    out = json.loads(line)
    assert out["message"] == "failed"
    assert out["exc_info"].startswith("Traceback (most recent call last):")
    assert out["exc_info"].endswith("ValueError: the stream is gone")


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_service_loggers_are_configured_in_the_format(log_format: str) -> None:
    """The configuration the server starts with (``logging.config.dictConfig``), in a process
    of its own: the service's lines and uvicorn's in the format, at the level."""
    code = (
        "import logging, logging.config, sys\n"
        "from kv_slot_tracker.log_format import logging_config\n"
        f"logging.config.dictConfig(logging_config('info', {log_format!r}))\n"
        "log = logging.getLogger('kv_slot_tracker.replication.redis.outbox')\n"
        "log.debug('not shown')\n"
        "log.info('publisher reconnected')\n"
        "logging.getLogger('uvicorn.error').info('Application startup complete.')\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    log.exception('append failed')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TERM"} | {"NO_COLOR": "1"}
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    if log_format == "json":
        parsed = [json.loads(line) for line in lines]
        assert [(p["level"], p["logger"], p["message"]) for p in parsed] == [
            ("INFO", "kv_slot_tracker.replication.redis.outbox", "publisher reconnected"),
            ("INFO", "uvicorn.error", "Application startup complete."),
            ("ERROR", "kv_slot_tracker.replication.redis.outbox", "append failed"),
        ]
        assert all(ISO_PATTERN.match(p["time"]) for p in parsed)
        assert "exc_info" not in parsed[0]
        assert parsed[2]["exc_info"].endswith("ZeroDivisionError: division by zero")
        now = time.time()
        stamped = time.mktime(time.strptime(parsed[0]["time"][:19], "%Y-%m-%dT%H:%M:%S"))
        assert abs(stamped - time.timezone - now) < 300  # UTC, not local time
    else:
        first, second, third = lines[:3]
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO: +publisher reconnected$",
                        first), first  # fmt: skip
        assert second.endswith("INFO:     Application startup complete."), second
        assert third.endswith("ERROR:    append failed"), third
        assert lines[-1] == "ZeroDivisionError: division by zero"


def test_log_format_is_a_setting() -> None:
    assert logging_config("info", "json")["formatters"]["default"]["()"].endswith("JsonFormatter")
    out = subprocess.run([PYTHON, "-m", "kv_slot_tracker", "--check-config", "--log-format",
                          "json"], capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert 'log_format = "json"' in out.stdout.splitlines()
    bad = subprocess.run([PYTHON, "-m", "kv_slot_tracker", "--check-config", "--log-format",
                          "xml"], capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert bad.returncode == 2
    assert "log-format: Input should be 'text' or 'json' (got 'xml')" in bad.stderr, bad.stderr
