"""Service settings.

Sources, lowest precedence first:

1. ``kv_slot_tracker/config/default.toml``, package data read through ``importlib.resources``
   (the class defaults below mirror it);
2. the TOML file given with ``--config FILE``;
3. ``SLOT_TRACKER_*`` environment variables (``SLOT_TRACKER_PORT=9000``);
4. explicit overrides (keyword arguments, e.g. from command-line flags).

Use :func:`load_settings`: it is the one validation that both ``--check-config`` and start-up
run, so the two cannot disagree. It checks every value and every rule between values (the
model's validators), then what only the machine can answer (files that must be readable, TLS
material that must load, optional packages that must be installed), and raises
:class:`ConfigError` with one :class:`Problem` per finding, each naming where the value came
from: the flag, the variable, or the file and line. ``Settings()`` alone reads sources 1, 3 and
4 and checks values and rules only.

This module holds the model, its rules and the checks on this machine; the reading of the
sources and the reporting of problems (where a value came from) are in
``kv_slot_tracker.config_sources``.
"""

from __future__ import annotations

import difflib
import os
import re
import ssl
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kv_slot_tracker.config_sources import (
    DEFAULT_CONFIG_FILE,
    ENV_PREFIX,
    RULES_ERROR,
    ConfigError,
    Origins,
    Problem,
    TomlFilesSource,
    did_you_mean,
    key_in_file,
    read_toml,
)
from kv_slot_tracker.core.limits import DEFAULT_MAX_TRACKERS, MAX_DP_SIZE, MAX_NAME_LENGTH
from kv_slot_tracker.core.selection.pending import DEFAULT_MAX_BYTES as PENDING_MAX_BYTES
from kv_slot_tracker.core.sequences import CHECK_EXPIRY_FREQUENCY_NS, EXPIRY_DURATION_NS
from kv_slot_tracker.core.types import NS_PER_S, U32_MAX, U64_MAX
from kv_slot_tracker.cores import process_count

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]

# The values of the TOML files read by the settings being built now (None: the packaged
# defaults alone). A context variable rather than a class attribute, so building settings never
# leaks into another build.
_file_values: ContextVar[Mapping[str, Any] | None] = ContextVar("_file_values", default=None)


MAX_INDEXER_PEERS = 16
WORKERS_TRANSPORT_REDIS_REMOVED = (
    'workers_transport = "redis" (a private redis-server for the processes) was removed: it '
    "cost more CPU per write and more visibility lag than the supervisor's hub; "
    'use workers_transport = "local" (the default), or set redis_url (or Sentinel, or Cluster) '
    "for the processes to share a Redis of yours"
)
KUBERNETES_CLIENT_MISSING = (
    "discovery_kubernetes_service is set but the Kubernetes client is not installed: "
    "pip install 'kv-slot-tracker[kubernetes]' (or pip install kubernetes_asyncio)"
)


def peer_urls(value: str) -> list[str]:
    """The base URLs of ``indexer_peers`` (comma-separated), without a trailing slash."""
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


class Settings(BaseSettings):
    """Every setting of the service; ``kv_slot_tracker/config/default.toml`` says what each one
    means."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",  # a misspelt key in a config file is an error, not silently ignored
        frozen=True,
        validate_default=True,
    )

    # HTTP server
    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8091, ge=0, le=65535)
    api_key: SecretStr = Field(default=SecretStr(""), repr=False)
    metrics_require_key: bool = False
    log_level: LogLevel = "info"
    log_format: Literal["text", "json"] = "text"
    access_log: bool = False
    max_body_bytes: int = Field(default=2_097_152, gt=0)
    max_hashes_per_request: int = Field(default=1_048_576, gt=0)
    max_batch_operations: int = Field(default=10_000, gt=0)
    max_trackers: int = Field(default=DEFAULT_MAX_TRACKERS, gt=0)
    # Serve the hot routes inside uvicorn's connection callbacks (kv_slot_tracker.http.fast_protocol); false keeps
    # every request on the ASGI path.
    http_direct: bool = True
    # Server processes on the one port, sharing one state (kv_slot_tracker.supervisor); "auto" = the cores this
    # process may use (CPU affinity and cgroup quota).
    workers: int | Literal["auto"] = 1
    # How those processes share their state when no Redis is configured: "local" = a hub in the
    # supervisor, over a Unix socket (kv_slot_tracker.replication.local), the only value left
    # ("redis", a private redis-server, is refused: WORKERS_TRANSPORT_REDIS_REMOVED). With a
    # Redis configured the processes always use it.
    workers_transport: Literal["local"] = "local"
    # Limits of one connection and of the server (kv_slot_tracker.http.connection)
    http_max_header_bytes: int = Field(default=65_536, gt=0)
    http_header_timeout_seconds: int = Field(default=10, gt=0)
    http_body_timeout_seconds: int = Field(default=30, gt=0)
    http_keep_alive_seconds: int = Field(default=5, gt=0)
    http_max_connections: int = Field(default=4096, gt=0)
    http_max_connections_per_client: int = Field(default=2048, gt=0)
    http_min_request_bytes_per_second: int = Field(default=1024, ge=0)
    http_request_rate_grace_seconds: int = Field(default=3, gt=0)
    http_min_bytes_per_read: int = Field(default=256, ge=0)
    # Global budgets (kv_slot_tracker.core.limits): 0 = sized from the memory limit
    memory_budget_bytes: int = Field(default=0, ge=0)
    max_active_requests: int = Field(default=0, ge=0)
    max_ranks: int = Field(default=0, ge=0)
    max_block_hashes: int = Field(default=0, ge=0)
    max_selection_workers: int = Field(default=0, ge=0)
    # Listings and metrics: what one answer or one scrape may hold
    list_max_items: int = Field(default=1000, gt=0)
    metrics_max_label_chars: int = Field(default=128, ge=16, le=1024)
    metrics_max_rank_series: int = Field(default=8192, ge=0)

    # Active request expiry
    expiry_seconds: int = Field(default=EXPIRY_DURATION_NS // NS_PER_S, gt=0)
    expiry_check_seconds: int = Field(default=CHECK_EXPIRY_FREQUENCY_NS // NS_PER_S, gt=0)
    force_expiry_interval_seconds: int = Field(default=60, gt=0)
    # Worker leases: a worker not renewed (register, upsert, POST /heartbeat) within this many
    # seconds is unregistered. 0: no lease (a worker stays until it is unregistered).
    worker_ttl_seconds: int = Field(default=0, ge=0)

    # Replication between instances
    redis_url: str = Field(default="", repr=False)  # may carry a password
    redis_sentinels: str = ""
    redis_sentinel_master: str = "mymaster"
    redis_cluster: bool = False
    redis_username: str = ""
    redis_password: SecretStr = Field(default=SecretStr(""), repr=False)
    redis_password_file: str = ""
    redis_sentinel_password: SecretStr = Field(default=SecretStr(""), repr=False)
    redis_tls: bool = False
    redis_tls_ca_file: str = ""
    redis_tls_cert_file: str = ""
    redis_tls_key_file: str = ""
    redis_tls_check_hostname: bool = True
    namespace: str = Field(default="kv-slot-tracker", min_length=1, pattern=r"^[^\s{}]+$")
    instance_id: int = Field(default=0, ge=0, le=U64_MAX)
    outbox_capacity: int = Field(default=100_000, gt=0)
    outbox_max_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    stream_retention_seconds: int = Field(default=3600, gt=0)
    stream_max_entries: int = Field(default=1_000_000, ge=0)
    stream_max_bytes: int = Field(default=512 * 1024 * 1024, ge=0)
    snapshot_interval_seconds: int = Field(default=30, gt=0)
    replication_batch_events: int = Field(default=256, gt=0)
    replication_batch_ms: int = Field(default=0, ge=0)
    # the stream format written (both are read): 1 while instances of a version before format 2
    # share the stream (a rolling upgrade), 2 once none does
    replication_stream_format: Literal[1, 2] = 1
    # a record whose sequence number lies more than this past its origin's last applied one is
    # taken for forged or corrupt: rejected (counted, degraded) unless a snapshot covers the gap
    replication_max_seq_jump: int = Field(default=1_000_000, gt=0)
    # most origins (instance, incarnation) the ledger of applied records keeps: beyond it the
    # longest silent are forgotten (an origin heard of again starts afresh, counted)
    replication_max_origins: int = Field(default=10_000, gt=1)

    # Consistency of lifecycle calls across instances
    consistency_wait_ms: int = Field(default=500, ge=0)
    replication_ack: Literal["local", "redis"] = "local"
    replication_ack_timeout_ms: int = Field(default=2000, gt=0)
    replication_ack_replicas: int = Field(default=0, ge=0)
    tombstone_capacity: int = Field(default=100_000, gt=0)
    tombstone_ttl_seconds: int = Field(default=EXPIRY_DURATION_NS // NS_PER_S, gt=0)
    tombstone_max_bytes: int = Field(default=64 * 1024 * 1024, gt=0)

    # Selection API (/selection/*): pending selections, randomness and the router knobs. A
    # DYN_ROUTER_* environment variable (the reference's name) wins over the router_* setting.
    selection_cache_ttl_seconds: int = Field(default=120, gt=0)
    selection_cache_max_entries: int = Field(default=100_000, gt=0)
    selection_cache_max_bytes: int = Field(default=PENDING_MAX_BYTES, gt=0)
    selection_seed: int = Field(default=-1, ge=-1)
    selection_port: int = Field(default=0, ge=0, le=65535)
    reservation_tombstone_capacity: int = Field(default=100_000, gt=0)
    reservation_tombstone_ttl_seconds: int = Field(default=EXPIRY_DURATION_NS // NS_PER_S, gt=0)
    reservation_tombstone_max_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    # Routing receipts (/selection/receipts): this instance's own decisions, not replicated
    selection_receipts: bool = True
    selection_receipts_max: int = Field(default=10_000, gt=0, le=10_000_000)
    selection_receipts_max_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    router_overlap_score_credit: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    router_overlap_score_credit_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    router_prefill_load_scale: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    router_decode_active_request_weight: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    router_temperature: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    router_track_prefill_tokens: bool = True
    router_ttl_seconds: float = Field(default=120.0, ge=0, allow_inf_nan=False)
    router_use_kv_events: bool = True
    router_assume_kv_reuse: bool = True
    router_preset: Literal["", "agentic", "load_aware"] = ""
    session_affinity_ttl_seconds: float = Field(default=0.0, ge=0, le=86_400, allow_inf_nan=False)
    kv_events_max_message_bytes: int = Field(default=16 << 20, ge=1024, le=1 << 30)
    kv_events_max_batch_blocks: int = Field(default=16_384, ge=1, le=1 << 24)
    kv_events_max_seq_jump: int = Field(default=100_000, ge=1, le=1 << 62)
    kv_events_gap_policy: Literal["continue", "clear"] = "continue"
    kv_events_replay_timeout_seconds: float = Field(default=2.0, gt=0, le=60, allow_inf_nan=False)
    kv_events_silent_seconds: float = Field(default=60.0, gt=0, le=86_400, allow_inf_nan=False)
    indexer_peers: str = ""
    indexer_peers_timeout_seconds: float = Field(default=10.0, gt=0, le=600, allow_inf_nan=False)
    discovery_kubernetes_service: str = Field(default="", max_length=1024)
    discovery_kubernetes_namespace: str = Field(default="", max_length=63)
    discovery_kubernetes_kubeconfig: str = ""
    discovery_kubernetes_worker_id: Literal["ordinal", "hash"] = "ordinal"
    discovery_kubernetes_model_name: str = Field(default="", max_length=MAX_NAME_LENGTH)
    discovery_kubernetes_routing_group: str = Field(
        default="default", min_length=1, max_length=MAX_NAME_LENGTH
    )
    discovery_kubernetes_block_size: int = Field(default=0, ge=0, le=U32_MAX)
    discovery_kubernetes_dp_size: int = Field(default=1, ge=1, le=MAX_DP_SIZE)
    discovery_kubernetes_max_workers: int = Field(default=1024, ge=1, le=65_536)
    discovery_kubernetes_api: Literal["slot", "selection"] = "slot"

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("workers", mode="before")
    @classmethod
    def _check_workers(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        number = int(str(value))  # "2" from an environment variable; 1.5 or "many": an error
        if number < 1:
            raise ValueError("must be auto or a whole number of at least 1")
        return number

    @field_validator("workers_transport", mode="before")
    @classmethod
    def _check_workers_transport(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "redis":
            raise ValueError(WORKERS_TRANSPORT_REDIS_REMOVED)
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        schemes = ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")
        if value and not value.startswith(schemes):
            raise ValueError("must be empty or start with " + ", ".join(schemes))
        if value.startswith(("redis+sentinel://", "rediss+sentinel://")):
            hosts = value.split("://", 1)[1].partition("/")[0].rpartition("@")[2]
            addresses = [a.strip() for a in hosts.split(",") if a.strip()]
            if not addresses:
                raise ValueError("a Sentinel URL names no Sentinel (host:port[,host:port...])")
            for address in addresses:
                host, _, port = address.rpartition(":")
                if not host or not port.isdigit() or int(port) > 65535:
                    raise ValueError(f"expected Sentinels as host:port, got {address!r}")
        elif value.startswith(("redis://", "rediss://")):
            try:
                urlsplit(value).port  # noqa: B018 - raises on a port that is not a number
            except ValueError as exc:
                raise ValueError(f"not a valid URL: {exc}") from None
        return value

    @field_validator("indexer_peers")
    @classmethod
    def _check_indexer_peers(cls, value: str) -> str:
        peers = peer_urls(value)
        if len(peers) > MAX_INDEXER_PEERS:
            raise ValueError(f"at most {MAX_INDEXER_PEERS} peers")
        for url in peers:
            scheme, sep, rest = url.partition("://")
            host = rest.split("/", 1)[0]
            if not sep or scheme not in ("http", "https") or not host or "@" in host:
                raise ValueError(f"expected http://HOST:PORT[,http://HOST:PORT...], got {url!r}")
        return value

    @field_validator("redis_sentinels")
    @classmethod
    def _check_sentinels(cls, value: str) -> str:
        for address in filter(None, (a.strip() for a in value.split(","))):
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"expected host:port[,host:port...], got {address!r}")
        return value

    @field_validator("discovery_kubernetes_service")
    @classmethod
    def _check_discovery_service(cls, value: str) -> str:
        value = value.strip()
        service_name = re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", value)
        if value and not service_name and not re.search(r"=|!|\s(not)?in\s*\(", value):
            raise ValueError(
                "must be a Service name (lowercase letters, digits and '-', at most 63) "
                "or a label selector such as app=vllm"
            )
        return value

    @field_validator("discovery_kubernetes_kubeconfig")
    @classmethod
    def _check_kubeconfig(cls, value: str) -> str:
        if value and not Path(value).is_file():
            raise ValueError(f"no such file: {value}")
        return value

    @model_validator(mode="after")
    def _check_together(self) -> Settings:
        """Rules between settings, checked at start rather than discovered in production; all
        broken rules are reported at once (one pydantic error carrying them)."""
        broken = self.broken_rules()
        if broken:
            summary = "; ".join(message for _, message in broken)
            raise PydanticCustomError(
                RULES_ERROR, "{summary}", {"summary": summary, "problems": broken}
            )
        return self

    def broken_rules(self) -> list[tuple[tuple[str, ...], str]]:
        """``(settings involved, message)`` for each rule between settings that is broken."""
        broken: list[tuple[tuple[str, ...], str]] = []

        def rule(message: str, *names: str) -> None:
            broken.append((names, message))

        if self.tombstone_ttl_seconds < self.expiry_seconds:
            rule(
                f"tombstone_ttl_seconds ({self.tombstone_ttl_seconds}) must be at least "
                f"expiry_seconds ({self.expiry_seconds}): a late add of a freed id would come "
                "back to life after its tombstone went",
                "tombstone_ttl_seconds",
                "expiry_seconds",
            )
        if self.expiry_check_seconds > self.expiry_seconds:
            rule(
                f"expiry_check_seconds ({self.expiry_check_seconds}) must be at most "
                f"expiry_seconds ({self.expiry_seconds})",
                "expiry_check_seconds",
                "expiry_seconds",
            )
        listed = bool(self.redis_sentinels.strip())
        sentinel_url = self.redis_url.startswith(("redis+sentinel://", "rediss+sentinel://"))
        if self.redis_url and listed:
            rule(
                "set either redis_url or redis_sentinels, not both", "redis_url", "redis_sentinels"
            )
        if self.redis_cluster:
            if listed or sentinel_url:
                rule(
                    "redis_cluster needs redis_url naming a Cluster node, not Sentinels",
                    "redis_cluster",
                    "redis_sentinels" if listed else "redis_url",
                )
            elif not self.redis_url:
                rule("redis_cluster needs redis_url naming a Cluster node", "redis_cluster")
            elif self.redis_url.startswith("unix://"):
                rule(
                    "a Redis Cluster is reached over TCP (redis:// or rediss://), not unix://",
                    "redis_cluster",
                    "redis_url",
                )
        if self.replication_ack_replicas and self.redis_cluster:
            rule(
                "replication_ack_replicas needs one server or Sentinel, not Cluster",
                "replication_ack_replicas",
                "redis_cluster",
            )
        if self.replication_ack_replicas and self.replication_ack != "redis":
            rule(
                'replication_ack_replicas needs replication_ack = "redis"',
                "replication_ack_replicas",
                "replication_ack",
            )
        tls = self.redis_tls or self.redis_url.startswith(("rediss://", "rediss+sentinel://"))
        for name in ("redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file"):
            if getattr(self, name) and not tls:
                rule(
                    f"{name} is set but TLS is off: set redis_tls = true or use a rediss:// URL",
                    name,
                    "redis_tls",
                )
        if self.redis_tls_key_file and not self.redis_tls_cert_file:
            rule("redis_tls_key_file needs redis_tls_cert_file", "redis_tls_key_file")
        if self.selection_port and self.selection_port == self.port:
            rule(f"selection_port ({self.selection_port}) must differ from port",
                 "selection_port", "port")  # fmt: skip
        if self.selection_port and isinstance(self.workers, int) and self.workers > 1:
            rule("selection_port is served by one server process: workers = 1 with it",
                 "selection_port", "workers")  # fmt: skip
        return broken

    @property
    def embedded(self) -> bool:
        """True when no Redis is configured: a single instance with in-process replication."""
        return not self.redis_url and not self.redis_sentinels.strip()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest precedence first. No .env or secrets-dir files.
        return (init_settings, env_settings, TomlFilesSource(settings_cls, _file_values.get()))


@contextmanager
def _reading(values: Mapping[str, Any]) -> Iterator[None]:
    token = _file_values.set(values)
    try:
        yield
    finally:
        _file_values.reset(token)


def load_settings(
    config_file: str | Path | None = None,
    *,
    labels: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Build and check settings from defaults < ``config_file`` < environment < ``overrides``.

    Overrides whose value is ``None`` are ignored, so unset command-line flags can be passed
    through as they are; a problem with an override is named ``--name-with-dashes`` (its flag)
    unless ``labels`` names it otherwise. Raises :class:`ConfigError` listing every problem:
    values, rules between values, and what start-up would find on this machine
    (:func:`machine_problems`).
    """
    origins = Origins(labels or {}, Settings.model_fields)
    problems: list[Problem] = []
    values = read_toml(DEFAULT_CONFIG_FILE)
    if config_file is not None:
        path = Path(config_file)
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as exc:
            problems.append(Problem("--config", f"cannot read {path}: {exc.strerror or exc}"))
        except UnicodeDecodeError as exc:
            problems.append(Problem(str(path), f"not valid TOML: not UTF-8 ({exc.reason})"))
        else:
            try:
                from_file = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                problems.append(Problem(str(path), f"not valid TOML: {exc}"))
            else:
                lines = text.splitlines()
                for key, value in from_file.items():
                    origins.files[key] = key_in_file(path, lines, key)
                    if key in Settings.model_fields:
                        values[key] = value
                    else:
                        problems.append(
                            Problem(
                                origins.files[key],
                                "no such setting" + did_you_mean(key, list(Settings.model_fields)),
                            )
                        )
    given = {name: value for name, value in overrides.items() if value is not None}
    origins.given = set(given)
    settings: Settings | None = None
    try:
        with _reading(values):
            settings = Settings(**given)
    except ValidationError as exc:
        problems.extend(origins.describe(exc))
    if settings is not None:
        problems.extend(
            Problem(origins.where(fields), message)
            for fields, message in machine_problems(settings)
        )
    if problems:
        raise ConfigError(problems)
    assert settings is not None
    return settings


def machine_problems(settings: Settings) -> list[tuple[tuple[str, ...], str]]:
    """What start-up would find wrong on this machine with valid values: files that cannot be
    read, TLS material that does not load, the Kubernetes client missing, too many workers for
    the instance id. ``(settings involved, message)`` pairs."""
    found: list[tuple[tuple[str, ...], str]] = []
    s = settings
    if s.redis_password_file:
        try:
            text = Path(s.redis_password_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            found.append((("redis_password_file",), _cannot_read(s.redis_password_file, exc)))
        else:
            if not (text.splitlines() or [""])[0]:
                found.append(
                    (("redis_password_file",), f"{s.redis_password_file}: the first line is empty")
                )
    if s.redis_tls_ca_file:
        try:
            ssl.create_default_context(cafile=s.redis_tls_ca_file)
        except (OSError, ssl.SSLError, ValueError) as exc:
            found.append((("redis_tls_ca_file",), _cannot_load(s.redis_tls_ca_file, exc)))
    if s.redis_tls_cert_file:
        try:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.load_cert_chain(s.redis_tls_cert_file, s.redis_tls_key_file or None)
        except (OSError, ssl.SSLError, ValueError) as exc:
            names = ("redis_tls_cert_file", "redis_tls_key_file")
            shown = s.redis_tls_cert_file + (
                f" and {s.redis_tls_key_file}" if s.redis_tls_key_file else ""
            )
            found.append((names[: 2 if s.redis_tls_key_file else 1], _cannot_load(shown, exc)))
    if s.discovery_kubernetes_service and not kubernetes_client_installed():
        found.append((("discovery_kubernetes_service",), KUBERNETES_CLIENT_MISSING))
    if s.workers != 1:
        count = process_count(s.workers)
        if s.instance_id and s.instance_id + count - 1 > U64_MAX:
            message = f"instance_id + {count - 1} (the workers after the first) exceeds a u64"
            found.append((("instance_id", "workers"), message))
    return found


def kubernetes_client_installed() -> bool:
    """The optional Kubernetes client imports (the ``[kubernetes]`` extra)."""
    try:
        import kubernetes_asyncio  # noqa: F401
    except ImportError:
        return False
    return True


def _cannot_read(path: str, exc: Exception) -> str:
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"cannot read {path}: {why}"


def _cannot_load(path: str, exc: Exception) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError) and exc.strerror:
        return f"cannot read {path}: {exc.strerror}"
    return f"cannot load {path}: {exc}"


def unknown_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each ``SLOT_TRACKER_*`` variable that names no setting (a typo such as
    ``SLOT_TRACKER_PROT`` would otherwise be ignored without a word), with the closest name."""
    environ = os.environ if environ is None else environ
    fields = list(Settings.model_fields)
    warnings = []
    for name in sorted(environ):
        upper = name.upper()
        field = upper.removeprefix(ENV_PREFIX).lower()
        if upper.startswith(ENV_PREFIX) and field not in Settings.model_fields:
            close = difflib.get_close_matches(field, fields, n=1)
            hint = f" (did you mean {ENV_PREFIX}{close[0].upper()}?)" if close else ""
            warnings.append(f"{name} is set but names no setting; it is ignored{hint}")
    return warnings
