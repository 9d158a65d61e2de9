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

from tests.ports import free_port

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
        self.client_kwargs: dict[str, Any] = {}  # what the test's own clients need (TLS, auth)

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
        return redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=5,
                           **self.client_kwargs, **kwargs)  # fmt: skip

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
    """A primary, ``replicas`` replicas (one by default) and three Sentinels (quorum 2, down
    after 1 s); with ``password`` every one of them requires it, with ``certs``
    (``make_certificates``) they speak TLS only."""

    def __init__(
        self,
        binary: str,
        password: str | None = None,
        certs: dict[str, Path] | None = None,
        replicas: int = 1,
    ) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="slot-tracker-ha-"))
        self.servers = [RedisProcess(binary, f"redis-{'abcdefgh'[i]}", self.root)
                        for i in range(1 + replicas)]  # fmt: skip
        self.sentinels = [RedisProcess(binary, f"sentinel-{i}", self.root) for i in range(3)]
        self.password = password
        self.certs = certs
        self.common = ""  # configuration lines of every process
        self._cut: RedisProcess | None = None  # the replica cut_replication cut off
        if certs is not None:
            self.common += (f"tls-cert-file {certs['server_cert']}\n"
                            f"tls-key-file {certs['server_key']}\n"
                            f"tls-ca-cert-file {certs['ca']}\n"
                            "tls-auth-clients optional\ntls-replication yes\n")  # fmt: skip
        if password is not None:
            self.common += f"requirepass {password}\n"
        for p in [*self.servers, *self.sentinels]:
            if certs is not None:
                p.port_args = ["--port", "0", "--tls-port", str(p.port)]
                p.client_kwargs.update(ssl=True, ssl_ca_certs=str(certs["ca"]))
            if password is not None:
                p.client_kwargs["password"] = password
        for server in self.servers:
            server.conf = self.common + (f"masterauth {password}\n" if password else "")

    def start(self) -> None:
        first, *others = self.servers
        first.start()
        first.wait_up()
        for second in others:
            second.start("--replicaof", "127.0.0.1", str(first.port))
            second.wait_up()
        wait_for(lambda: all(self.role(o) == "slave" and self._link_up(o) for o in others), 10,
                 "the replicas to sync")  # fmt: skip
        for s in self.sentinels:
            auth = ""
            if self.password:
                auth = (f"sentinel auth-pass {MASTER} {self.password}\n"
                        f"sentinel sentinel-pass {self.password}\n")  # fmt: skip
            s.conf = (
                self.common
                + (
                    f"sentinel monitor {MASTER} 127.0.0.1 {first.port} 2\n"
                    f"sentinel down-after-milliseconds {MASTER} 1000\n"
                    f"sentinel failover-timeout {MASTER} 10000\n"
                    f"sentinel parallel-syncs {MASTER} 1\n"
                )
                + auth
            )
            s.args = ["--sentinel"]
            s.start()
        for s in self.sentinels:
            s.wait_up()

        def known() -> bool:  # every Sentinel knows the replica and the two other Sentinels
            for s in self.sentinels:
                with s.client(decode_responses=True) as c:
                    m = c.sentinel_master(MASTER)
                    if m["num-slaves"] < len(others) or m["num-other-sentinels"] < 2:
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

    def cut_replication(self) -> None:
        """Break the replica's link to the primary (it cannot log in again): from now on the
        primary alone holds new writes, what a replica that lags or a broken network means.
        Sentinel leaves a replica's login alone, and promotes it all the same."""
        primary = self.primary()
        (replica,) = [s for s in self.servers if s is not primary]
        with replica.client() as c:
            c.config_set("masteruser", "cut-off")
            c.config_set("masterauth", "cut-off")
        with primary.client() as c:
            c.client_kill_filter(_type="replica")

        def down() -> bool:
            with replica.client(decode_responses=True) as c:
                return c.info("replication")["master_link_status"] == "down"

        wait_for(down, 5, "the replication link to break")
        self._cut = replica

    def heal_replication(self) -> None:
        """Give the replica cut off by ``cut_replication`` its real login back (the network
        heals). Left cut, a server promoted by Sentinel could never take a replica again: a
        second failover, which loaded Sentinels sometimes start, would leave no replica at all."""
        replica, self._cut = self._cut, None
        if replica is None:
            return
        with replica.client() as c:
            c.config_set("masteruser", "")
            c.config_set("masterauth", self.password or "")

    def wait_healthy(self, timeout: float) -> RedisProcess:
        """Wait until the primary the Sentinels name is a master and the other servers its
        replicas with the link up, whichever server that is; returns the primary."""

        def healthy() -> RedisProcess | None:
            primary = self.primary()
            others = [s for s in self.servers if s is not primary]
            if self.role(primary) != "master" or any(self.role(o) != "slave" for o in others):
                return None
            return primary if all(self._link_up(o) for o in others) else None

        return wait_for(healthy, timeout, "one primary with its replica linked")

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
        (
            "server",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth",
        ),  # also a replica's own
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
