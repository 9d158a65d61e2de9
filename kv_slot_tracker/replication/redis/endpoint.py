"""Where Redis is and how to reach it: one server, a Sentinel-managed primary, or a Cluster;
with TLS and an ACL user and password if configured.

Three shapes, from the settings:

* one server: ``redis_url`` (``redis://``, ``rediss://`` for TLS, ``unix://``);
* Sentinel: ``redis_sentinels = "host:26379,host:26380"`` and ``redis_sentinel_master``, or
  ``redis_url = "redis+sentinel://host:26379,host:26380/mymaster"`` (``rediss+sentinel://`` for
  TLS). Every connection asks the Sentinels for the current primary when it connects, so after
  a failover the next reconnect reaches the promoted replica; a connection that finds itself
  talking to a demoted primary (``READONLY``) drops and asks again;
* Cluster: ``redis_cluster = true`` with ``redis_url`` naming any node; every key of a namespace
  carries its hash tag, so the namespace lives on one slot.

Credentials. The password comes from ``redis_password_file`` (its first line), else
``redis_password`` (``SLOT_TRACKER_REDIS_PASSWORD``), else the URL; the user from
``redis_username``, else the URL. ``describe()`` is what logs and ``GET /replication`` show: the
address with any password masked. The same credentials and TLS settings serve Sentinels, unless
``redis_sentinel_password`` is set (Sentinels often have a password of their own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from kv_slot_tracker.settings import Settings

MASK = "***"


@dataclass(frozen=True, slots=True)
class RedisEndpoint:
    kind: str  # "server", "sentinel" or "cluster"
    url: str = ""  # server or cluster: the URL without credentials
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = ""
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_check_hostname: bool = True

    @classmethod
    def of(cls, s: Settings) -> RedisEndpoint:
        url = s.redis_url
        username: str | None = None
        password: str | None = None
        sentinels: tuple[tuple[str, int], ...] = ()
        master = s.redis_sentinel_master
        tls = s.redis_tls
        if url.startswith(("redis+sentinel://", "rediss+sentinel://")):
            kind = "sentinel"
            tls = tls or url.startswith("rediss+")
            rest = url.split("://", 1)[1]
            netloc, _, path = rest.partition("/")
            creds, _, hosts = netloc.rpartition("@")
            username, password = _credentials(creds)
            sentinels = _addresses(hosts)
            master = unquote(path.split("?", 1)[0].strip("/")) or master
            url = ""
        elif s.redis_sentinels.strip():
            kind = "sentinel"
            sentinels = _addresses(s.redis_sentinels)  # never with a redis_url (Settings' rules)
        else:
            kind = "cluster" if s.redis_cluster else "server"
            url, username, password = _strip_credentials(url)
            if url.startswith("rediss://"):
                tls = True
            elif tls and url.startswith("redis://"):
                url = "rediss://" + url[len("redis://") :]
        if not sentinels and kind == "sentinel":
            raise ValueError("no Sentinel addresses")
        if s.redis_username:
            username = s.redis_username
        secret = s.redis_password.get_secret_value()
        if s.redis_password_file:
            password = _first_line(s.redis_password_file)
        elif secret:
            password = secret
        sentinel_password = s.redis_sentinel_password.get_secret_value() or None
        return cls(
            kind,
            url,
            sentinels,
            master,
            username or None,
            password or None,
            sentinel_password,
            tls,
            s.redis_tls_ca_file,
            s.redis_tls_cert_file,
            s.redis_tls_key_file,
            s.redis_tls_check_hostname,
        )

    def describe(self) -> str:
        """The address for logs and status: no password, ever."""
        who = ""
        if self.username or self.password:
            who = f"{quote(self.username or '', safe='')}{':' + MASK if self.password else ''}@"
        if self.kind == "sentinel":
            hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
            scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
            return f"{scheme}://{who}{hosts}/{self.master}"
        parts = urlsplit(self.url)
        if who:
            parts = parts._replace(netloc=who + parts.netloc)
        text = urlunsplit(parts)
        return f"cluster {text}" if self.kind == "cluster" else text

    # -- building clients ---------------------------------------------------------------------

    def auth_kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.username:
            out["username"] = self.username
        if self.password:
            out["password"] = self.password
        return out

    def tls_kwargs(self) -> dict[str, Any]:
        if not self.tls:
            return {}
        out: dict[str, Any] = {"ssl_check_hostname": self.tls_check_hostname}
        if self.tls_ca_file:
            out["ssl_ca_certs"] = self.tls_ca_file
        if self.tls_cert_file:
            out["ssl_certfile"] = self.tls_cert_file
        if self.tls_key_file:
            out["ssl_keyfile"] = self.tls_key_file
        return out

    def sentinel_kwargs(self, socket_timeout: float, connect_timeout: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
        }
        if self.sentinel_password is not None:
            out["password"] = self.sentinel_password
        else:
            out.update(self.auth_kwargs())
        if self.tls:
            out["ssl"] = True
            out.update(self.tls_kwargs())
        return out


def _first_line(path: str) -> str:
    text = Path(path).read_text(encoding="utf-8")
    return text.splitlines()[0] if text else ""


def _credentials(creds: str) -> tuple[str | None, str | None]:
    if not creds:
        return None, None
    user, sep, password = creds.partition(":")
    return unquote(user) or None, (unquote(password) if sep else None) or None


def _addresses(text: str) -> tuple[tuple[str, int], ...]:
    out = []
    for address in filter(None, (a.strip() for a in text.split(","))):
        host, _, port = address.rpartition(":")
        out.append((host.strip("[]"), int(port)))
    return tuple(out)


def _strip_credentials(url: str) -> tuple[str, str | None, str | None]:
    """``url`` without ``user:password@``, and what it carried."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None, None
    creds, _, hostport = parts.netloc.rpartition("@")
    user, password = _credentials(creds)
    return urlunsplit(parts._replace(netloc=hostport)), user, password
