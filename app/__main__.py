"""Command line: ``python -m app [--host H] [--port P] [--config FILE] [--log-level L]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import uvicorn
from pydantic import ValidationError

from app import __version__
from app.gc_tuning import tune_gc
from app.http.connection import ConnectionLimits, limited_protocol
from app.http.direct import direct_protocol
from app.main import create_app
from app.settings import ConfigFileError, describe_config_error, load_settings, unknown_environment


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app",
        description="kv-slot-tracker HTTP service. Flags override SLOT_TRACKER_* environment "
        "variables, which override the config file, which overrides config/default.toml.",
    )
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port to listen on (default 8091)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with settings")
    parser.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="server log level (default info)",
    )
    parser.add_argument("--version", action="version", version=f"kv-slot-tracker {__version__}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings(
            args.config, host=args.host, port=args.port, log_level=args.log_level
        )
    except (OSError, ConfigFileError, ValidationError) as exc:
        print(f"invalid configuration:\n{describe_config_error(exc)}", file=sys.stderr)
        return 2
    for warning in unknown_environment():
        print(f"warning: {warning}", file=sys.stderr)

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
        access_log=False,
        limit_concurrency=settings.http_max_connections,
        timeout_keep_alive=settings.http_keep_alive_seconds,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
