"""Several server processes on one port, answering as one instance (``workers`` > 1).

One Python process serves from one core. With ``workers = N`` the command line becomes a
supervisor that:

1. binds the listening socket once (host, port, backlog) and hands it to every process, which
   accepts from it (a shared listening socket: the kernel queues connections once, and a
   connection waiting in the queue of a process that died is taken by a sibling);
2. when no Redis is configured (no ``redis_url``, no Sentinel), runs the hub of
   ``kv_slot_tracker.replication.local`` on a thread of its own, on a Unix socket in a
   temporary directory; otherwise the processes use the configured Redis (one server, Sentinel
   or Cluster);
3. starts N processes (``python -m kv_slot_tracker`` with the listening socket's descriptor),
   each one an instance of replication (through the hub, or the Redis stream): the same
   records, read barrier, tombstones and durable acknowledgements as separate instances, so a
   client gets the same guarantees whatever process answers
   (``kv_slot_tracker.service.consistency``);
4. restarts a process that ends (crash, kill -9) with the same instance id and a new
   incarnation: it loads the shared state from a sibling (through the hub, or the snapshot and
   the stream), and only accepts connections once it is ready
   (``create_app(wait_ready_s=...)``);
5. on SIGTERM or SIGINT stops the processes (each flushes its outbox), then the hub.

Why replication and not something new: every guarantee of several instances (read-your-writes,
tombstones, durable acknowledgements, recovery of a restarted process) is already built and
tested on it; the hub only replaces the Redis stream on one host. A private ``redis-server`` in
its place (``workers_transport = "redis"``, removed) cost 1.3-2.2 x the CPU per write and
2-4 x the visibility lag (``bench/RESULTS.md``). The processes of one host are N
instances of the stream when Redis is shared by several hosts (N x M).

The supervisor builds no app and serves nothing: a fault of the service cannot take it down.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kv_slot_tracker.replication.local.hub import HubThread
from kv_slot_tracker.replication.records import random_id

log = logging.getLogger("kv_slot_tracker.supervisor")

ENV_PREFIX = "SLOT_TRACKER_"
BACKLOG = 2048
POLL_S = 0.05
STOP_TIMEOUT_S = 15.0
RESTART_DELAY_S = 0.1  # doubled while a process keeps dying young, up to RESTART_DELAY_MAX_S
RESTART_DELAY_MAX_S = 5.0
YOUNG_S = 5.0  # a process that ends sooner than this after its start counts as dying young
CONTROL_SOCKET_PREFIX = "process-"


# -- the processes -------------------------------------------------------------------------


def control_sockets(run_dir: Path) -> dict[int, str]:
    """The Unix sockets of the processes of the supervisor whose run directory is ``run_dir``,
    by process index (a process being restarted may have none for a moment)."""
    found = {}
    for path in run_dir.glob(f"{CONTROL_SOCKET_PREFIX}*.sock"):
        with contextlib.suppress(ValueError):
            found[int(path.stem.removeprefix(CONTROL_SOCKET_PREFIX))] = str(path)
    return found


def control_socket_index(path: str | Path) -> int:
    """The process index in the name of a control socket."""
    return int(Path(path).stem.removeprefix(CONTROL_SOCKET_PREFIX))


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL when the supervisor dies, whatever killed it."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _popen(
    command: list[str], env: dict[str, str], pass_fds: Sequence[int] = ()
) -> subprocess.Popen[bytes]:
    # A session of its own: a signal to the supervisor's process group (Ctrl-C, ``timeout``)
    # reaches the supervisor alone, which stops the processes first and its hub last.
    return subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )


@dataclass
class ProcessSlot:
    """One server process slot: its index, fixed instance id, and the process in it now."""

    index: int
    instance_id: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    delay_s: float = RESTART_DELAY_S
    due_at: float = 0.0  # when a dead process is to be started again


@dataclass
class Supervisor:
    """Binds the socket, starts and restarts the processes; ``run`` returns the exit code.

    ``child_args``: the command-line arguments every process gets besides its own (the
    supervisor's flags); ``env``: the environment they start from.
    """

    host: str
    port: int
    count: int
    instance_id: int
    hub: bool = False  # no Redis configured: run the hub
    hub_snapshot_s: float = 30.0  # how often the hub takes a process's state for itself
    child_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    slots: list[ProcessSlot] = field(default_factory=list)
    sock: socket.socket | None = None
    run_dir: Path | None = None  # the hub's socket and the processes' own sockets
    hub_thread: HubThread | None = None
    _stopping: bool = False

    def bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(BACKLOG)
        sock.set_inheritable(True)
        self.sock = sock
        return sock

    def start(self) -> None:
        """Bind, start the hub if needed, start every process."""
        if self.sock is None:
            self.bind()
        self.run_dir = Path(tempfile.mkdtemp(prefix="kv-slot-tracker-"))
        if self.hub:
            self.hub_thread = HubThread(
                self.run_dir / "hub.sock", snapshot_every_s=self.hub_snapshot_s
            )
            self.hub_thread.start()
        for i in range(self.count):
            ident = self.instance_id + i if self.instance_id else random_id()
            self.slots.append(ProcessSlot(i, ident))
        for slot in self.slots:
            self._spawn(slot)

    def _command(self, slot: ProcessSlot) -> list[str]:
        assert self.sock is not None
        # the supervisor's own flags first, then this process's values: a later flag wins, so
        # a --instance-id or --workers given to the supervisor cannot override them
        own = ["--workers", "1", "--instance-id", str(slot.instance_id)]
        if self.hub_thread is not None:
            own += ["--hub-socket", str(self.hub_thread.path)]
        return [sys.executable, "-m", "kv_slot_tracker", *self.child_args, *own,
                "--listen-fd", str(self.sock.fileno()),
                "--control-socket", str(self.control_socket(slot.index))]  # fmt: skip

    def control_socket(self, index: int) -> Path:
        """The Unix socket where process ``index`` also serves, alone: how its siblings (and
        an operator) reach one process in particular."""
        assert self.run_dir is not None
        return self.run_dir / f"{CONTROL_SOCKET_PREFIX}{index}.sock"

    def _child_env(self, slot: ProcessSlot) -> dict[str, str]:
        env = dict(self.env)
        env[ENV_PREFIX + "WORKERS"] = "1"
        env[ENV_PREFIX + "INSTANCE_ID"] = str(slot.instance_id)
        return env

    def _spawn(self, slot: ProcessSlot) -> None:
        assert self.sock is not None
        slot.proc = _popen(self._command(slot), self._child_env(slot), [self.sock.fileno()])
        slot.started_at = time.monotonic()
        log.info("process %d started (pid %d)", slot.index, slot.proc.pid)

    def check(self) -> None:
        """One turn of supervision: restart dead processes when due."""
        now = time.monotonic()
        if self.hub_thread is not None and not self.hub_thread.alive():
            # the processes hold the state and a new hub would hand an empty one to the next
            # that joins: stop, and let whatever runs the supervisor start it again
            raise RuntimeError("the hub ended")
        for slot in self.slots:
            proc = slot.proc
            if proc is not None and proc.poll() is not None:
                lived = now - slot.started_at
                if lived < YOUNG_S:  # dying young again and again: wait longer each time
                    slot.due_at = now + slot.delay_s
                    slot.delay_s = min(slot.delay_s * 2, RESTART_DELAY_MAX_S)
                else:
                    slot.due_at = now
                    slot.delay_s = RESTART_DELAY_S
                log.error("process %d (pid %d) ended with %s after %.1f s; restarting",
                          slot.index, proc.pid, proc.returncode, lived)  # fmt: skip
                slot.proc = None
            if slot.proc is None and now >= slot.due_at:
                slot.restarts += 1
                self._spawn(slot)

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    def stop(self) -> None:
        """SIGTERM every process (each flushes its outbox), wait, then stop the hub."""
        procs = [s.proc for s in self.slots if s.proc is not None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.sock is not None:
            self.sock.close()
        if self.hub_thread is not None:
            self.hub_thread.stop()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def run(self, sleep: Callable[[float], None] = time.sleep) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.request_stop)
        try:
            self.start()
            log.info("%d server processes on %s:%d", self.count, self.host, self.port)
            while not self._stopping:
                self.check()
                sleep(POLL_S)
        finally:
            self.stop()
        return 0
