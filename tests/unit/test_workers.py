"""How many processes ``workers`` means, the setting's forms, and the supervisor's restarts
(``kv_slot_tracker.workers``; with sleeping processes in place of servers)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from kv_slot_tracker.settings import load_settings
from kv_slot_tracker.workers import (
    RESTART_DELAY_S,
    Supervisor,
    Worker,
    control_socket_index,
    usable_cores,
    worker_count,
)

AFFINITY = len(os.sched_getaffinity(0))


def cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_no_cgroup_files_means_the_cpu_affinity(tmp_path: Path) -> None:
    assert usable_cores(tmp_path) == AFFINITY


def test_cgroup_v2_without_quota_means_the_cpu_affinity(tmp_path: Path) -> None:
    assert usable_cores(cgroup(tmp_path, {"cpu.max": "max 100000\n"})) == AFFINITY


@pytest.mark.parametrize(("quota", "cores"), [("50000", 1), ("100000", 1), ("150000", 2)])
def test_cgroup_v2_quota_rounds_up_and_caps(tmp_path: Path, quota: str, cores: int) -> None:
    root = cgroup(tmp_path, {"cpu.max": f"{quota} 100000\n"})
    assert usable_cores(root) == min(cores, AFFINITY)


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root = cgroup(tmp_path, {"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"})
    assert usable_cores(root) == 1
    unlimited = cgroup(tmp_path / "u", {"cpu/cpu.cfs_quota_us": "-1",
                                        "cpu/cpu.cfs_period_us": "100000"})  # fmt: skip
    assert usable_cores(unlimited) == AFFINITY


def test_worker_count() -> None:
    assert worker_count(1) == 1
    assert worker_count(3) == 3
    assert 1 <= worker_count("auto") <= AFFINITY


@pytest.mark.parametrize(("given", "value"), [("auto", "auto"), ("AUTO", "auto"), ("2", 2), (4, 4)])
def test_workers_setting_forms(given: object, value: object) -> None:
    assert load_settings(workers=given).workers == value


@pytest.mark.parametrize("given", [0, "0", "-1", "many", 1.5])
def test_workers_setting_refuses_the_rest(given: object) -> None:
    with pytest.raises(ValidationError):
        load_settings(workers=given)


class Sleepers(Supervisor):
    """A supervisor whose processes sleep (``exit_at_once``: end at once) instead of serving."""

    exit_at_once = False

    def _command(self, worker: Worker) -> list[str]:
        code = "pass" if self.exit_at_once else "import time; time.sleep(60)"
        return [sys.executable, "-c", code]


def supervisor(exit_at_once: bool = False, **kwargs: object) -> Sleepers:
    # a Redis configured: no private redis-server is started
    s = Sleepers(host="127.0.0.1", port=0, count=2, private_redis=False, **kwargs)
    s.exit_at_once = exit_at_once
    s.start()
    return s


def restarted(s: Supervisor, worker: Worker) -> None:
    """Supervise until ``worker`` has a process again (bounded)."""
    deadline = time.monotonic() + 10
    while worker.proc is None or worker.proc.poll() is not None:
        assert time.monotonic() < deadline, "not restarted"
        s.check()
        time.sleep(0.01)


def test_a_killed_process_is_started_again_with_its_instance_id() -> None:
    s = supervisor(instance_id=500)
    try:
        assert [w.instance_id for w in s.workers] == [500, 501]
        first = s.workers[1].proc
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        restarted(s, s.workers[1])
        again = s.workers[1].proc
        assert again is not None and again.pid != first.pid and again.poll() is None
        assert s.workers[1].restarts == 1 and s.workers[1].instance_id == 501
        assert s.workers[0].restarts == 0
    finally:
        s.stop()
    assert all(w.proc is None or w.proc.poll() is not None for w in s.workers)
    assert s.run_dir is not None and not s.run_dir.exists()


def test_random_instance_ids_are_kept_across_restarts() -> None:
    s = supervisor(instance_id=0)
    try:
        ids = [w.instance_id for w in s.workers]
        assert all(ids) and ids[0] != ids[1]
    finally:
        s.stop()


def test_a_process_dying_young_is_restarted_later_and_later() -> None:
    s = supervisor(exit_at_once=True, instance_id=1)
    try:
        worker = s.workers[0]
        delays = []
        for _ in range(3):
            assert worker.proc is not None
            worker.proc.wait()
            before = time.monotonic()
            s.check()  # notices: due after a delay, counted from its own reading of the clock
            assert worker.proc is None
            delays.append(worker.due_at - before)  # the delay, plus how late check() read it
            restarted(s, worker)
        # base, then twice as long each time; a loaded machine only adds to each
        for delay, expected in zip(delays, [1, 2, 4], strict=True):
            assert expected * RESTART_DELAY_S <= delay < expected * RESTART_DELAY_S + 0.5, delays
        assert worker.restarts == 3
    finally:
        s.stop()


def test_processes_get_the_listening_socket_and_their_control_socket() -> None:
    s = Supervisor(host="127.0.0.1", port=0, count=2, private_redis=False, instance_id=7,
                   env={"SLOT_TRACKER_REDIS_SENTINELS": "s1:26379"})  # fmt: skip
    s.bind()
    s.run_dir = Path("/run/x")
    try:
        worker = Worker(1, 8)
        command = s._command(worker)
        assert command[-4:] == ["--listen-fd", str(s.sock.fileno()), "--control-socket",
                                "/run/x/worker-1.sock"]  # fmt: skip
        env = s._child_env(worker)
        assert env["SLOT_TRACKER_WORKERS"] == "1"
        assert env["SLOT_TRACKER_INSTANCE_ID"] == "8"
        assert "SLOT_TRACKER_REDIS_URL" not in env  # the configured Redis, here Sentinel
        assert env["SLOT_TRACKER_REDIS_SENTINELS"] == "s1:26379"
        assert control_socket_index("/run/x/worker-1.sock") == 1
    finally:
        s.sock.close()


@pytest.mark.parametrize("given", ["local", "redis"])
def test_workers_transport_setting(given: str) -> None:
    assert load_settings(workers_transport=given).workers_transport == given


def test_workers_transport_defaults_to_the_hub() -> None:
    assert load_settings().workers_transport == "local"


@pytest.mark.parametrize("given", ["", "tcp", "Local ", "zmq"])
def test_workers_transport_refuses_the_rest(given: str) -> None:
    with pytest.raises(ValidationError):
        load_settings(workers_transport=given)


def test_without_redis_the_supervisor_runs_the_hub_and_names_it_to_its_processes() -> None:
    s = supervisor(instance_id=7, hub=True)
    try:
        assert s.hub_thread is not None and s.hub_thread.alive()
        path = s.hub_thread.path
        assert path.parent == s.run_dir and path.is_socket()
        command = Supervisor._command(s, s.workers[0])
        assert command[command.index("--hub-socket") + 1] == str(path)
        assert "--redis-url" not in command
        s.check()  # a live hub: nothing to do
        s.hub_thread.stop()  # the hub ended: the supervisor stops rather than go on without it
        with pytest.raises(RuntimeError, match="hub ended"):
            s.check()
    finally:
        s.stop()
    assert s.run_dir is not None and not s.run_dir.exists()
