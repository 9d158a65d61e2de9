"""Command line: ``python -m kv_slot_tracker [--config FILE] [--SETTING VALUE ...] [--check-config]``
(``kv_slot_tracker.cli`` lists the flags).

With one worker (the default) this process serves. With more it supervises that many server
processes on the port (``kv_slot_tracker.supervisor``), each started as ``python -m kv_slot_tracker ... --listen-fd FD``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
import uvicorn.config

from kv_slot_tracker import cli
from kv_slot_tracker.config_sources import ConfigError
from kv_slot_tracker.cores import process_count
from kv_slot_tracker.gc_tuning import tune_gc
from kv_slot_tracker.http.connection import ConnectionLimits, limited_protocol
from kv_slot_tracker.http.fast_protocol import direct_protocol
from kv_slot_tracker.http.process_group import ProcessGroupViews
from kv_slot_tracker.http.selection import port as selection_port
from kv_slot_tracker.log_format import LogFormat, logging_config, supervisor_handler
from kv_slot_tracker.main import create_app
from kv_slot_tracker.observability.http import ACCESS_LOGGER
from kv_slot_tracker.settings import Settings, unknown_environment
from kv_slot_tracker.supervisor import Supervisor, control_socket_index, control_sockets

# A process started by the supervisor waits this long for the shared state before it accepts
# connections (then it serves, answering 503 "not ready" until caught up).
PROCESS_READY_WAIT_S = 30.0


def log_config(level: str, log_format: LogFormat = "text") -> dict[str, Any]:
    """uvicorn's logging with the service's loggers, UTC times, in ``log_format``
    (``kv_slot_tracker.log_format``), and the access log."""
    config = logging_config(level, log_format)
    # the access log (``access_log``): bare JSON lines on standard output
    config["formatters"]["json_lines"] = {"format": "%(message)s"}
    config["handlers"]["json_lines"] = {
        "formatter": "json_lines",
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stdout",
    }
    config["loggers"][ACCESS_LOGGER] = {
        "handlers": ["json_lines"],
        "level": "INFO",
        "propagate": False,
    }
    return config


def main(argv: Sequence[str] | None = None) -> int:
    try:  # the one validation, the same for --check-config and for start-up
        args, settings = cli.load_argv(argv)
    except ConfigError as exc:
        print(f"invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    warnings = unknown_environment()
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.check_config:
        print(cli.describe(settings))
        return 0

    if args.listen_fd is not None:
        return serve_process(settings, args.listen_fd, args.control_socket, args.hub_socket)
    count = process_count(settings.workers)
    if problem := selection_port.check(settings, count):
        print(f"invalid configuration:\n{problem}", file=sys.stderr)
        return 2
    if count > 1:
        return supervise(settings, count, list(sys.argv[1:] if argv is None else argv))

    app = create_app(settings)
    tune_gc()
    if settings.selection_port:  # the selection API at the root of its own port too
        sockets = selection_port.bind(settings, app)
        selection_port.serve(app, server_options(settings, app), sockets, settings.selection_port)
        return 0
    uvicorn.run(app, host=settings.host, port=settings.port, **server_options(settings, app))
    return 0


def server_options(settings: Settings, app: Any) -> dict[str, Any]:
    """uvicorn's options, the same for a single process and a ``--workers`` child."""
    return {
        "loop": "uvloop",
        "http": http_protocol(settings, app),
        "log_level": settings.log_level,
        "log_config": log_config(settings.log_level, settings.log_format),
        "access_log": False,  # the service's own (``access_log``) covers the direct path too
        "limit_concurrency": settings.http_max_connections,
        "timeout_keep_alive": settings.http_keep_alive_seconds,
    }


def http_protocol(settings: Settings, app: Any) -> type:
    """uvicorn's connection protocol with the connection limits, serving the hot routes
    directly unless ``http_direct`` is off."""
    limits = ConnectionLimits(
        settings.http_max_header_bytes,
        settings.http_header_timeout_seconds,
        settings.http_body_timeout_seconds,
        max_body_bytes=settings.max_body_bytes,
        min_bytes_per_second=settings.http_min_request_bytes_per_second,
        rate_grace=settings.http_request_rate_grace_seconds,
        min_bytes_per_read=settings.http_min_bytes_per_read,
        max_connections=settings.http_max_connections,
        max_per_client=settings.http_max_connections_per_client,
    )
    if settings.http_direct and app.lean:
        return direct_protocol(app.lean, limits)
    return limited_protocol(limits)


def supervise(settings: Settings, count: int, argv: list[str]) -> int:
    """``workers`` > 1: bind the port and run ``count`` server processes on it, each given the
    supervisor's own flags (``argv``)."""
    logging.basicConfig(
        level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
        handlers=[supervisor_handler(settings.log_format)],
    )
    supervisor = Supervisor(
        host=settings.host,
        port=settings.port,
        count=count,
        hub=settings.embedded,  # no Redis configured: the processes share the supervisor's hub
        hub_snapshot_s=settings.snapshot_interval_seconds,
        instance_id=settings.instance_id,
        child_args=argv,
    )
    try:
        return supervisor.run()
    except (OSError, RuntimeError) as exc:
        print(f"cannot start the server processes: {exc}", file=sys.stderr)
        return 1


def serve_process(
    settings: Settings, fd: int, control_socket: str | None, hub_socket: str | None = None
) -> int:
    """One of the supervisor's processes: serve on the listening socket ``fd`` it inherited
    and on its own ``control_socket``, once the shared state is loaded (from the supervisor's
    hub at ``hub_socket`` when given, else through Redis)."""
    sockets = [socket.socket(fileno=fd)]
    if control_socket:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(control_socket)  # left by this process's previous life
        own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        own.bind(control_socket)
        own.listen(64)
        sockets.append(own)
    app = create_app(settings, wait_ready_s=PROCESS_READY_WAIT_S, hub_socket=hub_socket)
    if control_socket:  # /metrics and /replication of every process, from any of them
        run_dir = Path(control_socket).parent
        app.add_middleware(
            ProcessGroupViews,
            index=control_socket_index(control_socket),
            siblings=lambda: control_sockets(run_dir),
        )
    tune_gc()
    config = uvicorn.Config(app, **server_options(settings, app))
    uvicorn.Server(config).run(sockets=sockets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
