"""Command line: ``python -m app [--config FILE] [--SETTING VALUE ...] [--check-config]``
(``app.cli`` lists the flags)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import uvicorn
import uvicorn.config
from pydantic import ValidationError
from uvicorn.logging import TRACE_LOG_LEVEL

from app import cli
from app.gc_tuning import tune_gc
from app.http.connection import ConnectionLimits, limited_protocol
from app.http.direct import direct_protocol
from app.main import create_app
from app.settings import ConfigFileError, describe_config_error, load_settings, unknown_environment


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, with the service's own loggers (``app.*``) printed the same way at
    ``level``: without it their INFO lines (the start-up summary, replication) went nowhere."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["app"] = {
        "handlers": ["default"],
        "level": TRACE_LOG_LEVEL if level == "trace" else level.upper(),
        "propagate": False,
    }
    return config


def main(argv: Sequence[str] | None = None) -> int:
    args = cli.parse_args(argv)
    try:
        settings = load_settings(args.config, **cli.overrides(args))
    except (OSError, ConfigFileError, ValidationError) as exc:
        print(f"invalid configuration:\n{describe_config_error(exc)}", file=sys.stderr)
        return 2
    warnings = unknown_environment()
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.check_config:
        print(cli.describe(settings))
        return 0

    app = create_app(settings)
    tune_gc()
    limits = ConnectionLimits(
        settings.http_max_header_bytes,
        settings.http_header_timeout_seconds,
        settings.http_body_timeout_seconds,
    )
    if settings.http_direct and app.lean:
        protocol = direct_protocol(app.lean, limits)
    else:
        protocol = limited_protocol(limits)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=protocol,
        log_level=settings.log_level,
        log_config=log_config(settings.log_level),
        access_log=False,
        limit_concurrency=settings.http_max_connections,
        timeout_keep_alive=settings.http_keep_alive_seconds,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
