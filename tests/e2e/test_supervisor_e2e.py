"""``--workers 2``: two server processes behind one port, answering as one instance.

``python -m kv_slot_tracker`` with ``workers = 2`` and no ``redis_url`` (the processes share the
supervisor's hub), durable acknowledgements. First, requests whose calls alternate between the two
processes (reached alone on their Unix sockets) right after each other: every call finds its
request, none becomes a pending mark or a tombstone. Then six clients send lifecycle calls with a new connection
for every call, so the calls of one request reach whichever process accepts each connection,
and keep a ground truth of what was acknowledged (``tests/e2e/consistency.py``). Meanwhile one
process is killed with SIGKILL; the supervisor must start it again and the new process must load
the shared state from its sibling. At the end every process, reached alone on its own Unix
socket, and the port itself report exactly the ground truth; no client saw a spurious 404 or an
undocumented 5xx; ``/replication`` and ``/metrics`` through the port cover both processes.

The same with two supervisors on one shared Redis (``redis_url`` set): 2 processes x 2 hosts,
calls alternating between the hosts' ports, a process of one host killed.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import _drop_namespace
from tests.e2e.consistency import GROUP, MODEL, Traffic, load_view, register_topology
from tests.e2e.servers import ENV_PREFIX, ServerProcess, wait_until
from tests.e2e.test_consistency import check_answers
from tests.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

CONVERGE_S = 15.0
LOCAL = {"x-slot-tracker-local": "1"}


class Children:
    """The server processes of one supervisor, found from ``/proc``: index -> (pid, the Unix
    socket where that process alone serves)."""

    def __init__(self, supervisor: ServerProcess) -> None:
        self.supervisor = supervisor

    def find(self) -> dict[int, tuple[int, str]]:
        assert self.supervisor.proc is not None
        pid = self.supervisor.proc.pid
        try:
            pids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return {}
        found = {}
        for child in pids:
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue  # ended meanwhile
            if "--control-socket" in argv:
                path = argv[argv.index("--control-socket") + 1]
                index = int(Path(path).stem.rsplit("-", 1)[1])
                found[index] = (int(child), path)
        return found

    def get(self, index: int, route: str) -> httpx.Response | None:
        found = self.find()
        if index not in found:
            return None
        transport = httpx.HTTPTransport(uds=found[index][1])
        try:
            with httpx.Client(transport=transport, base_url="http://process", timeout=5) as c:
                return c.get(route, headers=LOCAL)  # this process's own view
        except httpx.TransportError:
            return None

    def client(self, index: int) -> httpx.Client:
        """A client of process ``index`` alone (its Unix socket)."""
        transport = httpx.HTTPTransport(uds=self.find()[index][1])
        return httpx.Client(transport=transport, base_url="http://process", timeout=10)

    def counters(self, index: int, prefix: str) -> dict[str, float]:
        """This process's own metrics named ``prefix...``, by the rest of the name."""
        r = self.get(index, "/metrics")
        assert r is not None and r.status_code == 200
        return {
            s.name.removeprefix(prefix): s.value
            for f in text_string_to_metric_families(r.text)
            for s in f.samples
            if s.name.startswith(prefix) and not s.labels
        }

    def ready(self, index: int) -> bool:
        r = self.get(index, "/ready")
        return r is not None and r.status_code == 200

    def loads(self, index: int) -> list[dict[str, int]] | None:
        r = self.get(index, "/loads")
        return load_view(r.json()) if r is not None and r.status_code == 200 else None

    def status(self, index: int) -> dict:
        r = self.get(index, "/replication")
        return r.json() if r is not None else {}


def public_loads(url: str) -> list[dict[str, int]] | None:
    try:
        r = httpx.get(url + "/loads", timeout=5)  # a new connection: either process
    except httpx.TransportError:
        return None
    return load_view(r.json()) if r.status_code == 200 else None


def supervisor_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env["PYTHONUNBUFFERED"] = "1"
    base = {"WORKERS": "2", "REPLICATION_ACK": "redis", "SNAPSHOT_INTERVAL_SECONDS": "2",
            "REPLICATION_BATCH_MS": "0", "LOG_LEVEL": "info"}  # fmt: skip
    env.update({ENV_PREFIX + k: v for k, v in {**base, **settings}.items()})
    return env


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[ServerProcess]:
    """``--workers 2`` with no ``redis_url``: the supervisor's hub."""
    env = supervisor_env()
    server = ServerProcess("workers", free_port(), env, tmp_path / "workers.log")
    server.start()
    try:
        yield server
    finally:
        server.kill(signal.SIGTERM)  # the supervisor removes its run directory
        server.close()


@pytest.fixture
def two_hosts(tmp_path: Path, redis_url: str) -> Iterator[list[ServerProcess]]:
    """Two ``--workers 2`` supervisors on one Redis namespace: 2 processes x 2 hosts."""
    namespace = f"e2e-workers-{uuid.uuid4().hex[:10]}"
    env = supervisor_env(REDIS_URL=redis_url, NAMESPACE=namespace)
    hosts = [ServerProcess(f"host-{name}", free_port(), env, tmp_path / f"host-{name}.log")
             for name in "ab"]  # fmt: skip
    for host in hosts:
        host.start()
    try:
        yield hosts
    finally:
        for host in hosts:
            host.kill(signal.SIGTERM)  # the supervisor removes its run directory
            host.close()
        _drop_namespace(redis_url, namespace)


def answered(traffic: Traffic) -> int:
    """Calls the traffic's clients got a definite answer to so far (read from their threads)."""
    while True:
        try:
            return sum(traffic.tally.calls.values())
        except RuntimeError:  # an operation's first answer added its key meanwhile
            continue


def all_ready(children: Children) -> bool:
    return len(children.find()) == 2 and all(children.ready(i) for i in (0, 1))


def kill_and_wait_restart(children: Children, index: int, log_tail: Callable[[], str]) -> int:
    """SIGKILL process ``index``; wait until the supervisor started it again and it is
    ready. Returns the killed pid."""
    victim, _ = children.find()[index]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: children.find().get(index, (victim,))[0] != victim
               and children.ready(index), 30, "the killed process restarted and ready",
               0.05, log_tail)  # fmt: skip
    return victim


def test_two_processes_answer_as_one_through_a_kill(workers: ServerProcess) -> None:
    children = Children(workers)
    wait_until(lambda: all_ready(children), 30, "both processes ready", 0.05, workers.log_tail)
    register_topology(workers.url)
    wait_until(lambda: children.loads(0) == children.loads(1) and children.loads(1), 10,
               "the topology in both processes")  # fmt: skip

    # each call of a request on the other process than the one before, at once: with durable
    # acknowledgements a prefill completion of an id the read barrier proves unknown is a 404,
    # so a 200 shows that the process answering had the add its sibling acknowledged
    with children.client(0) as p0, children.client(1) as p1:
        for i in range(20):
            first, second = (p0, p1) if i % 2 == 0 else (p1, p0)
            key = {"model_name": MODEL, "routing_group": GROUP, "request_id": f"x{i}"}
            add = {**key, "worker_id": 1, "dp_rank": 0, "sequence_hashes": [i, i + 100],
                   "new_isl_tokens": 10}  # fmt: skip
            assert first.post("/add", json=add).status_code == 201
            r = second.post("/prefill_complete", json=key)
            assert r.status_code == 200, r.text
            r = first.post("/free", json=key)
            assert r.status_code == 200, r.text
        r = p1.post("/prefill_complete", json={**key, "request_id": "nowhere"})
        assert r.status_code == 404, r.text  # the check above can fail
    wait_until(lambda: children.loads(0) == children.loads(1), 10, "both processes alike")
    assert all(row["active_requests"] == 0 for row in children.loads(0) or [])
    # every call found its request: none was kept as a pending mark or a tombstone
    for index in (0, 1):
        early = children.counters(index, "kv_slot_tracker_consistency_")
        assert early["marks_created_total"] == early["tombstones_created_total"] == 0, early

    traffic = Traffic([workers.url], clients=6, seed=28, fresh_connections=True)
    traffic.start()
    try:
        wait_until(lambda: answered(traffic) >= 40, 60, "traffic before the kill")
        victim = kill_and_wait_restart(children, 1, workers.log_tail)
        restarted_at = answered(traffic)
        # the traffic goes on, through the port, with the restarted process back in
        wait_until(lambda: answered(traffic) > restarted_at + 40, 60,
                   "traffic after the restart", 0.01, lambda: str(traffic.tally.summary()))  # fmt: skip
    finally:
        traffic.stop()

    want = traffic.truth.loads()

    def describe() -> str:
        return (f"expected {want}\n0: {children.loads(0)}\n1: {children.loads(1)}\n"
                f"{children.status(0)}\n{children.status(1)}\n{traffic.tally.summary()}\n"
                f"{workers.log_tail()}")  # fmt: skip

    wait_until(lambda: children.loads(0) == want and children.loads(1) == want, CONVERGE_S,
               "the ground truth in both processes", 0.01, describe)  # fmt: skip
    for _ in range(10):  # and through the port, whichever process answers
        assert public_loads(workers.url) == want
    check_answers(traffic)

    survivor, restarted = children.status(0), children.status(1)
    assert survivor["mode"] == restarted["mode"] == "local", survivor
    # the restarted process loaded its sibling's state from the hub
    assert restarted["bootstraps"] == 1 and int(restarted["stream_position"]) > 0, restarted
    # the hub's figures (sent every second): three joins, the last with a sibling's state
    wait_until(lambda: (children.status(1).get("hub") or {}).get("joins") == 3, 5,
               "the hub's figures after the restart")  # fmt: skip
    hub = children.status(1)["hub"]
    assert hub["exports"] >= 1 and hub["processes"] == 2, hub
    # (a frame cut by the kill is possible: the process may have been writing one)
    assert hub["oversized"] == hub["resyncs"] == hub["lost_joins"] == 0, hub
    # both processes took writes: the survivor published its own records and applied its
    # siblings' (the killed process's and its successor's)
    assert survivor["published"] > 0 and survivor["applied"] > 0, survivor
    for status in (survivor, restarted):
        assert status["dropped"] == 0 and status["ready"], status
    assert survivor["instance_id"] != restarted["instance_id"]
    # the port reports the instance as one, whichever process answers
    for _ in range(4):
        whole = httpx.get(workers.url + "/replication", timeout=5).json()
        assert [w["process"] for w in whole["processes"]] == [0, 1], whole
        assert whole["processes_missing"] == [] and whole["ready"], whole
        assert whole["published"] == survivor["published"] + restarted["published"], whole
        text = httpx.get(workers.url + "/metrics", timeout=5).text
        published = {
            s.labels["process"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "kv_slot_tracker_replication_published_total"
        }
        assert published == {"0": survivor["published"], "1": restarted["published"]}, published
    log = workers.log_path.read_text()
    assert f"process 1 (pid {victim}) ended with -9" in log, workers.log_tail()

    # SIGTERM stops the processes, then the hub or the private Redis, and removes the run
    # directory
    run_dir = Path(children.find()[0][1]).parent
    workers.kill(signal.SIGTERM)
    assert "ended with 0" in workers.log_path.read_text().splitlines()[-1]
    assert not run_dir.exists()


def test_two_hosts_of_two_processes_on_one_redis(two_hosts: list[ServerProcess]) -> None:
    """With ``redis_url`` set, the processes of every supervisor are instances of that stream:
    2 hosts x 2 processes answer as one state, through a SIGKILL of a process of one host."""
    hosts = [Children(host) for host in two_hosts]
    for host, children in zip(two_hosts, hosts, strict=True):
        wait_until(lambda c=children: all_ready(c), 30, f"{host.name} ready", 0.05, host.log_tail)
    register_topology(two_hosts[0].url)

    traffic = Traffic([h.url for h in two_hosts], clients=6, seed=29, fresh_connections=True)
    traffic.start()
    try:
        wait_until(lambda: answered(traffic) >= 40, 60, "traffic before the kill")
        victim = kill_and_wait_restart(hosts[1], 0, two_hosts[1].log_tail)
        restarted_at = answered(traffic)
        wait_until(lambda: answered(traffic) > restarted_at + 40, 60,
                   "traffic after the restart", 0.01, lambda: str(traffic.tally.summary()))  # fmt: skip
    finally:
        traffic.stop()

    want = traffic.truth.loads()
    views = [(c, i) for c in hosts for i in (0, 1)]
    wait_until(lambda: all(c.loads(i) == want for c, i in views), CONVERGE_S,
               "the ground truth in the four processes", 0.01,
               lambda: f"expected {want}\n" + "\n".join(str(c.loads(i)) for c, i in views))  # fmt: skip
    check_answers(traffic)
    statuses = [c.status(i) for c, i in views]
    assert len({s["instance_id"] for s in statuses}) == 4, statuses
    assert all(s["dropped"] == 0 and s["ready"] for s in statuses), statuses
    assert f"process 0 (pid {victim}) ended with -9" in two_hosts[1].log_path.read_text()
