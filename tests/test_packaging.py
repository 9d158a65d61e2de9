"""What ships is what is tested: the sdist, the wheel built from it, a regular install of that
wheel and the container image's recipe, each run outside the checkout.

Every other test imports the package from the editable install in ``.venv``, where files next
to the package (a ``config/`` directory at the top of the checkout, say) are found whether or
not they ship. Here:

* ``python -m build`` makes the sdist and builds the wheel from the unpacked sdist (so a file
  missing from the sdist breaks the wheel); both are checked for what the package reads at run
  time, and the wheel holds every file of the package that git tracks;
* the wheel is installed (not editable) into a fresh virtualenv outside the checkout; from an
  empty directory, with no ``PYTHONPATH``, ``--version``, ``--check-config`` and a round trip
  through the console script run (register a worker, add a request, read the loads, free it,
  the dashboard page and the API docs' assets, stop);
* the Dockerfile's steps are read and reproduced in a virtualenv: its build context (what
  ``COPY`` takes), its ``RUN`` lines, then the virtualenv made read-only and the ``CMD`` run as
  an unprivileged user (``setpriv``, as ``USER`` does), with the ``HEALTHCHECK`` command;
* with a Docker engine (``docker info`` answers) the image itself is built and serves a round
  trip; without one that test is skipped and says so.

The sdist, the wheel and its virtualenv are made once per test run (session fixtures, shared by
pytest-xdist's workers through a lock); installs use pip's cache. Nothing is written into the
checkout: the build runs on a copy of its tracked files.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from kv_slot_tracker import __version__
from tests.test_dockerfile import healthcheck_argv, stages

# pip installs and builds take long on a loaded machine: more than the suite's 120 s default
pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
RUNNING = re.compile(r"Uvicorn running on http://([^:\s]+):(\d+)")
# read at run time from inside the package (importlib.resources)
PACKAGE_DATA = ("kv_slot_tracker/config/default.toml", "kv_slot_tracker/static/dashboard.html")
UNPRIVILEGED = ("nobody", "nogroup")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without this checkout in it: no ``SLOT_TRACKER_*`` settings of the test
    run, no ``PYTHONPATH``, no virtualenv of the tests on the ``PATH``."""
    venv_bin = str(Path(sys.executable).parent)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLOT_TRACKER_", "PYTHON", "VIRTUAL_ENV", "PIP_NO_CACHE"))
    }
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env.update(extra)
    return env


def run(argv: Sequence[str | Path], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kwargs
    )
    assert done.returncode == 0, f"{shlex.join(map(str, argv))}:\n{done.stdout}{done.stderr}"
    return done


# -- the sdist and the wheel, once per test process ------------------------------------------


def once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A directory ``make`` filled once for the whole test run: under pytest-xdist the workers
    share it (the first to take the lock makes it, the others wait and reuse it)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory, above each worker's own
    directory = base / f"packaging-{name}"
    with (base / f"packaging-{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = directory / ".done"
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            make(directory)
            done.touch()
    return directory


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``sdist`` and ``wheel`` built by ``python -m build`` from a copy of the tracked files."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.fail("the packaging tests copy the files git tracks: git and a checkout needed")

    def make(base: Path) -> None:
        source = base / "source"
        tracked = run(["git", "ls-files", "-z"], cwd=ROOT).stdout.split("\0")
        for name in filter(None, tracked):
            if (ROOT / name).is_file():
                (source / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, source / name)
        # --no-isolation: the build backend of the dev install (setuptools), no download
        run([sys.executable, "-m", "build", "--no-isolation", "--outdir", base / "out", source],
            cwd=base)  # fmt: skip

    out = once(tmp_path_factory, "dist", make) / "out"
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.fixture(scope="session")
def installed(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv outside the checkout with the wheel installed as users install it;
    returns its ``bin`` directory."""

    def make(base: Path) -> None:
        # pip is the dev install's, pointed at the new environment (``--python``): a newer pip
        # than the one ``venv`` would bundle, and no copy of it made (half the time of the
        # bundled one's install); the virtualenv itself holds the package and its dependencies
        run([sys.executable, "-m", "venv", "--without-pip", base / "venv"])
        python = base / "venv" / "bin" / "python"
        pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", dist["wheel"]]
        run(pip, env=clean_env(), cwd=base)

    return once(tmp_path_factory, "venv", make) / "venv" / "bin"


def test_the_wheel_ships_what_the_package_reads_and_every_tracked_file(
    dist: dict[str, Path],
) -> None:
    names = set(zipfile.ZipFile(dist["wheel"]).namelist())
    for path in PACKAGE_DATA:
        assert path in names, path
    tracked = {
        name
        for name in run(["git", "ls-files", "kv_slot_tracker"], cwd=ROOT).stdout.splitlines()
        if (ROOT / name).is_file()
    }
    assert tracked <= names, sorted(tracked - names)
    # nothing of the checkout's top level leaks in as a package of its own
    assert {n.split("/")[0] for n in names if "/" in n} == {
        "kv_slot_tracker",
        f"kv_slot_tracker-{__version__}.dist-info",
    }
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(dist["wheel"]).read(entry_points).decode()
    assert "kv-slot-tracker = kv_slot_tracker.__main__:main" in text


def test_the_sdist_holds_what_a_build_needs(dist: dict[str, Path]) -> None:
    """The wheel above was built from this sdist; it also carries the project's metadata."""
    with tarfile.open(dist["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for path in ("pyproject.toml", "README.md", "kv_slot_tracker/__main__.py", *PACKAGE_DATA):
        assert path in names, path
    assert not any(n.startswith(("config/", ".venv/")) for n in names)


def test_the_installed_wheel_runs_from_anywhere(installed: Path, tmp_path: Path) -> None:
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = clean_env()
    version = run([installed / "kv-slot-tracker", "--version"], cwd=empty, env=env)
    assert version.stdout == f"kv-slot-tracker {__version__}\n"
    usage = run([installed / "kv-slot-tracker", "--help"], cwd=empty, env=env)
    assert "kv_slot_tracker/config/default.toml" in usage.stdout
    for argv in ([installed / "kv-slot-tracker"], [installed / "python", "-m", "kv_slot_tracker"]):
        checked = run([*argv, "--check-config", "--port", "9010"], cwd=empty, env=env)
        lines = checked.stdout.splitlines()
        assert lines[:2] == ['host = "127.0.0.1"', "port = 9010"], checked.stdout
        assert 'namespace = "kv-slot-tracker"' in lines
    refused = subprocess.run(
        [installed / "kv-slot-tracker", "--check-config", "--prot", "1"],
        capture_output=True, text=True, cwd=empty, env=env, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr == "invalid configuration:\n--prot: no such flag (did you mean --port?)\n"
    where = run(
        [installed / "python", "-c", "import kv_slot_tracker; print(kv_slot_tracker.__file__)"],
        cwd=empty,
        env=env,
    )
    assert Path(where.stdout.strip()).is_relative_to(installed.parent / "lib")


def test_the_console_script_serves_a_round_trip(installed: Path, tmp_path: Path) -> None:
    with served([installed / "kv-slot-tracker", "--port", "0"], cwd=tmp_path, env=clean_env()) as (
        url,
        _,
    ):
        round_trip(url)


# -- the image's recipe, without a Docker engine ---------------------------------------------


def base_python() -> str:
    """A Python 3.11 that an unprivileged user may run (the image's base has one at
    /usr/local/bin); the tests' own interpreter may live under root's home."""
    for candidate in ("/usr/local/bin/python3.11", "/usr/bin/python3.11", sys.executable):
        if Path(candidate).exists() and as_user_runs(candidate):
            return candidate
    pytest.fail("no Python 3.11 runnable by an unprivileged user", pytrace=False)


def unprivileged_prefix() -> list[str]:
    if os.geteuid() != 0:
        return []  # already unprivileged
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) is needed to run as an unprivileged user", pytrace=False)
    user, group = UNPRIVILEGED
    return [setpriv, f"--reuid={user}", f"--regid={group}", "--clear-groups", "--"]


def as_user_runs(python: str) -> bool:
    done = subprocess.run([*unprivileged_prefix(), python, "-c", "pass"], capture_output=True, timeout=30)  # fmt: skip
    return done.returncode == 0


@pytest.fixture(scope="session")
def image_root() -> Iterator[Path]:
    """A directory every user may enter (pytest's own temporary directories are private)."""
    root = Path(tempfile.mkdtemp(prefix="kv-slot-tracker-image-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(["chmod", "-R", "u+w", str(root)], check=False)
        shutil.rmtree(root, ignore_errors=True)


def test_the_image_recipe_runs_read_only_as_an_unprivileged_user(image_root: Path) -> None:
    """The Dockerfile's steps, reproduced: container paths map into ``image_root``. The one
    departure: pip may use its cache (``--no-cache-dir`` and ``PIP_NO_CACHE_DIR`` dropped)."""
    python = base_python()
    shim = image_root / "base-bin"  # the base image's `python`
    shim.mkdir()
    (shim / "python").symlink_to(python)

    def host(path: str) -> str:
        return re.sub(r"(?<![\w/.])/(opt|src|srv)\b", lambda m: f"{image_root}/{m.group(1)}", path)

    def environment(env: dict[str, str], args: str) -> None:
        for key, value in re.findall(r'(\w+)=("[^"]*"|\S+)', args):
            value = value.strip('"').replace("$PATH", env["PATH"])
            env[key] = host(value)

    builder, final = stages()[0], stages()[-1]
    env = clean_env(PATH=f"{shim}:{clean_env()['PATH']}")
    workdir = image_root
    for name, args in builder[1:]:
        if name == "ENV":
            environment(env, args)
        elif name == "WORKDIR":
            workdir = Path(host(args))
            workdir.mkdir(parents=True, exist_ok=True)
        elif name == "COPY":
            *sources, dest = args.split()
            target = workdir / dest if not dest.startswith("/") else Path(host(dest))
            for source in sources:
                copy_context(ROOT / source, target, into=len(sources) > 1 or dest.endswith("/"))
        elif name == "RUN":
            env.pop("PIP_NO_CACHE_DIR", None)
            command = host(args).replace("--no-cache-dir ", "")
            run(["sh", "-c", command], cwd=workdir, env=env, timeout=600)
        else:
            raise AssertionError(f"a builder step this test does not reproduce: {name} {args}")

    venv = image_root / "opt" / "venv"
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in final  # the same path: no move
    run(["chmod", "-R", "a-w", venv])
    env = clean_env(HOME="/nonexistent")
    workdir = image_root
    command: list[str] = []
    for name, args in final[1:]:
        if name == "ENV":
            environment(env, args)
        elif name == "WORKDIR":
            workdir = Path(host(args))
            workdir.mkdir(parents=True, exist_ok=True)
        elif name == "CMD":
            command = json.loads(args)
        elif name not in ("RUN", "COPY", "USER", "EXPOSE", "HEALTHCHECK"):
            raise AssertionError(f"a final step this test does not reproduce: {name} {args}")
    assert env["PATH"].startswith(f"{venv}/bin:"), env["PATH"]
    as_user = unprivileged_prefix()

    # what the image runs is the installed package, not a copy of the sources
    where = run([*as_user, f"{venv}/bin/python", "-c", "import kv_slot_tracker as k; print(k.__file__)"],
                cwd=workdir, env=env)  # fmt: skip
    assert where.stdout.strip().startswith(f"{venv}/lib/"), where.stdout
    assert not list(workdir.iterdir()), "the working directory holds nothing of the checkout"
    checked = run([*as_user, *command, "--check-config"], cwd=workdir, env=env)
    assert 'host = "0.0.0.0"' in checked.stdout

    with served([*as_user, *command], cwd=workdir, env={**env, "SLOT_TRACKER_PORT": "0"}) as (
        url,
        port,
    ):
        round_trip(url)
        probe = healthcheck_argv()
        assert probe[0] == "python"
        health = subprocess.run(
            [*as_user, f"{venv}/bin/python", *probe[1:]],
            env={**env, "SLOT_TRACKER_PORT": str(port)}, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert health.returncode == 0, health.stderr


def copy_context(source: Path, dest: Path, into: bool) -> None:
    """``COPY`` of one build-context path, without what ``.dockerignore`` drops: a directory's
    contents go into ``dest``; a file goes into ``dest`` when ``into``, else becomes it."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", "*.pyd")
    if source.is_dir():
        shutil.copytree(source, dest, ignore=ignore, dirs_exist_ok=True)
    elif into:
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / source.name)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest)


# -- the image itself, where a Docker engine runs --------------------------------------------


def docker_engine() -> str | None:
    """Why there is no usable Docker engine, or None when ``docker info`` answers."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker command"
    try:
        info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 20 s"
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`docker info` failed: {last}"
    return None


@pytest.mark.timeout(1200)
def test_the_image_builds_and_serves_a_round_trip() -> None:
    missing = docker_engine()
    if missing is not None:
        pytest.skip(f"no Docker engine here ({missing}); the recipe is tested without one above")
    tag = f"kv-slot-tracker:test-{uuid.uuid4().hex[:8]}"
    run(["docker", "build", "-q", "-t", tag, ROOT], timeout=900)
    container = ""
    try:
        container = run(["docker", "run", "-d", "-p", "127.0.0.1::8091", tag]).stdout.strip()
        mapped = run(["docker", "port", container, "8091/tcp"]).stdout.splitlines()[0]
        url = "http://" + mapped.strip()
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
                pytest.fail(f"the container did not answer /health:\n{logs.stdout}{logs.stderr}")
            time.sleep(0.2)
        round_trip(url)
        user = run(["docker", "exec", container, "id", "-u"]).stdout.strip()
        assert user != "0"
    finally:
        if container:
            subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=60)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=60)


# -- one served process and its round trip ---------------------------------------------------


@contextlib.contextmanager
def served(
    argv: Sequence[str | Path], cwd: Path, env: dict[str, str], timeout: float = 60
) -> Iterator[tuple[str, int]]:
    """Start ``argv`` (listening on port 0), yield its base URL and port once uvicorn says
    where it listens, then stop it with SIGTERM (as ``docker stop`` and Kubernetes do) and
    expect a graceful shutdown: uvicorn finishes, then re-raises the signal."""
    proc = subprocess.Popen(
        [str(a) for a in argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    seen: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        match = None
        while match is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                pytest.fail(f"{argv[-3:]} did not start listening:\n{''.join(seen)}")
            seen.append(line)
            match = RUNNING.search(line)
        port = int(match.group(2))
        yield f"http://127.0.0.1:{port}", port
    finally:
        proc.terminate()
        try:
            code = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    while (line := lines.get(timeout=5)) is not None:
        seen.append(line)
    log = "".join(seen)
    assert code in (0, -signal.SIGTERM), log
    assert "Application shutdown complete." in log and "Traceback" not in log, log


def round_trip(url: str) -> None:
    """Register a worker, add a request, read the loads, free it, read them again; the
    dashboard page and the API docs' assets come from package data."""
    with httpx.Client(base_url=url, timeout=10) as client:
        worker = {"model_name": "m", "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
        assert client.post("/register", json=worker).status_code == 201
        add = {"model_name": "m", "request_id": "r1", "worker_id": 1, "dp_rank": 0,
               "sequence_hashes": [11, 12, 13], "new_isl_tokens": 12}  # fmt: skip
        r = client.post("/add", json=add)
        assert r.status_code == 201, r.text
        (row,) = client.get("/loads").json()
        assert (row["worker_id"], row["dp_rank"], row["active_requests"]) == (1, 0, 1), row
        r = client.post("/free", json={"model_name": "m", "request_id": "r1"})
        assert r.status_code == 200, r.text
        (row,) = client.get("/loads").json()
        assert row["active_requests"] == 0, row
        page = client.get("/dashboard")
        assert page.status_code == 200 and "<html" in page.text.lower()
        docs = client.get("/docs")
        assert docs.status_code == 200
        assets = re.findall(r'(?:src|href)="(/[^"]+\.(?:js|css))"', docs.text)
        assert assets, docs.text
        for asset in assets:
            assert client.get(asset).status_code == 200, asset
        assert client.get("/openapi.json").json()["info"]["version"] == __version__
