"""What every deployment file must hold, checked on all four (``compose.yaml``,
``compose.sentinel.yaml``, ``deploy/kubernetes`` and ``deploy/kubernetes-sentinel`` as their
kustomizations render them):

* no password on a command line: no container's command, arguments or entrypoint carries it or
  the variable Kubernetes would expand into it; every Redis start script, run for real (with
  stand-ins for ``redis-server`` and ``redis-cli`` that record what they are given and hand the
  real ``redis-server`` a private socket), execs Redis without it, and the real Redis then
  requires it, with a password that needs escaping;
* memory: every container has a memory limit, and every Redis's ``maxmemory`` is at most 80%
  of its container's;
* Redis settings: no eviction, no persistence and ``repl-diskless-sync-delay 0`` on every Redis
  node (a new primary's replicas are synced at once after a switch-over), as the real Redis
  reads them;
* the Sentinel StatefulSet: a PodDisruptionBudget letting one pod go at a time, required
  anti-affinity on the node and a zone spread; every container has a liveness probe (Compose:
  a health check), and Redis probes want PONG, not just an answer;
* images pinned to a patch version, one Redis version everywhere.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import KUBE_DIR, ROOT, load_yaml_docs
from tests.deploy.test_compose import PASSWORD_VAR, SHELL_ENV, interpolate

COMPOSE_FILES = {
    "compose": ROOT / "compose.yaml",
    "compose-sentinel": ROOT / "compose.sentinel.yaml",
}
KUBE_DIRS = {"kubernetes": KUBE_DIR, "kubernetes-sentinel": KUBE_DIR.parent / "kubernetes-sentinel"}
# A password Redis's configuration syntax must be told apart from: quotes, a backslash, a space,
# shell syntax. The Compose files get it from the shell, as `docker compose` would.
NASTY = "p\"w\\ d $(id) `x` 'q'"
REDIS_IMAGE = re.compile(r"redis:\d+\.\d+\.\d+")
PINNED = re.compile(r"[^:@\s]+(:\d+\.\d+\.\d+[\w.-]*|@sha256:[0-9a-f]{64})")
MAX_SHARE = 0.8  # maxmemory / the container's memory limit


# --- Rendering ---------------------------------------------------------------------------------


def compose_services(name: str) -> dict[str, dict[str, Any]]:
    """The file's services, interpolated as Compose does with the shell's variables."""
    doc = yaml.safe_load(COMPOSE_FILES[name].read_text())
    env = {**SHELL_ENV, PASSWORD_VAR: NASTY}

    def walk(value: Any) -> Any:
        if isinstance(value, str):
            return interpolate(value, env)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    return walk(doc["services"])


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize`` renders, for the forms these kustomizations use: resources
    (files or another kustomization) and ``$patch: delete`` patches (the env patch of the
    Sentinel variant changes no container's command, resources or probes)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        path = directory / resource
        docs += kustomize(path) if path.is_dir() else load_yaml_docs(path)
    for patch in kustomization.get("patches", []):
        if "patch" in patch:
            doc = yaml.safe_load(patch["patch"])
            if doc.get("$patch") == "delete":
                key = (doc["kind"], doc["metadata"]["name"])
                docs = [d for d in docs if (d["kind"], d["metadata"]["name"]) != key]
    return docs


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for w in workloads(docs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            yield w, c


def script(argv: list[str]) -> str | None:
    """The script of an ``sh -c SCRIPT`` command, None for another command."""
    return argv[2] if argv[:2] == ["sh", "-c"] else None


def kube_script(container: dict[str, Any]) -> str | None:
    text = script(container.get("command", []))
    return None if text is None else text.replace("$$", "$")  # what Kubernetes hands sh


def configmap(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    (found,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
    return found["data"]


def test_the_hand_rendering_is_what_kubectl_renders() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    for directory in KUBE_DIRS.values():
        done = subprocess.run(
            [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        theirs = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(done.stdout))
        ours = sorted((d["kind"], d["metadata"]["name"]) for d in kustomize(directory))
        assert ours == theirs, directory.name
        rendered = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(done.stdout)}
        for w in workloads(kustomize(directory)):
            theirs_w = rendered[(w["kind"], w["metadata"]["name"])]
            for mine, real in zip(
                w["spec"]["template"]["spec"]["containers"],
                theirs_w["spec"]["template"]["spec"]["containers"],
                strict=True,
            ):
                for key in ("command", "args", "resources", "livenessProbe", "image"):
                    assert mine.get(key) == real.get(key), (directory.name, mine["name"], key)


# --- No password on a command line ------------------------------------------------------------


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_puts_the_password_on_no_command_line(name: str) -> None:
    for service, svc in compose_services(name).items():
        for key in ("command", "entrypoint"):
            argv = svc.get(key) or []
            words = argv if isinstance(argv, list) else [argv]
            assert not any(NASTY in str(w) for w in words), (service, key)
            text = script([str(w) for w in words]) or " ".join(map(str, words))
            for line in exec_lines(text):
                assert not re.search(r"requirepass|masterauth|REDISCLI_AUTH|\s-a\s", line), line


@pytest.mark.parametrize("name", KUBE_DIRS)
def test_kubernetes_puts_the_password_on_no_command_line(name: str) -> None:
    secret_vars = set()
    for _, c in containers(kustomize(KUBE_DIRS[name])):
        secret_vars |= {
            e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})
        }
    assert "REDISCLI_AUTH" in secret_vars
    for w, c in containers(kustomize(KUBE_DIRS[name])):
        where = (w["metadata"]["name"], c["name"])
        words = [*c.get("command", []), *c.get("args", [])]
        for var in secret_vars:  # Kubernetes would put the Secret's value there
            assert not any(f"$({var})" in w for w in words), (where, var)
        text = kube_script(c) or " ".join(words)
        for line in exec_lines(text):
            assert not re.search(r"requirepass|masterauth|REDISCLI_AUTH|\s-a\s", line), line


def exec_lines(text: str) -> list[str]:
    """The commands a script execs (continuation lines joined), or the command itself."""
    joined = text.replace("\\\n", " ")
    found = [line.strip() for line in joined.splitlines() if line.strip().startswith("exec ")]
    return found or [joined]


# --- Redis start scripts, run for real --------------------------------------------------------


REAL_REDIS_SERVER = shutil.which("redis-server")
REAL_REDIS_CLI = shutil.which("redis-cli")


def stand_ins(bin_dir: Path, sock: Path, record: Path) -> None:
    """``redis-server`` records its arguments, then starts the real one on a private socket
    only (no TCP port); ``redis-cli`` finds no Sentinel (as on the very first start)."""
    bin_dir.mkdir()
    server = bin_dir / "redis-server"
    server.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > "{record}"\n'
        f'exec "{REAL_REDIS_SERVER}" "$@" --port 0 --unixsocket "{sock}" --dir "{sock.parent}"\n'
    )
    cli = bin_dir / "redis-cli"
    cli.write_text("#!/bin/sh\nexit 1\n")
    for tool in (server, cli):
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)


def redis_cli(sock: Path, *args: str, password: str | None = None) -> str:
    assert REAL_REDIS_CLI is not None
    env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
    if password is not None:
        env["REDISCLI_AUTH"] = password
    done = subprocess.run(
        [REAL_REDIS_CLI, "-s", str(sock), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=10,
    )
    return done.stdout.strip()


def start_script(text: str, tmp: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Path, Path]:
    """Run a Redis start script with its absolute paths moved under ``tmp``."""
    if REAL_REDIS_SERVER is None or REAL_REDIS_CLI is None:
        pytest.fail(
            "redis-server and redis-cli are needed (the suite's Redis: scripts/with_redis.sh)"
        )
    for directory in ("run/redis", "etc/redis", "sentinel"):
        (tmp / directory).mkdir(parents=True, exist_ok=True)
    text = re.sub(
        r"(?<![\w.])/(run/redis|etc/redis|sentinel)\b", lambda m: f"{tmp}/{m.group(1)}", text
    )
    sock, record = tmp / "redis.sock", tmp / "argv"
    stand_ins(tmp / "bin", sock, record)
    proc = subprocess.Popen(
        ["sh", "-c", text],
        env={"PATH": f"{tmp / 'bin'}:/usr/bin:/bin", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, sock, record


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"Redis did not start: {proc.communicate()[0][-2000:]}")
        time.sleep(0.02)


def check_running_redis(proc: subprocess.Popen, sock: Path, record: Path) -> None:
    try:
        wait_for(sock, proc)
        argv = record.read_text()
        assert NASTY not in argv and "requirepass" not in argv and "masterauth" not in argv, argv
        assert redis_cli(sock, "ping").startswith("NOAUTH"), "Redis must require the password"
        assert redis_cli(sock, "ping", password=NASTY) == "PONG"
        settings = {
            key: redis_cli(sock, "config", "get", key, password=NASTY).splitlines()[-1]
            for key in ("maxmemory-policy", "repl-diskless-sync-delay", "save", "appendonly",
                        "masterauth")
        }  # fmt: skip
        assert settings["maxmemory-policy"] == "noeviction"
        assert settings["repl-diskless-sync-delay"] == "0"
        assert settings["save"] in ("", "save")  # none ("save" is the key: the value is empty)
        assert settings["appendonly"] == "no"
        # the files holding the password are the redis user's alone
        for conf in sock.parent.rglob("*.conf"):
            if re.search(r"^(requirepass|masterauth) ", conf.read_text(), flags=re.M):
                assert stat.S_IMODE(conf.stat().st_mode) & 0o077 == 0, conf
    finally:
        proc.terminate()
        proc.wait(10)


def test_compose_redis_starts_with_the_password_from_a_file(tmp_path: Path) -> None:
    redis = compose_services("compose")["redis"]
    text = script(redis["entrypoint"])
    assert text is not None
    env = {k: str(v) for k, v in redis["environment"].items()}
    assert env["REDISCLI_AUTH"] == NASTY
    check_running_redis(*start_script(text, tmp_path, env))


def test_compose_sentinel_nodes_start_with_the_password_from_a_file(tmp_path: Path) -> None:
    node = compose_services("compose-sentinel")["redis-1"]
    text = script(node["entrypoint"])
    assert text is not None
    env = {k: str(v) for k, v in node["environment"].items()}
    proc, sock, record = start_script(text, tmp_path, env)
    check_running_redis(proc, sock, record)
    assert "--replica-announce-ip\nredis-1" in record.read_text()


@pytest.mark.parametrize("name", KUBE_DIRS)
def test_kubernetes_redis_starts_with_the_password_from_a_file(name: str, tmp_path: Path) -> None:
    docs = kustomize(KUBE_DIRS[name])
    (redis,) = [(w, c) for w, c in containers(docs) if c["name"] == "redis"]
    workload, container = redis
    text = kube_script(container)
    assert text is not None
    # the ConfigMap mounted where the script points redis-server
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if "configMap" in volumes[m["name"]]]
    data = configmap(docs, volumes[mount["name"]]["configMap"]["name"])
    conf_dir = tmp_path / mount["mountPath"].lstrip("/")
    conf_dir.mkdir(parents=True)
    for file, content in data.items():
        (conf_dir / file).write_text(content.replace("/run/redis", f"{tmp_path}/run/redis"))
    # the files the password goes to are in memory, not on the node's disk
    written = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert written["/run/redis"]["emptyDir"]["medium"] == "Memory"
    env = {"REDISCLI_AUTH": NASTY, "HOSTNAME": f"{workload['metadata']['name']}-0"}
    check_running_redis(*start_script(text, tmp_path, env))


@pytest.mark.parametrize("name", ["compose-sentinel", "kubernetes-sentinel"])
def test_sentinels_get_the_password_in_their_file_only(name: str, tmp_path: Path) -> None:
    if name == "kubernetes-sentinel":
        docs = kustomize(KUBE_DIRS[name])
        (sentinel,) = [c for _, c in containers(docs) if c["name"] == "sentinel"]
        text, env = kube_script(sentinel), {"REDISCLI_AUTH": NASTY, "HOSTNAME": "ha-1"}
    else:
        svc = compose_services(name)
        text = script(svc["sentinel-1"]["entrypoint"])
        env = {k: str(v) for k, v in svc["sentinel-1"]["environment"].items()}
    assert text is not None
    for directory in ("run/redis", "sentinel"):
        (tmp_path / directory).mkdir(parents=True)
    text = re.sub(r"(?<![\w.])/(run/redis|sentinel)\b", lambda m: f"{tmp_path}/{m.group(1)}", text)
    record = tmp_path / "argv"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{record}"\n')
    (bin_dir / "redis-cli").write_text("#!/bin/sh\nexit 1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    done = subprocess.run(
        ["sh", "-c", text],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    argv = record.read_text().splitlines()
    assert argv[-1] == "--sentinel" and NASTY not in record.read_text()
    (conf,) = [Path(a) for a in argv if a.endswith(".conf")]
    text = conf.read_text()
    escaped = NASTY.replace("\\", "\\\\").replace('"', '\\"')
    for line in ("requirepass", "sentinel sentinel-pass", "sentinel auth-pass mymaster"):
        assert f'{line} "{escaped}"\n' in text, line
    assert stat.S_IMODE(conf.stat().st_mode) & 0o077 == 0


# --- Memory -------------------------------------------------------------------------------------


UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "kb": 2**10, "mb": 2**20, "gb": 2**30,
         "ki": 2**10, "mi": 2**20, "gi": 2**30}  # fmt: skip


def to_bytes(quantity: str | int) -> int:
    m = re.fullmatch(r"(\d+)([a-zA-Z]*)", str(quantity).strip())
    assert m, quantity
    return int(m.group(1)) * (UNITS[m.group(2).lower()] if m.group(2) else 1)


def option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def compose_redis_settings(svc: dict[str, Any]) -> dict[str, str] | None:
    """The settings a Redis node of a Compose file starts with (its exec line), None for a
    container that runs no Redis node (a Sentinel, an instance)."""
    text = script(svc.get("entrypoint") or []) or ""
    lines = [ln for ln in exec_lines(text) if "redis-server" in ln and "--sentinel" not in ln]
    if not lines:
        return None
    words = lines[0].replace('""', "''").split()
    return {
        name: str(option(words, f"--{name}")).strip("'")
        for name in ("maxmemory", "maxmemory-policy", "repl-diskless-sync-delay", "save",
                     "appendonly")
    }  # fmt: skip


def conf_settings(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        parts = line.split(None, 1)
        if parts and not parts[0].startswith("#") and len(parts) == 2:
            out[parts[0]] = parts[1].strip().strip('"')
    return out


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_bounds_memory_and_redis_below_it(name: str) -> None:
    nodes = 0
    for service, svc in compose_services(name).items():
        assert "mem_limit" in svc, f"{service} has no memory limit"
        settings = compose_redis_settings(svc)
        if settings is None:
            continue
        nodes += 1
        assert to_bytes(settings["maxmemory"]) <= MAX_SHARE * to_bytes(svc["mem_limit"]), service
        assert settings["maxmemory-policy"] == "noeviction", service
        assert settings["repl-diskless-sync-delay"] == "0", service
        assert settings["appendonly"] == "no" and settings["save"] == "", service
    assert nodes == (1 if name == "compose" else 3)


@pytest.mark.parametrize("name", KUBE_DIRS)
def test_kubernetes_bounds_memory_and_redis_below_it(name: str) -> None:
    docs = kustomize(KUBE_DIRS[name])
    nodes = 0
    for w, c in containers(docs):
        limit = to_bytes(c["resources"]["limits"]["memory"])
        text = kube_script(c) or ""
        if not re.search(r"exec redis-server /etc/redis/redis\.conf", text):
            continue
        nodes += 1
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/redis"]
        conf = configmap(docs, volumes[mount["name"]]["configMap"]["name"])["redis.conf"]
        settings = conf_settings(conf)
        assert to_bytes(settings["maxmemory"]) <= MAX_SHARE * limit, (
            w["metadata"]["name"],
            c["name"],
        )
        assert settings["maxmemory-policy"] == "noeviction"
        assert settings["repl-diskless-sync-delay"] == "0"
        assert settings["appendonly"] == "no" and settings["save"] == ""
        assert settings["include"] == "/run/redis/auth.conf"
    assert nodes == 1  # the single Redis, or the Sentinel variant's data nodes


# --- Availability -------------------------------------------------------------------------------


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_sentinel_statefulset_survives_a_node_and_a_drain() -> None:
    docs = kustomize(KUBE_DIRS["kubernetes-sentinel"])
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    replicas = sts["spec"]["replicas"]
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"
               and selects(d["spec"]["selector"]["matchLabels"], labels)]  # fmt: skip
    assert len(budgets) == 1, "one PodDisruptionBudget for the Redis pods"
    spec = budgets[0]["spec"]
    allowed = (
        spec["maxUnavailable"] if "maxUnavailable" in spec else replicas - spec["minAvailable"]
    )
    assert allowed == 1, "one pod at a time: the Sentinels' quorum (2 of 3) stays"
    pod = sts["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"]["matchLabels"], labels)
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert selects(spread["labelSelector"]["matchLabels"], labels)


@pytest.mark.parametrize("name", KUBE_DIRS)
def test_every_kubernetes_container_has_a_liveness_probe(name: str) -> None:
    for w, c in containers(kustomize(KUBE_DIRS[name])):
        assert "livenessProbe" in c, (w["metadata"]["name"], c["name"])
        argv = c["livenessProbe"].get("exec", {}).get("command", [])
        if any("redis-cli" in a for a in argv):
            assert argv[:2] == ["sh", "-c"] and argv[2].endswith("| grep -qx PONG"), argv


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_every_compose_service_has_a_health_check(name: str) -> None:
    for service, svc in compose_services(name).items():
        test = svc["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL"), service
        if "redis-cli" in " ".join(test):
            assert test[0] == "CMD-SHELL" and test[1].endswith("| grep -qx PONG"), service


def test_a_redis_probe_wanting_pong_fails_on_an_error_answer(tmp_path: Path) -> None:
    """``redis-cli ping`` exits 0 on NOAUTH; ``| grep -qx PONG`` does not."""
    if REAL_REDIS_SERVER is None or REAL_REDIS_CLI is None:
        pytest.fail(
            "redis-server and redis-cli are needed (the suite's Redis: scripts/with_redis.sh)"
        )
    sock = tmp_path / "r.sock"
    proc = subprocess.Popen(
        [REAL_REDIS_SERVER, "--port", "0", "--unixsocket", str(sock), "--requirepass", "x",
         "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(sock, proc)
        env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
        bare = subprocess.run([REAL_REDIS_CLI, "-s", str(sock), "ping"], env=env, timeout=10)
        assert bare.returncode == 0  # what a plain `redis-cli ping` probe would accept
        probe = f"{REAL_REDIS_CLI} -s {sock} ping | grep -qx PONG"
        assert subprocess.run(["sh", "-c", probe], env=env, timeout=10).returncode != 0
        env["REDISCLI_AUTH"] = "x"
        assert subprocess.run(["sh", "-c", probe], env=env, timeout=10).returncode == 0
    finally:
        proc.terminate()
        proc.wait(10)


# --- Images -------------------------------------------------------------------------------------


def all_images() -> list[tuple[str, str]]:
    found = []
    for name in COMPOSE_FILES:
        for service, svc in compose_services(name).items():
            if "build" not in svc:  # a locally built image is what the checkout holds
                found.append((f"{name}/{service}", svc["image"]))
    for name, directory in KUBE_DIRS.items():
        for w, c in containers(kustomize(directory)):
            found.append((f"{name}/{w['metadata']['name']}/{c['name']}", c["image"]))
    return found


def test_images_are_pinned_to_a_patch_version() -> None:
    images = all_images()
    assert len(images) >= 8
    loose = [(where, image) for where, image in images if not PINNED.fullmatch(image)]
    assert loose == []
    redis = {image for _, image in images if image.startswith("redis:")}
    assert len(redis) == 1 and REDIS_IMAGE.fullmatch(redis.pop() or "")
