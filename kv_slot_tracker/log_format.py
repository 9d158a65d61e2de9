"""How the service's log lines look (``log_format``): each carries its time in ISO 8601 UTC with
milliseconds (``2026-12-04T21:44:01.123Z``), the form Redis and its Sentinels' lines can be
lined up with during a failover.

* ``text`` (default): ``<time> <LEVEL>:     <message>``, uvicorn's own layout with the time in
  front (coloured on a terminal), the traceback below an exception's line;
* ``json``: one JSON object a line, with the fields a log pipeline expects: ``time``, ``level``,
  ``logger``, ``message``, and ``exc_info`` (the formatted traceback) when there is one.

``logging_config`` gives uvicorn's logging configuration (``logging.config.dictConfig``) with
these formatters; ``supervisor_handler`` the handler of a ``--workers`` supervisor's own lines.
The access log (``access_log``) is JSON lines of its own either way and keeps its layout.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from typing import Any, Literal

import orjson
import uvicorn.config
from uvicorn.logging import TRACE_LOG_LEVEL, DefaultFormatter

LogFormat = Literal["text", "json"]
TEXT_LAYOUT = "%(asctime)s %(levelprefix)s %(message)s"


def utc_time(record: logging.LogRecord) -> str:
    """When ``record`` was made, in ISO 8601 UTC with milliseconds."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


class TextFormatter(DefaultFormatter):
    """uvicorn's default formatter (``%(levelprefix)s``, colours on a terminal), UTC times."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return utc_time(record)


class PlainTextFormatter(logging.Formatter):
    """The text layout where no uvicorn field is available (the supervisor's own lines)."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return utc_time(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, exc_info (when set)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": utc_time(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return orjson.dumps(out, default=str).decode()


def logging_config(level: str, log_format: LogFormat = "text") -> dict[str, Any]:
    """uvicorn's logging, with the service's own loggers (``kv_slot_tracker.*``) printed the
    same way at ``level`` (without it their INFO lines, the start-up summary and replication,
    went nowhere), every line in ``log_format``."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    if log_format == "json":
        config["formatters"]["default"] = {"()": f"{__name__}.JsonFormatter"}
        config["formatters"]["access"] = {"()": f"{__name__}.JsonFormatter"}
    else:
        config["formatters"]["default"] = {"()": f"{__name__}.TextFormatter",
                                           "fmt": TEXT_LAYOUT, "use_colors": None}  # fmt: skip
    config["loggers"]["kv_slot_tracker"] = {
        "handlers": ["default"],
        "level": TRACE_LOG_LEVEL if level == "trace" else level.upper(),
        "propagate": False,
    }
    return config


def supervisor_handler(log_format: LogFormat) -> logging.Handler:
    """A ``--workers`` supervisor's own lines on standard error, in ``log_format``."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(PlainTextFormatter("%(asctime)s %(levelname)s:     supervisor: "
                                                "%(message)s"))  # fmt: skip
    return handler
