"""Service settings.

Sources, lowest precedence first:

1. ``config/default.toml`` (the class defaults below mirror it, so an installed package
   without the file behaves the same);
2. the TOML file given with ``--config FILE``;
3. ``SLOT_TRACKER_*`` environment variables (``SLOT_TRACKER_PORT=9000``);
4. explicit overrides (keyword arguments, e.g. from command-line flags).

Use :func:`load_settings`; ``Settings()`` alone reads sources 1, 3 and 4.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kv_slot_tracker.core.limits import DEFAULT_MAX_TRACKERS, MAX_DP_SIZE, MAX_NAME_LENGTH
from kv_slot_tracker.core.selection.pending import DEFAULT_MAX_BYTES as PENDING_MAX_BYTES
from kv_slot_tracker.core.sequences import CHECK_EXPIRY_FREQUENCY_NS, EXPIRY_DURATION_NS
from kv_slot_tracker.core.types import NS_PER_S, U32_MAX, U64_MAX

ENV_PREFIX = "SLOT_TRACKER_"
DEFAULT_CONFIG_FILE = Path(__file__).resolve().parent.parent / "config" / "default.toml"

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]

# TOML files read by the settings being built now, lowest precedence first. A context variable
# rather than a class attribute, so building settings never leaks into another build.
_config_files: ContextVar[tuple[Path, ...]] = ContextVar(
    "_config_files", default=(DEFAULT_CONFIG_FILE,)
)


MAX_INDEXER_PEERS = 16


def peer_urls(value: str) -> list[str]:
    """The base URLs of ``indexer_peers`` (comma-separated), without a trailing slash."""
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


class ConfigFileError(ValueError):
    """A configuration file that is not valid TOML; the message names the file."""


def read_toml(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigFileError(f"{path}: not valid TOML: {exc}") from None


class _TomlFilesSource(PydanticBaseSettingsSource):
    """Top-level keys of several TOML files; a later file overrides an earlier one."""

    def __init__(self, settings_cls: type[BaseSettings], files: Sequence[Path]) -> None:
        super().__init__(settings_cls)
        self._values: dict[str, Any] = {}
        for path in files:
            if path.is_file():
                self._values.update(read_toml(path))

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


class Settings(BaseSettings):
    """Every setting of the service; see ``config/default.toml`` for what each one means."""

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
    access_log: bool = False
    max_body_bytes: int = Field(default=2_097_152, gt=0)
    max_hashes_per_request: int = Field(default=1_048_576, gt=0)
    max_batch_operations: int = Field(default=10_000, gt=0)
    max_trackers: int = Field(default=DEFAULT_MAX_TRACKERS, gt=0)
    # Serve the hot routes inside uvicorn's connection callbacks (kv_slot_tracker.http.direct); false keeps
    # every request on the ASGI path.
    http_direct: bool = True
    # Server processes on the one port, sharing one state (kv_slot_tracker.workers); "auto" = the cores this
    # process may use (CPU affinity and cgroup quota).
    workers: int | Literal["auto"] = 1
    # How those processes share their state when no Redis is configured: "local" = a hub in the
    # supervisor, over a Unix socket (kv_slot_tracker.replication.local); "redis" = a private
    # redis-server. With a Redis configured the processes always use it.
    workers_transport: Literal["local", "redis"] = "local"
    # Limits of one connection and of the server (kv_slot_tracker.http.connection)
    http_max_header_bytes: int = Field(default=65_536, gt=0)
    http_header_timeout_seconds: int = Field(default=10, gt=0)
    http_body_timeout_seconds: int = Field(default=30, gt=0)
    http_keep_alive_seconds: int = Field(default=5, gt=0)
    http_max_connections: int = Field(default=4096, gt=0)

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
    router_overlap_score_credit: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    router_overlap_score_credit_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    router_prefill_load_scale: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    router_decode_active_request_weight: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    router_temperature: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    router_track_prefill_tokens: bool = True
    router_ttl_seconds: float = Field(default=120.0, ge=0, allow_inf_nan=False)
    router_use_kv_events: bool = True
    session_affinity_ttl_seconds: float = Field(default=0.0, ge=0, le=86_400, allow_inf_nan=False)
    kv_events_max_message_bytes: int = Field(default=64 << 20, ge=1024, le=1 << 30)
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

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        schemes = ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")
        if value and not value.startswith(schemes):
            raise ValueError("must be empty or start with " + ", ".join(schemes))
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
        """Rules between settings, checked at start rather than discovered in production."""
        if self.tombstone_ttl_seconds < self.expiry_seconds:
            raise ValueError(
                f"tombstone_ttl_seconds ({self.tombstone_ttl_seconds}) must be at least "
                f"expiry_seconds ({self.expiry_seconds}): a late add of a freed id would come "
                "back to life after its tombstone went"
            )
        if self.expiry_check_seconds > self.expiry_seconds:
            raise ValueError(
                f"expiry_check_seconds ({self.expiry_check_seconds}) must be at most "
                f"expiry_seconds ({self.expiry_seconds})"
            )
        return self

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
        return (init_settings, env_settings, _TomlFilesSource(settings_cls, _config_files.get()))


@contextmanager
def _reading(files: tuple[Path, ...]) -> Iterator[None]:
    token = _config_files.set(files)
    try:
        yield
    finally:
        _config_files.reset(token)


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from defaults < ``config_file`` < environment < ``overrides``.

    Overrides whose value is ``None`` are ignored, so unset command-line flags can be passed
    through as they are. A ``config_file`` that does not exist raises ``FileNotFoundError``.
    """
    files = [DEFAULT_CONFIG_FILE]
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        files.append(path)
    given = {name: value for name, value in overrides.items() if value is not None}
    with _reading(tuple(files)):
        return Settings(**given)


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


def describe_config_error(exc: Exception) -> str:
    """One line per problem, naming the setting, without pydantic's links or secret values."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    lines = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(part) for part in err.get("loc", ())) or "settings"
        message = err["msg"].removeprefix("Value error, ")
        shown = err.get("input")
        secret = "key" in where or "password" in where or "url" in where
        given = (
            "" if secret or isinstance(shown, dict) or where == "settings" else f" (got {shown!r})"
        )
        lines.append(f"{where}: {message}{given}")
    return "\n".join(lines)
