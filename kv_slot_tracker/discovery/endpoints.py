"""EndpointSlices read into workers, and the set of workers they make, kept per slice.

Pure: no asyncio, no client library. An EndpointSlice arrives as the Kubernetes API sends it
(a JSON object, ``discovery.k8s.io/v1``) and is input like any request body: what does not fit
is counted and skipped, never fatal.

Each endpoint is one worker. What a worker is registered as:

* ``model_name``, ``routing_group``, ``block_size``, ``dp_start``, ``dp_size``: the slice's
  annotation ``kv-slot-tracker/model-name`` (``routing-group``, ``block-size``, ``dp-start``,
  ``dp-size``), else its label of that name (the EndpointSlice controller copies the Service's
  labels onto its slices, so labelling the Service is enough), else the setting
  (``discovery_kubernetes_model_name``, ...);
* ``worker_id``: from the endpoint's pod (``targetRef.name``, else ``hostname``): ``ordinal``
  takes the number ending the name (a StatefulSet's pod ``vllm-3`` is worker 3), ``hash`` a
  stable 63-bit hash of ``namespace/name`` that every instance computes alike
  (:func:`pod_hash`).

An endpoint counts while its ``conditions.ready`` is not false (Kubernetes: an unset condition
means ready). A pod listed by several slices (one per address family) is one worker, wanted
while any slice lists it ready.

**Selection workers.** With ``api`` = ``selection`` (the slice's ``kv-slot-tracker/api``, else
``discovery_kubernetes_api``) a worker goes into the selection API's catalog (``/selection/
workers``) with the addresses of its endpoint: ``endpoint`` = ``http://IP:HTTP``, and per rank
``r`` of its dp ranks the KV-event publisher ``tcp://IP:(KV + r)`` (vLLM and SGLang bind rank
``r``'s publisher at the configured port + ``r``), and its replay socket ``tcp://IP:(REPLAY +
r)`` (both engines offset the replay port by the rank too): a worker of one rank gets it as
``replay_endpoint`` (as Dynamo's catalog has it), a worker of several as ``replay_endpoints``,
one per rank. Each port (``KV``, ``REPLAY``, ``HTTP``) is, first found:
the pod's annotation ``kv-slot-tracker/kv-events-port`` (``replay-port``, ``http-port``); the
pod's container port named ``kv-events`` (``kv-replay``, ``http``); the slice's annotation or
label of that annotation's name; the slice's port of that name (a Service port named so). The
pod (:class:`Pod`) is looked up by the caller (:func:`pods_wanted`); without it, the slice alone
says. No KV-event port: the worker is registered without publishers (it is ``incomplete`` while
KV events are on). No HTTP port: the slice's first port that is not a KV-event one.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from kv_slot_tracker.core.limits import MAX_DP_SIZE, MAX_NAME_LENGTH
from kv_slot_tracker.core.types import U32_MAX, U64_MAX

Key = tuple[str, str]
WorkerKey = tuple[Key, int]  # (tracker key, worker id)
WorkerIdFrom = Literal["ordinal", "hash"]

PREFIX = "kv-slot-tracker/"
FIELDS = ("model-name", "routing-group", "block-size", "dp-start", "dp-size", "api")
# For a selection worker: (annotation, port name) of its KV-event publisher, replay, HTTP ports.
KV_EVENTS = ("kv-events-port", "kv-events")
REPLAY = ("replay-port", "kv-replay")
HTTP = ("http-port", "http")
Api = Literal["slot", "selection"]
MAX_PORTS = 100  # ports of a slice or containers of a pod read; more is not one
# The API server puts at most 1,000 endpoints in a slice (100 by default); more is not a slice.
MAX_ENDPOINTS_PER_SLICE = 1000
_ORDINAL = re.compile(r"-(\d{1,20})\Z")


@dataclass(frozen=True, slots=True)
class Mapping:
    """How a slice's endpoints become workers: the settings' defaults for what a slice's
    annotations and labels do not say, and where the worker id comes from."""

    namespace: str
    worker_id_from: WorkerIdFrom = "ordinal"
    model_name: str = ""
    routing_group: str = "default"
    block_size: int = 0
    dp_start: int = 0
    dp_size: int = 1
    api: Api = "slot"


@dataclass(frozen=True, slots=True)
class Pod:
    """What a selection worker's pod says of its ports: its ``kv-slot-tracker/`` annotations
    and its named container ports."""

    uid: str
    annotations: tuple[tuple[str, str], ...] = ()
    ports: tuple[tuple[str, int], ...] = ()

    def port(self, names: tuple[str, str]) -> int | None:
        annotation, port_name = names
        for key, value in self.annotations:
            if key == PREFIX + annotation:
                return _int(value, annotation, 1, 65535)
        return dict(self.ports).get(port_name)


@dataclass(frozen=True, slots=True)
class Worker:
    model_name: str
    routing_group: str
    worker_id: int
    block_size: int
    dp_start: int
    dp_size: int
    pod: str  # the endpoint's pod (or hostname), for logs
    api: Api = "slot"
    # a selection worker's addresses: HTTP endpoint, KV-event publisher and replay per rank
    endpoint: str | None = None
    kv_events: tuple[tuple[int, str], ...] = ()
    replay: tuple[str, ...] = ()  # one per rank, from dp_start on; () = none

    @property
    def key(self) -> WorkerKey:
        return ((self.model_name, self.routing_group), self.worker_id)

    def same_ranks(self, other: Worker) -> bool:
        """Registered alike: the same ranks and, for a selection worker, the same addresses."""
        return (self.block_size, self.dp_start, self.dp_size, self.api, self.endpoint,
                self.kv_events, self.replay) == (other.block_size, other.dp_start,
                other.dp_size, other.api, other.endpoint, other.kv_events, other.replay)  # fmt: skip


@dataclass(slots=True)
class SliceRead:
    """One slice read: its name, its ready workers, and what was skipped."""

    name: str
    workers: dict[WorkerKey, Worker]
    not_ready: int = 0
    invalid: int = 0  # endpoints that could not be made a worker
    problem: str | None = None  # why, for the log (the last one met)


class InvalidSlice(ValueError):
    """An object that is not an EndpointSlice (no name): skipped whole."""


def pod_hash(namespace: str, pod: str) -> int:
    """The ``hash`` worker id of a pod: the first 8 bytes of BLAKE2b of ``namespace/pod``
    (UTF-8), big-endian, with the top bit cleared (fits a signed 64-bit integer)."""
    digest = hashlib.blake2b(f"{namespace}/{pod}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


def _meta_value(meta: dict[str, Any], field: str) -> str | None:
    for where in ("annotations", "labels"):
        values = meta.get(where)
        if isinstance(values, dict):
            value = values.get(PREFIX + field)
            if isinstance(value, str):
                return value
    return None


def _name(value: str, what: str) -> str:
    if not value or len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"{what} must be 1 to {MAX_NAME_LENGTH} characters")
    return value


def _int(value: str | int, what: str, low: int, high: int) -> int:
    if isinstance(value, str):
        if not value.isascii() or not value.isdigit() or len(value) > 20:
            raise ValueError(f"{what} {value!r} is not a whole number")
        value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{what} {value} is out of range {low}..{high}")
    return value


def slice_api(meta: dict[str, Any], mapping: Mapping) -> Api:
    api = _meta_value(meta, "api")
    if api is None:
        return mapping.api
    if api not in ("slot", "selection"):
        raise ValueError(f"api {api!r} is neither slot nor selection")
    return "selection" if api == "selection" else "slot"


def slice_config(meta: dict[str, Any], mapping: Mapping) -> tuple[str, str, int, int, int]:
    """(model_name, routing_group, block_size, dp_start, dp_size) of a slice; ValueError."""
    model = _meta_value(meta, "model-name")
    group = _meta_value(meta, "routing-group")
    block = _meta_value(meta, "block-size")
    start = _meta_value(meta, "dp-start")
    size = _meta_value(meta, "dp-size")
    return (
        _name(mapping.model_name if model is None else model, "model-name"),
        _name(mapping.routing_group if group is None else group, "routing-group"),
        _int(mapping.block_size if block is None else block, "block-size", 1, U32_MAX),
        _int(mapping.dp_start if start is None else start, "dp-start", 0, U32_MAX),
        _int(mapping.dp_size if size is None else size, "dp-size", 1, MAX_DP_SIZE),
    )


def worker_id_of(pod: str, namespace: str, source: WorkerIdFrom) -> int:
    if source == "hash":
        return pod_hash(namespace, pod)
    m = _ORDINAL.search(pod)
    if m is None:
        raise ValueError(f"pod {pod!r} has no ordinal (a name ending in -N)")
    wid = int(m.group(1))
    if wid > U64_MAX:
        raise ValueError(f"pod {pod!r}: ordinal out of range")
    return wid


def _port_number(value: Any) -> int | None:
    return value if type(value) is int and 1 <= value <= 65535 else None


def slice_ports(obj: dict[str, Any]) -> dict[str, int]:
    """The named ports of a slice (``ports``: the Service's ports, resolved); ValueError."""
    ports = obj.get("ports") or []
    if not isinstance(ports, list) or len(ports) > MAX_PORTS:
        raise ValueError("ports is not a list of at most 100 ports")
    named: dict[str, int] = {}
    for port in ports:
        number = _port_number(port.get("port")) if isinstance(port, dict) else None
        name = port.get("name") if isinstance(port, dict) else None
        if number is not None:
            named.setdefault(name if isinstance(name, str) else "", number)
    return named


def read_pod(obj: Any) -> Pod:
    """A Pod object (as the API sends it) read into its uid, annotations and named container
    ports; ValueError when it is not one."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("uid"), str):
        raise ValueError("a Pod without metadata.uid")
    uid = meta["uid"]
    raw = meta.get("annotations") or {}
    annotations = tuple(
        (k, v)
        for k, v in (raw.items() if isinstance(raw, dict) else ())
        if isinstance(k, str) and k.startswith(PREFIX) and isinstance(v, str) and len(v) <= 64
    )
    spec = obj.get("spec")
    containers = spec.get("containers") if isinstance(spec, dict) else None
    ports: dict[str, int] = {}
    for c in containers[:MAX_PORTS] if isinstance(containers, list) else ():
        for port in (c.get("ports") or [])[:MAX_PORTS] if isinstance(c, dict) else ():
            number = _port_number(port.get("containerPort")) if isinstance(port, dict) else None
            name = port.get("name") if isinstance(port, dict) else None
            if number is not None and isinstance(name, str) and name:
                ports.setdefault(name, number)
    return Pod(uid, annotations, tuple(ports.items()))


def pods_wanted(obj: Any, mapping: Mapping) -> dict[str, str]:
    """The pods (name: uid) of a selection slice's ready endpoints, whose annotations and
    container ports say the worker's addresses; empty for a slot-tracker slice."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    endpoints = obj.get("endpoints") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not isinstance(endpoints, list):
        return {}
    try:
        if slice_api(meta, mapping) != "selection":
            return {}
    except ValueError:
        return {}
    wanted: dict[str, str] = {}
    for ep in endpoints[:MAX_ENDPOINTS_PER_SLICE]:
        ref = ep.get("targetRef") if isinstance(ep, dict) else None
        if not isinstance(ref, dict) or ref.get("kind", "Pod") != "Pod":
            continue
        name, uid = ref.get("name"), ref.get("uid")
        conditions = ep.get("conditions")
        ready = not (isinstance(conditions, dict) and conditions.get("ready") is False)
        if ready and isinstance(name, str) and name and len(name) <= 253:
            wanted[name] = uid if isinstance(uid, str) else ""
    return wanted


_ADDRESS = re.compile(r"[0-9A-Za-z.:-]{1,253}\Z")


def _address(ep: dict[str, Any]) -> str:
    """The endpoint's first address, as a URL host (IPv6 in brackets); ValueError."""
    addresses = ep.get("addresses")
    first = addresses[0] if isinstance(addresses, list) and addresses else None
    if not isinstance(first, str) or not _ADDRESS.match(first):
        raise ValueError("an endpoint without a usable address")
    return f"[{first}]" if ":" in first else first


def _selection_fields(
    ep: dict[str, Any],
    pod: Pod | None,
    meta: dict[str, Any],
    named: dict[str, int],
    dp_start: int,
    dp_size: int,
) -> dict[str, Any]:
    """A selection worker's addresses (module notes); ValueError for a bad port or address."""

    def port(names: tuple[str, str]) -> int | None:
        found = pod.port(names) if pod is not None else None
        if found is None:
            value = _meta_value(meta, names[0])
            found = _int(value, names[0], 1, 65535) if value is not None else None
        return found if found is not None else named.get(names[1])

    host = _address(ep)
    kv, replay, http = port(KV_EVENTS), port(REPLAY), port(HTTP)
    if http is None:
        http = next((n for k, n in named.items() if k not in (KV_EVENTS[1], REPLAY[1])), None)
    ranks = range(dp_start, dp_start + dp_size)
    if any(p is not None and p + ranks[-1] > 65535 for p in (kv, replay)):
        raise ValueError("a KV-event or replay port + dp rank beyond 65535")
    return {
        "endpoint": f"http://{host}:{http}" if http is not None else None,
        "kv_events": tuple((r, f"tcp://{host}:{kv + r}") for r in ranks) if kv is not None else (),
        "replay": tuple(f"tcp://{host}:{replay + r}" for r in ranks) if replay is not None else (),
    }  # fmt: skip


def read_slice(obj: Any, mapping: Mapping, pods: dict[str, Pod] | None = None) -> SliceRead:
    """The ready workers of one EndpointSlice object; InvalidSlice when it has no name.
    ``pods``: the pods of a selection slice (:func:`pods_wanted`) by name, as looked up."""
    meta: Any = obj.get("metadata") if isinstance(obj, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidSlice("an EndpointSlice without metadata.name")
    endpoints = obj.get("endpoints")
    if endpoints is None:
        endpoints = []  # the API omits an empty list
    out = SliceRead(name, {})
    if not isinstance(endpoints, list):
        out.invalid, out.problem = 1, "endpoints is not a list"
        return out
    if len(endpoints) > MAX_ENDPOINTS_PER_SLICE:
        out.invalid = len(endpoints)
        out.problem = f"more than {MAX_ENDPOINTS_PER_SLICE} endpoints"
        return out
    try:
        model, group, block, start, size = slice_config(meta, mapping)
        api = slice_api(meta, mapping)
        named = slice_ports(obj) if api == "selection" else {}
    except ValueError as e:
        out.invalid, out.problem = len(endpoints), str(e)
        return out
    namespace = meta.get("namespace")
    if not isinstance(namespace, str) or not namespace:
        namespace = mapping.namespace
    for ep in endpoints:
        try:
            pod, ready = _endpoint(ep)
            if not ready:
                out.not_ready += 1
                continue
            wid = worker_id_of(pod, namespace, mapping.worker_id_from)
            extra = (
                _selection_fields(ep, (pods or {}).get(pod), meta, named, start, size)
                if api == "selection"
                else {}
            )
        except ValueError as e:
            out.invalid += 1
            out.problem = str(e)
            continue
        w = Worker(model, group, wid, block, start, size, pod, api, **extra)
        out.workers[w.key] = w
    return out


def _endpoint(ep: Any) -> tuple[str, bool]:
    """(pod name, ready) of one endpoint; ValueError when it names no pod."""
    if not isinstance(ep, dict):
        raise ValueError("an endpoint that is not an object")
    conditions = ep.get("conditions")
    ready = not (isinstance(conditions, dict) and conditions.get("ready") is False)
    ref = ep.get("targetRef")
    pod = ref.get("name") if isinstance(ref, dict) else None
    if not isinstance(pod, str) or not pod:
        pod = ep.get("hostname")
    if not isinstance(pod, str) or not pod or len(pod) > 253:
        raise ValueError("an endpoint with neither targetRef.name nor hostname")
    return pod, ready


class DiscoveredSet:
    """The workers the slices want, at most ``max_workers`` of them.

    Per slice, the workers it lists ready; per worker, the slices listing it (the last one put
    gives its ranks). Putting a slice costs O(its endpoints); a worker that would exceed the cap
    is skipped and counted, and ``room_made`` tells when one has gone since, so that the caller
    lists everything again to admit it."""

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers
        self._slices: dict[str, dict[WorkerKey, Worker]] = {}
        self._holders: dict[WorkerKey, dict[str, Worker]] = {}
        self.over_cap = 0  # workers skipped for the cap, counted at every put
        self._skipped = False

    def __len__(self) -> int:
        return len(self._holders)

    def __iter__(self) -> Iterator[WorkerKey]:
        return iter(self._holders)

    @property
    def room_made(self) -> bool:
        return self._skipped and len(self._holders) < self.max_workers

    def wanted(self, key: WorkerKey) -> Worker | None:
        holders = self._holders.get(key)
        return next(reversed(holders.values())) if holders else None

    def put(self, name: str, workers: dict[WorkerKey, Worker]) -> set[WorkerKey]:
        """The slice ``name`` now lists ``workers`` ready; returns the workers touched."""
        holders: dict[str, Worker] | None
        touched = set(self._slices.pop(name, ()))
        for key in touched:
            holders = self._holders[key]
            del holders[name]
            if not holders:
                del self._holders[key]
        kept: dict[WorkerKey, Worker] = {}
        for key, w in workers.items():
            holders = self._holders.get(key)
            if holders is None:
                if len(self._holders) >= self.max_workers:
                    self.over_cap += 1
                    self._skipped = True
                    continue
                holders = self._holders[key] = {}
            holders[name] = w
            kept[key] = w
        if kept:
            self._slices[name] = kept
        touched.update(kept)
        return touched

    def delete(self, name: str) -> set[WorkerKey]:
        return self.put(name, {})

    def clear(self) -> set[WorkerKey]:
        """Forget every slice (before a new full list); returns the workers that were wanted."""
        touched = set(self._holders)
        self._slices.clear()
        self._holders.clear()
        self._skipped = False
        return touched
