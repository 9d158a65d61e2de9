"""Redis as it runs in production, on loopback ports in temp dirs, for the tests in
``tests/ha/``: a primary with a replica watched by three Sentinels, a TLS server with ACL
users (certificates generated here), a three-primary Cluster. Every process is killed by
``close()``; no persistence anywhere (a killed server comes back empty, the worst case).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from tests.replication.helpers import free_port

MASTER = "mymaster"


def wait_for(probe: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            value = probe()
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class RedisProcess:
    """One ``redis-server`` (or Sentinel) on a loopback port, with its own directory."""

    def __init__(self, binary: str, name: str, root: Path, *args: str, port: int = 0) -> None:
        self.binary = binary
        self.name = name
        self.port = port or free_port()
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.conf: str | None = None  # a config file (Sentinels need one they may rewrite)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port_args = ["--port", str(self.port)]  # TLS only: --port 0 --tls-port PORT

    def start(self, *extra: str) -> None:
        command = [self.binary]
        if self.conf is not None:
            path = self.dir / "redis.conf"
            path.write_text(self.conf)
            command.append(str(path))
        command += [*self.port_args, "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", str(self.dir),
                    "--logfile", str(self.dir / "log"), *self.args, *extra]  # fmt: skip
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=5, **kwargs)

    def wait_up(self, timeout: float = 10.0, **kwargs: Any) -> None:
        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_tail()}")
            with self.client(**kwargs) as c:
                return bool(c.ping())

        wait_for(up, timeout, f"{self.name} on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join((self.dir / "log").read_text().splitlines()[-lines:])
        except OSError:
            return ""


class SentinelGroup:
    """A primary, one replica and three Sentinels (quorum 2, down after 1 s)."""

    def __init__(self, binary: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="slot-tracker-ha-"))
        self.servers = [RedisProcess(binary, "redis-a", self.root),
                        RedisProcess(binary, "redis-b", self.root)]  # fmt: skip
        self.sentinels = [RedisProcess(binary, f"sentinel-{i}", self.root) for i in range(3)]
        self.link: Any = None  # what the replica replicates through, if not the primary itself

    def start(self, link: Any = None) -> None:
        """``link(port)``: the port the replica should replicate ``port`` through (a proxy
        that can cut the link); the primary's own port by default."""
        first, second = self.servers
        first.start()
        first.wait_up()
        via = link(first.port) if link is not None else first.port
        second.start("--replicaof", "127.0.0.1", str(via))
        second.wait_up()
        wait_for(lambda: self.role(second) == "slave" and self._link_up(second), 10,
                 "the replica to sync")  # fmt: skip
        for s in self.sentinels:
            s.conf = (
                f"sentinel monitor {MASTER} 127.0.0.1 {first.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 10000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            s.args = ["--sentinel"]
            s.start()
        for s in self.sentinels:
            s.wait_up()

        def known() -> bool:  # every Sentinel knows the replica and the two other Sentinels
            for s in self.sentinels:
                with s.client(decode_responses=True) as c:
                    m = c.sentinel_master(MASTER)
                    if m["num-slaves"] < 1 or m["num-other-sentinels"] < 2:
                        return False
            return True

        wait_for(known, 30, "the Sentinels to know each other and the replica", 0.2)

    @property
    def urls(self) -> str:
        """``redis+sentinel://`` URL of the group."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER}"

    def role(self, server: RedisProcess) -> str:
        with server.client(decode_responses=True) as c:
            return c.info("replication")["role"]

    def _link_up(self, server: RedisProcess) -> bool:
        with server.client(decode_responses=True) as c:
            return c.info("replication").get("master_link_status") == "up"

    def primary_port(self) -> int:
        """The primary's port as the Sentinels see it now."""
        with self.sentinels[0].client(decode_responses=True) as c:
            return int(c.sentinel_get_master_addr_by_name(MASTER)[1])

    def primary(self) -> RedisProcess:
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def close(self) -> None:
        for p in [*self.sentinels, *self.servers]:
            p.kill()
        shutil.rmtree(self.root, ignore_errors=True)


# -- TLS ----------------------------------------------------------------------------------------


def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM
    files in ``directory`` (made with the ``openssl`` command): ``ca``, ``server_cert``,
    ``server_key``, ``client_cert``, ``client_key``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=30)

    d = directory
    out = {"ca": d / "ca.pem", "ca_key": d / "ca.key"}
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(out["ca_key"]), "-out", str(out["ca"]), "-days", "1",
        "-subj", "/CN=slot-tracker test CA")  # fmt: skip
    for who, ext in (
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        key, csr, cert, extfile = (d / f"{who}.key", d / f"{who}.csr", d / f"{who}.pem",
                                   d / f"{who}.ext")  # fmt: skip
        extfile.write_text(ext + "\n")
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(csr), "-subj", f"/CN=slot-tracker {who}")  # fmt: skip
        run("x509", "-req", "-in", str(csr), "-CA", str(out["ca"]), "-CAkey", str(out["ca_key"]),
            "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(extfile))  # fmt: skip
        out[f"{who}_cert"], out[f"{who}_key"] = cert, key
    return out


# -- Cluster ------------------------------------------------------------------------------------


class LocalCluster:
    """Three primaries (no replicas) on loopback ports, joined with ``redis-cli --cluster
    create``."""

    def __init__(self, binary: str, cli: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="slot-tracker-cluster-"))
        self.cli = cli
        self.nodes = [
            RedisProcess(binary, f"node-{i}", self.root, "--cluster-enabled", "yes",
                         "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                         "--cluster-port", str(free_port()))
            for i in range(3)
        ]  # fmt: skip

    def start(self) -> None:
        for n in self.nodes:
            n.start()
        for n in self.nodes:
            n.wait_up()
        subprocess.run([self.cli, "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip

        def ok() -> bool:
            for n in self.nodes:
                with n.client(decode_responses=True) as c:
                    if c.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                        return False
            return True

        wait_for(ok, 30, "the cluster to be ok", 0.2)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def close(self) -> None:
        for n in self.nodes:
            n.kill()
        shutil.rmtree(self.root, ignore_errors=True)
