"""Command line: ``python -m app [--host H] [--port P] [--workers N] [--config FILE]
[--log-level L]``.

With one worker (the default) this process serves. With more it supervises that many server
processes on the port (``app.workers``), each started as ``python -m app --listen-fd FD``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import ValidationError

from app import __version__
from app.core.types import U64_MAX
from app.gc_tuning import tune_gc
from app.http.connection import ConnectionLimits, limited_protocol
from app.http.direct import direct_protocol
from app.http.workers import WorkerGroupViews
from app.main import create_app
from app.settings import (
    ConfigFileError,
    Settings,
    describe_config_error,
    load_settings,
    unknown_environment,
)
from app.workers import Supervisor, control_socket_index, control_sockets, worker_count

# A process started by the supervisor waits this long for the shared state before it accepts
# connections (then it serves, answering 503 "not ready" until caught up).
WORKER_READY_WAIT_S = 30.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app",
        description="kv-slot-tracker HTTP service. Flags override SLOT_TRACKER_* environment "
        "variables, which override the config file, which overrides config/default.toml.",
    )
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port to listen on (default 8091)")
    parser.add_argument(
        "--workers",
        help="server processes on the port, sharing one state: a number or auto (default 1)",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with settings")
    parser.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="server log level (default info)",
    )
    parser.add_argument("--version", action="version", version=f"kv-slot-tracker {__version__}")
    # set by the supervisor for the processes it starts: the listening socket to accept from
    parser.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    # ... and a Unix socket where this process alone serves too (its siblings reach it there)
    parser.add_argument("--control-socket", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings(
            args.config,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            workers=args.workers,
        )
    except (OSError, ConfigFileError, ValidationError) as exc:
        print(f"invalid configuration:\n{describe_config_error(exc)}", file=sys.stderr)
        return 2
    for warning in unknown_environment():
        print(f"warning: {warning}", file=sys.stderr)

    if args.listen_fd is not None:
        return serve_worker(settings, args.listen_fd, args.control_socket)
    count = worker_count(settings.workers)
    if count > 1:
        return supervise(settings, count, args)

    app = create_app(settings)
    tune_gc()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=http_protocol(settings, app),
        log_level=settings.log_level,
        access_log=False,
        limit_concurrency=settings.http_max_connections,
        timeout_keep_alive=settings.http_keep_alive_seconds,
    )
    return 0


def http_protocol(settings: Settings, app: Any) -> type:
    """uvicorn's connection protocol with the connection limits, serving the hot routes
    directly unless ``http_direct`` is off."""
    limits = ConnectionLimits(
        settings.http_max_header_bytes,
        settings.http_header_timeout_seconds,
        settings.http_body_timeout_seconds,
    )
    if settings.http_direct and app.lean:
        return direct_protocol(app.lean, limits)
    return limited_protocol(limits)


def supervise(settings: Settings, count: int, args: argparse.Namespace) -> int:
    """``workers`` > 1: bind the port and run ``count`` server processes on it."""
    logging.basicConfig(
        level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
        format="%(levelname)s:     supervisor: %(message)s",
    )
    if settings.instance_id and settings.instance_id + count - 1 > U64_MAX:
        print(f"invalid configuration: instance_id + {count - 1} workers exceeds a u64",
              file=sys.stderr)  # fmt: skip
        return 2
    child_args = []
    if args.config is not None:
        child_args += ["--config", args.config]
    if args.log_level is not None:
        child_args += ["--log-level", args.log_level]
    supervisor = Supervisor(
        host=settings.host,
        port=settings.port,
        count=count,
        private_redis=settings.embedded,
        instance_id=settings.instance_id,
        child_args=child_args,
    )
    try:
        return supervisor.run()
    except (OSError, RuntimeError) as exc:
        print(f"cannot start the workers: {exc}", file=sys.stderr)
        return 1


def serve_worker(settings: Settings, fd: int, control_socket: str | None) -> int:
    """One of the supervisor's processes: serve on the listening socket ``fd`` it inherited
    and on its own ``control_socket``, once the shared state is loaded."""
    sockets = [socket.socket(fileno=fd)]
    if control_socket:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(control_socket)  # left by this process's previous life
        own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        own.bind(control_socket)
        own.listen(64)
        sockets.append(own)
    app = create_app(settings, wait_ready_s=WORKER_READY_WAIT_S)
    if control_socket:  # /metrics and /replication of every process, from any of them
        run_dir = Path(control_socket).parent
        app.add_middleware(
            WorkerGroupViews,
            index=control_socket_index(control_socket),
            siblings=lambda: control_sockets(run_dir),
        )
    tune_gc()
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http=http_protocol(settings, app),
        log_level=settings.log_level,
        access_log=False,
        limit_concurrency=settings.http_max_connections,
        timeout_keep_alive=settings.http_keep_alive_seconds,
    )
    uvicorn.Server(config).run(sockets=sockets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
