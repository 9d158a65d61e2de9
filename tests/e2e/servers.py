"""Real service processes for end-to-end tests (and ``bench/recovery_bench.py``).

``ServerProcess`` runs ``python -m kv_slot_tracker --port P`` with its settings in ``SLOT_TRACKER_*``
variables and its output in a log file; ``Fleet`` starts several of them on one Redis namespace,
restarts them on the same port and kills whatever is left at the end. Nothing here knows about
pytest, so the benchmark can use it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from kv_slot_tracker_client import SlotTrackerClient, TransportError

from tests.ports import free_port
from tests.replication.helpers import TcpProxy
from tests.servers import suite_mode

REPO = Path(__file__).resolve().parents[2]
_VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PYTHON = str(_VENV_PYTHON) if _VENV_PYTHON.exists() else sys.executable
ENV_PREFIX = "SLOT_TRACKER_"

T = TypeVar("T")

# Run as ``python -c _ORPHAN_GUARD python -m kv_slot_tracker ...``: asks Linux to SIGKILL the process when
# the process that started it dies (pytest killed hard, a bench interrupted), then becomes the
# service. The setting survives exec. Elsewhere it only execs.
_ORPHAN_GUARD = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass
os.execv(sys.argv[1], sys.argv[1:])
"""


def wait_until(
    probe: Callable[[], T | None],
    timeout: float,
    what: str,
    interval: float = 0.01,
    describe: Callable[[], str] | None = None,
) -> T:
    """Call ``probe`` until it returns a true value (not None, False, 0 or empty); return it.

    Fails after ``timeout`` seconds with ``what`` and, if given, ``describe()`` (the state that
    explains why the condition did not hold).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{describe()}" if describe is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{detail}")
        time.sleep(interval)


class ServerProcess:
    """One ``python -m kv_slot_tracker`` process; can be killed and started again on the same port."""

    def __init__(
        self,
        name: str,
        port: int,
        env: dict[str, str],
        log_path: Path,
        die_with_parent: bool = True,
    ) -> None:
        self.name = name
        self.die_with_parent = die_with_parent
        self.port = port
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # time.monotonic() of the last start
        self.client = SlotTrackerClient(self.url, timeout=10.0)
        # a separate client for /ready probes, whose pooled connection a test never shares
        self._probe = httpx.Client(base_url=self.url, timeout=2.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.alive:
            raise RuntimeError(f"{self.name} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"==== {self.name}: starting on port {self.port}\n".encode())
            log.flush()
            self.started_at = time.monotonic()
            command = [PYTHON, "-m", "kv_slot_tracker", "--port", str(self.port)]
            if self.die_with_parent and sys.platform == "linux":
                command = [PYTHON, "-c", _ORPHAN_GUARD, *command]
            self.proc = subprocess.Popen(
                command,
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # connections kept alive to an earlier process of this port are dead now
        self.client.close()
        self._probe.close()
        self.client = SlotTrackerClient(self.url, timeout=10.0)
        self._probe = httpx.Client(base_url=self.url, timeout=2.0)

    def readiness(self) -> int | None:
        """HTTP status of ``GET /ready`` (200 or 503), None when nothing answers yet."""
        try:
            return self._probe.get("/ready").status_code
        except httpx.TransportError:
            return None

    def wait_ready(self, timeout: float = 30.0) -> float:
        """Wait for ``/ready`` to answer 200; returns seconds since the process was started."""

        def probe() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready\n"
                    f"{self.log_tail()}"
                )
            return self.readiness() == 200

        wait_until(probe, timeout, f"{self.name} to be ready", 0.005, self.log_tail)
        return time.monotonic() - self.started_at

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process (and only to it) and wait for it to end."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with self.log_path.open("ab") as log:
            log.write(f"==== {self.name}: ended with {self.proc.returncode}\n".encode())
        self.proc = None

    def close(self) -> None:
        self.kill()
        self.client.close()
        self._probe.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"---- {self.name}: no log"
        tail = text.splitlines()[-lines:]
        return f"---- {self.name} ({self.url}, log {self.log_path}):\n" + "\n".join(tail)

    def status(self) -> dict[str, Any]:
        """``GET /replication`` as a dict; ``{"error": ...}`` when it does not answer."""
        try:
            return self.client.replication_status().model_dump()
        except TransportError as e:
            return {"error": str(e)}


class Fleet:
    """Instances of one namespace on one Redis, started as separate processes.

    ``spawn`` starts them (in parallel: all are launched before any is waited for), ``restart``
    brings one back on its port, ``close`` kills everything still running.
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        log_dir: Path,
        *,
        snapshot_interval_seconds: int = 2,
        env: dict[str, str] | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.redis_url = redis_url
        self.die_with_parent = die_with_parent
        self.namespace = namespace
        self.log_dir = log_dir
        self.servers: list[ServerProcess] = []
        self.settings = {
            "REDIS_URL": redis_url,
            "NAMESPACE": namespace,
            "REPLICATION_BATCH_MS": "0",
            "SNAPSHOT_INTERVAL_SECONDS": str(snapshot_interval_seconds),
            "LOG_LEVEL": "info",
        }
        self.settings.update(env or {})

    def _env(self, overrides: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env.update(suite_mode())
        env["PYTHONUNBUFFERED"] = "1"
        for key, value in {**self.settings, **overrides}.items():
            env[ENV_PREFIX + key] = value
        return env

    def spawn(self, count: int = 1, *, wait: bool = True, **overrides: str) -> list[ServerProcess]:
        """Start ``count`` more instances; with ``wait``, return once all are ready."""
        new = []
        for _ in range(count):
            i = len(self.servers)
            name = f"{self.namespace[-6:]}-{chr(ord('a') + i)}"
            env = self._env({"INSTANCE_ID": str(1000 + i), **overrides})
            log = self.log_dir / f"{name}.log"
            server = ServerProcess(name, free_port(), env, log, self.die_with_parent)
            self.servers.append(server)
            server.start()
            new.append(server)
        if wait:
            for server in new:
                self._wait_ready_or_retry(server)
        return new

    def _wait_ready_or_retry(self, server: ServerProcess) -> None:
        """Wait for ``server``; if another process took its free port meanwhile, move it."""
        for _ in range(3):
            try:
                server.wait_ready()
                return
            except AssertionError:
                if server.alive or "address already in use" not in server.log_tail().lower():
                    raise
            server.kill()
            server.port = free_port()
            server.start()
        server.wait_ready()

    def restart(self, server: ServerProcess, *, wait: bool = True, **overrides: str) -> None:
        """Start ``server`` again on its port (it must have been killed); ``overrides`` change
        its settings for this and later starts."""
        for key, value in overrides.items():
            server.env[ENV_PREFIX + key] = value
        server.start()
        if wait:
            server.wait_ready()

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def log_tails(self, lines: int = 40) -> str:
        return "\n".join(s.log_tail(lines) for s in self.servers)

    def statuses(self) -> str:
        return "\n".join(f"{s.name}: {s.status()}" for s in self.servers if s.alive)


class ProxyThread:
    """``tests.replication.helpers.TcpProxy`` on its own event loop thread, for synchronous
    tests: a Redis URL that can be cut off and restored while processes use it."""

    def __init__(self, target_port: int) -> None:
        self.proxy = TcpProxy(target_port)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._call(self.proxy.start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    async def _run(self, fn: Callable[[], None]) -> None:
        fn()

    @property
    def url(self) -> str:
        return self.proxy.url()

    def cut(self) -> None:
        self._call(self._run(self.proxy.cut))

    def restore(self) -> None:
        self._call(self._run(self.proxy.restore))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self.proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()
