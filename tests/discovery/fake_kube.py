"""A fake Kubernetes API server: list and watch of ``discovery.k8s.io/v1`` EndpointSlices in one
namespace, over real HTTP, as the API server answers them.

* ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=k=v&limit=N``:
  an ``EndpointSliceList`` with ``metadata.resourceVersion``, paged by ``limit`` (and at most
  ``page_size``) with ``metadata.continue`` tokens;
* the same with ``watch=true&resourceVersion=RV``: a chunked stream of JSON lines, one event
  (``ADDED``, ``MODIFIED``, ``DELETED``) per change after RV, then each new change, until
  ``timeoutSeconds``; an RV older than the kept history gets an ``ERROR`` event with a 410
  Status, as a compacted etcd answers;
* ``GET /api/v1/namespaces/NS/pods/NAME``: a pod put with :meth:`put_pod` (404 otherwise, or
  403 for every pod while ``pods_forbidden``, as without RBAC on pods); ``pod_reads`` counts;
* a bearer token is required (401 otherwise), so the client must have read the kubeconfig.

The test changes slices with :meth:`put` and :meth:`delete`, cuts every open watch mid-stream
with :meth:`drop_watches`, and forgets the history with :meth:`compact`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

API = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
PODS = "/api/v1/namespaces/{ns}/pods/"


def endpoint(pod: str, ready: bool | None = True, ip: str = "10.0.0.1") -> dict[str, Any]:
    conditions: dict[str, Any] = {} if ready is None else {"ready": ready, "serving": ready}
    return {
        "addresses": [ip],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "name": pod, "namespace": "ns1", "uid": f"uid-{pod}"},
    }


class FakeKubeApi:
    def __init__(self, namespace: str = "ns1", token: str = "secret-token") -> None:
        self.namespace = namespace
        self.token = token
        self.page_size = 2
        self.cond = threading.Condition()
        self.version = 1000
        self.slices: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest = self.version  # a watch from below this is told 410 Gone
        self.lists = 0
        self.watches: list[str] = []  # the resourceVersion each watch asked for
        self.unauthorized = 0
        self.refusing = False  # answer every call 401, as for a token not accepted
        self.garbled_lists = 0  # answer this many lists with a body that is no EndpointSliceList
        self._watch_sockets: set[socket.socket] = set()
        self._generation = 0  # bumped by drop_watches: every open watch ends
        self.pods: dict[str, dict[str, Any]] = {}
        self.pod_reads: list[str] = []
        self.pods_forbidden = False
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop_watches()
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": self.token}}],
                    "contexts": [
                        {
                            "name": "fake",
                            "context": {
                                "cluster": "fake",
                                "user": "tester",
                                "namespace": self.namespace,
                            },
                        }
                    ],
                    "current-context": "fake",
                }
            )
        )
        return path

    # -- changes ----------------------------------------------------------------------------

    def put(
        self,
        name: str,
        endpoints: list[dict[str, Any]],
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        ports: list[dict[str, Any]] | None = None,
    ) -> int:
        """Create or replace a slice (``ports``: its ports, by default one named ``http``);
        returns its new resourceVersion."""
        with self.cond:
            self.version += 1
            kind = "MODIFIED" if name in self.slices else "ADDED"
            meta: dict[str, Any] = {
                "name": name,
                "namespace": self.namespace,
                "resourceVersion": str(self.version),
                "labels": dict(labels or {}),
            }
            if annotations:
                meta["annotations"] = dict(annotations)
            obj = {
                "kind": "EndpointSlice",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": meta,
                "addressType": "IPv4",
                "endpoints": endpoints,
                "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]
                if ports is None
                else ports,
            }
            self.slices[name] = obj
            self.history.append((self.version, kind, copy.deepcopy(obj)))
            self.cond.notify_all()
            return self.version

    def put_pod(
        self,
        name: str,
        annotations: dict[str, str] | None = None,
        ports: dict[str, int] | None = None,
        uid: str | None = None,
    ) -> None:
        """A pod with these annotations and named container ports (uid as ``endpoint`` gives)."""
        container_ports = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in (ports or {}).items()]  # fmt: skip
        with self.cond:
            self.pods[name] = {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "uid": uid or f"uid-{name}",
                    "annotations": dict(annotations or {}),
                },
                "spec": {"containers": [{"name": "engine", "ports": container_ports}]},
            }

    def delete(self, name: str) -> int:
        with self.cond:
            self.version += 1
            obj = self.slices.pop(name)
            obj["metadata"]["resourceVersion"] = str(self.version)
            self.history.append((self.version, "DELETED", obj))
            self.cond.notify_all()
            return self.version

    def inject(self, line: bytes) -> None:
        """Send ``line`` as it is on every watch, as if it were an event (input to survive)."""
        with self.cond:
            self.version += 1
            self.history.append((self.version, "RAW", {"raw": line}))
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget the history: a watch from any version seen so far is told 410 Gone."""
        with self.cond:
            self.history.clear()
            self.oldest = self.version + 1

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream (no final chunk)."""
        with self.cond:
            self._generation += 1
            for sock in list(self._watch_sockets):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self.cond.notify_all()

    def open_watches(self) -> int:
        with self.cond:
            return len(self._watch_sockets)

    # -- serving ----------------------------------------------------------------------------

    def _selected(self, obj: dict[str, Any], selector: str) -> bool:
        labels = obj["metadata"].get("labels") or {}
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if fake.refusing or self.headers.get("Authorization") != f"Bearer {fake.token}":
                    fake.unauthorized += 1
                    self._json(401, {"kind": "Status", "code": 401, "reason": "Unauthorized"})
                    return
                url = urlsplit(self.path)
                pods = PODS.format(ns=fake.namespace)
                if url.path.startswith(pods):
                    name = url.path.removeprefix(pods)
                    with fake.cond:
                        fake.pod_reads.append(name)
                        pod = copy.deepcopy(fake.pods.get(name))
                    if fake.pods_forbidden:
                        self._json(403, {"kind": "Status", "code": 403, "reason": "Forbidden"})
                    elif pod is None:
                        self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    else:
                        self._json(200, pod)
                    return
                if url.path != API.format(ns=fake.namespace):
                    self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    return
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                selector = query.get("labelSelector", "")
                if query.get("watch") in ("true", "1", "True"):
                    self._watch(selector, query)
                else:
                    self._list(selector, query)

            def _list(self, selector: str, query: dict[str, str]) -> None:
                with fake.cond:
                    fake.lists += 1
                    if fake.garbled_lists:
                        fake.garbled_lists -= 1
                        self._json(200, {"kind": "Status", "items": "not a list"})
                        return
                    items = [
                        copy.deepcopy(o)
                        for _, o in sorted(fake.slices.items())
                        if fake._selected(o, selector)
                    ]
                    version = str(fake.version)
                start = int(query.get("continue") or 0)
                size = min(int(query.get("limit") or fake.page_size), fake.page_size)
                meta: dict[str, Any] = {"resourceVersion": version}
                if start + size < len(items):
                    meta["continue"] = str(start + size)
                self._json(
                    200,
                    {
                        "kind": "EndpointSliceList",
                        "apiVersion": "discovery.k8s.io/v1",
                        "metadata": meta,
                        "items": items[start : start + size],
                    },
                )

            def _chunk(self, event: dict[str, Any]) -> None:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _watch(self, selector: str, query: dict[str, str]) -> None:
                since = int(query.get("resourceVersion") or 0)
                timeout = float(query.get("timeoutSeconds") or 300)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                with fake.cond:
                    fake.watches.append(query.get("resourceVersion", ""))
                    fake._watch_sockets.add(self.connection)
                    generation = fake._generation
                try:
                    if since < fake.oldest - 1:
                        self._chunk(
                            {
                                "type": "ERROR",
                                "object": {
                                    "kind": "Status",
                                    "apiVersion": "v1",
                                    "status": "Failure",
                                    "message": f"too old resource version: {since}",
                                    "reason": "Expired",
                                    "code": 410,
                                },
                            }
                        )
                        self.wfile.write(b"0\r\n\r\n")
                        return
                    sent = since
                    deadline = timeout
                    while deadline > 0:
                        with fake.cond:
                            pending = [h for h in fake.history if h[0] > sent]
                            if not pending and fake._generation == generation:
                                fake.cond.wait(0.2)
                                deadline -= 0.2
                                continue
                            if fake._generation != generation:
                                return  # dropped: the socket is already shut down
                        for version, kind, obj in pending:
                            if kind == "RAW":
                                data = obj["raw"] + b"\n"
                                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                            elif fake._selected(obj, selector):
                                self._chunk({"type": kind, "object": obj})
                            sent = version
                    self.wfile.write(b"0\r\n\r\n")  # the server's timeout: a clean end
                except OSError:
                    pass
                finally:
                    with fake.cond:
                        fake._watch_sockets.discard(self.connection)
                    self.close_connection = True

        return Handler
