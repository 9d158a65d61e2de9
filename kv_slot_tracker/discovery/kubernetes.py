"""Kubernetes EndpointSlices as a source of workers (``discovery_kubernetes_service``).

Lists the ``discovery.k8s.io/v1`` EndpointSlices of one namespace that belong to a Service
(label ``kubernetes.io/service-name``) or match a label selector, then watches them from the
list's ``resourceVersion``. Every change is read into workers (``endpoints.py``) and applied to
the service (``apply.py``) once the instance holds the shared state. For a slice of selection
workers (``api`` = ``selection``) the pods of its ready endpoints are read first (``GET`` of
each pod not seen yet, by its uid: a restarted pod is read again), for the ports their
annotations and container ports give; a pod that cannot be read (gone, or no ``get`` on pods)
is counted and its worker told by the slice alone. A watch the server ends
(its timeout, a dropped connection) is opened again from the last version seen; one whose
version is too old (410 Gone) starts over with a full list, as does an error after a backoff.

The client is ``kubernetes_asyncio`` (the ``[kubernetes]`` extra), imported only here and only
when discovery is configured: :func:`require_client` says clearly when it is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kv_slot_tracker.discovery.apply import Applier
from kv_slot_tracker.discovery.endpoints import (
    DiscoveredSet,
    InvalidSlice,
    Mapping,
    Pod,
    WorkerKey,
    pods_wanted,
    read_pod,
    read_slice,
)
from kv_slot_tracker.settings import KUBERNETES_CLIENT_MISSING, kubernetes_client_installed

if TYPE_CHECKING:
    from kv_slot_tracker.replication import Replication
    from kv_slot_tracker.service import SlotTrackerService
    from kv_slot_tracker.service.selection.service import SelectionService
    from kv_slot_tracker.settings import Settings

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_TIMEOUT_S = 300  # the server ends a watch after this long; it is opened again at once
LIST_PAGE = 500  # slices per list call
BACKOFF_S = (0.5, 30.0)  # first and longest wait after an error
_SERVICE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")


class DiscoveryUnavailable(RuntimeError):
    """Discovery is configured but cannot run here (the client library is missing)."""


def require_client() -> None:
    if not kubernetes_client_installed():
        raise DiscoveryUnavailable(KUBERNETES_CLIENT_MISSING)


def label_selector(service: str) -> str:
    """The selector of the setting: a Service name, or already a label selector."""
    if _SERVICE_NAME.match(service):
        return f"{SERVICE_NAME_LABEL}={service}"
    return service


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


@dataclass(slots=True)
class DiscoveryCounters:
    lists: int = 0  # full lists (the first one and each start-over)
    watches: int = 0  # watches opened
    events: int = 0  # watch events applied (added, modified, deleted)
    errors: int = 0  # failed list or watch calls (then a backoff)
    invalid_slices: int = 0  # slices without a name, watch lines that are no event: skipped
    invalid_endpoints: int = 0  # endpoints that could not be made a worker (bad labels, no ordinal)
    not_ready: int = 0  # not-ready endpoints seen (not registered, or removed)
    pod_reads: int = 0  # pods of selection workers read for their ports
    pod_errors: int = 0  # ... that could not be read (gone, forbidden, not a pod)


class KubernetesDiscovery:
    def __init__(
        self,
        service: SlotTrackerService,
        replication: Replication,
        *,
        selector: str,
        namespace: str,
        kubeconfig: str,
        mapping: Mapping,
        max_workers: int,
        lease_renew_s: float = 0.0,
        selection: SelectionService | None = None,
    ) -> None:
        self.service = service
        self.replication = replication
        self.selector = selector
        self.namespace = namespace  # "" until resolved at start
        self.kubeconfig = kubeconfig
        self.mapping = mapping
        self.discovered = DiscoveredSet(max_workers)
        self.applier = Applier(service, selection)
        self.pods: dict[str, Pod] = {}  # selection workers' pods read, by name
        self._core: Any = None  # the core API client (pods), made with the discovery one
        self.counters = DiscoveryCounters()
        self.lease_renew_s = lease_renew_s
        self.resource_version: str | None = None
        self.synced = False  # the last list or watch call succeeded (none failed since)
        self.last_error: str | None = None
        self._backoff = BACKOFF_S[0]  # the wait after the next error; reset by any progress
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        service: SlotTrackerService,
        replication: Replication,
        selection: SelectionService | None = None,
    ) -> KubernetesDiscovery:
        ttl = settings.worker_ttl_seconds
        return cls(
            service,
            replication,
            selector=label_selector(settings.discovery_kubernetes_service),
            namespace=settings.discovery_kubernetes_namespace,
            kubeconfig=settings.discovery_kubernetes_kubeconfig,
            mapping=Mapping(
                namespace=settings.discovery_kubernetes_namespace,
                worker_id_from=settings.discovery_kubernetes_worker_id,
                model_name=settings.discovery_kubernetes_model_name,
                routing_group=settings.discovery_kubernetes_routing_group,
                block_size=settings.discovery_kubernetes_block_size,
                dp_start=0,
                dp_size=settings.discovery_kubernetes_dp_size,
                api=settings.discovery_kubernetes_api,
            ),
            max_workers=settings.discovery_kubernetes_max_workers,
            lease_renew_s=ttl / 3 if ttl else 0.0,
            selection=selection,
        )

    # -- running ---------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run(), name="discovery-kubernetes"))
        if self.lease_renew_s > 0:
            self._tasks.append(asyncio.create_task(self._renew(), name="discovery-leases"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _run(self) -> None:
        from kubernetes_asyncio import client

        api_client = None
        try:
            while True:
                try:
                    if api_client is None:  # the configuration may be missing for a while
                        api_client = await self._api_client()
                        api = client.DiscoveryV1Api(api_client)
                        self._core = client.CoreV1Api(api_client)
                        log.info(
                            "discovery: watching EndpointSlices %s in namespace %s",
                            self.selector, self.namespace,
                        )  # fmt: skip
                    if self.resource_version is None or self.discovered.room_made:
                        await self._list(api)
                    await self._watch(api)
                except _Gone:
                    log.info("discovery: watch version too old, listing again")
                    self.resource_version = None
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the API server away, a bad answer: wait, then retry
                    self.counters.errors += 1
                    self.synced = False
                    self.last_error = f"{type(e).__name__}: {e}"
                    log.warning("discovery: %s; again in %.1f s", self.last_error, self._backoff)
                    await asyncio.sleep(self._backoff)
                    self._backoff = min(self._backoff * 2, BACKOFF_S[1])
        finally:
            if api_client is not None:
                await api_client.close()

    async def _api_client(self) -> Any:
        from kubernetes_asyncio import client, config

        configuration = client.Configuration()
        namespace = ""
        if not self.kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
            with contextlib.suppress(OSError):
                namespace = IN_CLUSTER_NAMESPACE.read_text().strip()
        else:
            path = self.kubeconfig or None
            await config.load_kube_config(config_file=path, client_configuration=configuration)
            active: Any
            with contextlib.suppress(Exception):
                _, active = config.list_kube_config_contexts(config_file=path)
                namespace = active["context"].get("namespace") or ""
        if not self.namespace:
            self.namespace = namespace or "default"
        if not self.mapping.namespace:
            self.mapping = Mapping(**{**_fields(self.mapping), "namespace": self.namespace})
        return client.ApiClient(configuration=configuration)

    async def _list(self, api: Any) -> None:
        """Every slice, page by page (each read as it comes: never more than a page held);
        then the service is made to hold exactly their workers."""
        self.counters.lists += 1
        self.resource_version = None  # a list that fails half-way is started again
        touched: set[WorkerKey] = set(self.applier.applied) | self.discovered.clear()
        token = None
        while True:
            kwargs: dict[str, Any] = {"label_selector": self.selector, "limit": LIST_PAGE}
            if token:
                kwargs["_continue"] = token
            resp = await api.list_namespaced_endpoint_slice(
                self.namespace, _preload_content=False, _request_timeout=(10, 60), **kwargs
            )
            body = json.loads(await resp.read())
            items = body.get("items") if isinstance(body, dict) else None
            meta = body.get("metadata") if isinstance(body, dict) else None
            if not isinstance(items, list) or not isinstance(meta, dict):
                raise ValueError("an EndpointSliceList without items or metadata")
            for obj in items:
                touched |= await self._put(obj)
            token = meta.get("continue")
            if not token:
                version = meta.get("resourceVersion")
                break
        if not isinstance(version, str) or not version:
            raise ValueError("an EndpointSliceList without metadata.resourceVersion")
        await self._apply(touched, force=True)
        self.resource_version = version
        self.synced = True
        self.last_error = None
        self._backoff = BACKOFF_S[0]

    async def _watch(self, api: Any) -> None:
        """Events from ``resource_version`` until the server ends the watch: one JSON object a
        line, ``{"type": ..., "object": ...}``, each checked as input."""
        self.counters.watches += 1
        resp = await api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=self.selector,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            watch=True,
            _preload_content=False,
            _request_timeout=(10, WATCH_TIMEOUT_S + 30),
        )
        try:
            # the server took the watch: what this instance holds is current
            self.synced, self.last_error, self._backoff = True, None, BACKOFF_S[0]
            while line := await resp.content.readline():
                try:
                    event = json.loads(line)
                except ValueError:
                    event = None
                kind = event.get("type") if isinstance(event, dict) else None
                obj = event.get("object") if isinstance(event, dict) else None
                if kind == "ERROR":
                    code = obj.get("code") if isinstance(obj, dict) else None
                    if code == 410:
                        raise _Gone()
                    raise ValueError(f"the watch answered an error: {obj}")
                if kind in ("ADDED", "MODIFIED"):
                    touched = await self._put(obj)
                elif kind == "DELETED":
                    touched = self._delete(obj)
                elif kind == "BOOKMARK":
                    touched = set()
                else:
                    self.counters.invalid_slices += 1  # not an event: skipped
                    continue
                if kind != "BOOKMARK":
                    self.counters.events += 1
                    await self._apply(touched)
                version = _version_of(obj)
                if version:
                    self.resource_version = version
                if self.discovered.room_made:
                    return  # a worker skipped for the cap may fit now: list again
        finally:
            resp.release()

    async def _read_pods(self, obj: Any) -> dict[str, Pod]:
        """The pods of a selection slice's ready endpoints, read when not known by uid."""
        wanted = pods_wanted(obj, self.mapping)
        for name, uid in wanted.items():
            known = self.pods.get(name)
            if known is not None and (not uid or known.uid == uid):
                continue
            self.counters.pod_reads += 1
            try:
                resp = await self._core.read_namespaced_pod(
                    name, self.namespace, _preload_content=False, _request_timeout=(10, 30)
                )
                pod = read_pod(json.loads(await resp.read()))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # gone meanwhile, forbidden, not a pod: the slice alone says
                self.counters.pod_errors += 1
                self.pods.pop(name, None)
                log.warning("discovery: pod %s not read (%s: %s)", name, type(e).__name__, e)
                continue
            if len(self.pods) >= 2 * self.discovered.max_workers:
                self.pods.clear()  # bounded: pods of workers gone are forgotten now and then
            self.pods[name] = pod
        return {name: self.pods[name] for name in wanted if name in self.pods}

    async def _put(self, obj: Any) -> set[WorkerKey]:
        pods = await self._read_pods(obj)  # none for a slot-tracker slice
        try:
            read = read_slice(obj, self.mapping, pods)
        except InvalidSlice:
            self.counters.invalid_slices += 1
            return set()
        self.counters.not_ready += read.not_ready
        if read.invalid:
            self.counters.invalid_endpoints += read.invalid
            log.warning(
                "discovery: EndpointSlice %s: %d endpoint(s) skipped: %s",
                read.name, read.invalid, read.problem,
            )  # fmt: skip
        over = self.discovered.over_cap
        touched = self.discovered.put(read.name, read.workers)
        if self.discovered.over_cap > over:
            log.warning(
                "discovery: EndpointSlice %s: %d worker(s) skipped, at the cap of %d",
                read.name, self.discovered.over_cap - over, self.discovered.max_workers,
            )  # fmt: skip
        return touched

    def _delete(self, obj: Any) -> set[WorkerKey]:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            self.counters.invalid_slices += 1
            return set()
        return self.discovered.delete(name)

    async def _apply(self, touched: set[WorkerKey], *, force: bool = False) -> None:
        """Apply once this instance holds the shared state (as the lease sweep does)."""
        while not self.replication.ready():
            await asyncio.sleep(0.05)
        self.applier.apply(self.discovered, touched, force=force)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.lease_renew_s)
            if not self.replication.ready():
                continue
            try:
                self.applier.renew()
            except Exception:  # never let the renewals die
                log.exception("discovery: lease renewal failed")


def _fields(mapping: Mapping) -> dict[str, Any]:
    return {name: getattr(mapping, name) for name in mapping.__slots__}


def _version_of(obj: Any) -> str | None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return version if isinstance(version, str) and version else None
