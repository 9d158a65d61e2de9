"""Run Dynamo's standalone slot tracker (the reference) next to kv-slot-tracker.

The reference is ``python -m dynamo.slot_tracker`` from the PyPI package ``ai-dynamo-runtime``
(pinned to the version the SPEC was observed on). It lives in its own virtualenv **outside** the
repository and is never a dependency of the project or its tests: nothing here imports it, it is
only started as a separate process.

Used by ``bench/conformance.py`` and the benchmark scripts::

    from bench.reference import start_pair
    with start_pair() as (ref, ours):
        httpx.get(ref.url + "/health"), httpx.get(ours.url + "/health")

Command line::

    python bench/reference.py ensure          # create/install the reference venv if missing
    python bench/reference.py check           # exit 0 if the reference venv is usable
    python bench/reference.py serve           # start both servers, print their URLs, wait

Environment: ``DYNAMO_REF_VENV`` (default ``/opt/dynamo-ref``) is the reference virtualenv,
``DYNAMO_REF_VERSION`` (default ``1.6.1``) the version ``ensure`` installs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = "/opt/dynamo-ref"
DEFAULT_VERSION = "1.6.1"
PACKAGE = "ai-dynamo-runtime"
REF_MODULE = "dynamo.slot_tracker"


class ReferenceUnavailable(RuntimeError):
    """The reference virtualenv is missing and could not be created."""


def ref_venv() -> Path:
    return Path(os.environ.get("DYNAMO_REF_VENV") or DEFAULT_VENV)


def ref_version() -> str:
    return os.environ.get("DYNAMO_REF_VERSION") or DEFAULT_VERSION


def ref_python(venv: Path | None = None) -> Path:
    return (venv or ref_venv()) / "bin" / "python"


def reference_installed(venv: Path | None = None) -> bool:
    """True if the venv's python can import the reference service module."""
    py = ref_python(venv)
    if not py.exists():
        return False
    probe = subprocess.run(
        [str(py), "-c", f"import {REF_MODULE}"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    return probe.returncode == 0


def installed_version(venv: Path | None = None) -> str | None:
    py = ref_python(venv)
    if not py.exists():
        return None
    out = subprocess.run(
        [str(py), "-c", f"import importlib.metadata as m; print(m.version('{PACKAGE}'))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def ensure_reference(
    venv: Path | None = None, version: str | None = None, *, quiet: bool = False
) -> Path:
    """Return the reference venv, creating it and installing the pinned package if missing.

    Raises ``ReferenceUnavailable`` with pip's output when the install fails.
    """
    venv = venv or ref_venv()
    version = version or ref_version()
    if reference_installed(venv):
        return venv
    if venv.resolve().is_relative_to(REPO):
        raise ReferenceUnavailable(f"refusing to create the reference venv inside the repo: {venv}")
    log = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    if not ref_python(venv).exists():
        log(f"creating reference venv {venv}")
        made = subprocess.run(
            [sys.executable, "-m", "venv", str(venv)],
            capture_output=True,
            text=True,
            check=False,
        )
        if made.returncode != 0:
            raise ReferenceUnavailable(f"python -m venv {venv} failed:\n{made.stderr}")
    log(f"installing {PACKAGE}=={version} into {venv}")
    pip = subprocess.run(
        [str(ref_python(venv)), "-m", "pip", "install", "--quiet", f"{PACKAGE}=={version}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if pip.returncode != 0 or not reference_installed(venv):
        raise ReferenceUnavailable(
            f"pip install {PACKAGE}=={version} failed (exit {pip.returncode}):\n"
            f"{pip.stdout}\n{pip.stderr}"
        )
    return venv


def free_port() -> int:
    """A TCP port that was free on loopback a moment ago (the caller retries on a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_in_use(port: int) -> bool:
    """True if something already listens on PORT (on loopback or on the wildcard address)."""
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return True
    return False


class Server:
    """One HTTP server process on a loopback port; ``url`` is ``http://127.0.0.1:PORT``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        port: int,
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.port = port
        self.cwd = cwd
        self.env = env
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"{name}-log-"))
        self.log_path = self.log_dir / f"{name}-{port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> Server:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started")
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed in stop()
        self._log = log
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Poll ``GET /health`` until it answers 200; raise if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode if self.proc else None} "
                    f"before becoming healthy; log tail:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not healthy after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            # The child runs in its own session (start_new_session): signal its group by id.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
            self._log = None

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _start_checked(make, attempts: int = 3, timeout: float = 30.0) -> Server:
    """Start a server on a fresh free port, retrying if the port was taken in between."""
    last: Exception | None = None
    for _ in range(attempts):
        port = free_port()
        if _port_in_use(port):
            continue
        server = make(port).start()
        try:
            server.wait_healthy(timeout)
            return server
        except Exception as e:  # port race or slow start: try another port
            last = e
            server.stop()
    raise RuntimeError(f"could not start server: {last}")


def start_reference(
    *,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    module: str = REF_MODULE,
) -> Server:
    """Start ``python -m dynamo.slot_tracker --port P`` (or another ``module`` of the package,
    e.g. ``dynamo.select_service``) from the reference venv (installing it if missing) and wait
    until it is healthy. It binds 0.0.0.0:P; only 127.0.0.1 is used."""
    venv = ensure_reference()
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("RUST_LOG", "warn")

    def make(port: int) -> Server:
        return Server(
            "reference",
            [str(ref_python(venv)), "-m", module, "--port", str(port), *extra_args],
            port,
            env=child_env,
            cwd=Path(tempfile.gettempdir()),
            log_dir=log_dir,
        )

    return _start_checked(make)


def ours_python() -> str:
    venv_py = REPO / ".venv" / "bin" / "python"
    return str(venv_py) if venv_py.exists() else sys.executable


def start_ours(
    *,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    log_level: str = "warning",
) -> Server:
    """Start kv-slot-tracker (``python -m kv_slot_tracker --port P``) in embedded mode with no API key."""
    child_env = dict(os.environ if env is None else env)
    # Standalone, open, single instance: the reference has neither Redis nor an API key.
    child_env["SLOT_TRACKER_REDIS_URL"] = ""
    child_env["SLOT_TRACKER_API_KEY"] = ""
    child_env["SLOT_TRACKER_HOST"] = "127.0.0.1"

    def make(port: int) -> Server:
        return Server(
            "ours",
            [
                ours_python(),
                "-m",
                "kv_slot_tracker",
                "--port",
                str(port),
                "--log-level",
                log_level,
                *extra_args,
            ],
            port,
            cwd=REPO,
            env=child_env,
            log_dir=log_dir,
        )

    return _start_checked(make)


@contextlib.contextmanager
def start_pair(
    *, ref_args: Sequence[str] = (), ours_args: Sequence[str] = (), log_dir: Path | None = None
) -> Iterator[tuple[Server, Server]]:
    """Start the reference and kv-slot-tracker; stop both on exit."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="slot-tracker-pair-"))
    ref = start_reference(extra_args=ref_args, log_dir=log_dir)
    try:
        ours = start_ours(extra_args=ours_args, log_dir=log_dir)
    except BaseException:
        ref.stop()
        raise
    try:
        yield ref, ours
    finally:
        ours.stop()
        ref.stop()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["ensure", "check", "serve"])
    args = ap.parse_args(argv)
    if args.command == "check":
        ok = reference_installed()
        print(f"{ref_venv()}: {'ok ' + str(installed_version()) if ok else 'missing'}")
        return 0 if ok else 1
    if args.command == "ensure":
        try:
            venv = ensure_reference()
        except ReferenceUnavailable as e:
            print(e, file=sys.stderr)
            return 1
        print(f"{venv}: {PACKAGE} {installed_version(venv)}")
        return 0
    with start_pair() as (ref, ours):
        print(f"reference {ref.url} (pid {ref.pid}, log {ref.log_path})")
        print(f"ours      {ours.url} (pid {ours.pid}, log {ours.log_path})")
        print("Ctrl-C stops both.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while ref.alive() and ours.alive():
                time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
