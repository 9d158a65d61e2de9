"""How many processes ``workers`` means, the setting's forms, and the supervisor's restarts
(``kv_slot_tracker.supervisor``; with sleeping processes in place of servers)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kv_slot_tracker.config_sources import ConfigError
from kv_slot_tracker.cores import process_count, usable_cores
from kv_slot_tracker.settings import WORKERS_TRANSPORT_REDIS_REMOVED, load_settings
from kv_slot_tracker.supervisor import (
    RESTART_DELAY_S,
    ProcessSlot,
    Supervisor,
    control_socket_index,
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


def test_process_count() -> None:
    assert process_count(1) == 1
    assert process_count(3) == 3
    assert 1 <= process_count("auto") <= AFFINITY


@pytest.mark.parametrize(("given", "value"), [("auto", "auto"), ("AUTO", "auto"), ("2", 2), (4, 4)])
def test_workers_setting_forms(given: object, value: object) -> None:
    assert load_settings(workers=given).workers == value


@pytest.mark.parametrize("given", [0, "0", "-1", "many", 1.5])
def test_workers_setting_refuses_the_rest(given: object) -> None:
    with pytest.raises(ConfigError):
        load_settings(workers=given)


class Sleepers(Supervisor):
    """A supervisor whose processes sleep (``exit_at_once``: end at once) instead of serving."""

    exit_at_once = False

    def _command(self, slot: ProcessSlot) -> list[str]:
        code = "pass" if self.exit_at_once else "import time; time.sleep(60)"
        return [sys.executable, "-c", code]


def supervisor(exit_at_once: bool = False, **kwargs: object) -> Sleepers:
    s = Sleepers(host="127.0.0.1", port=0, count=2, **kwargs)
    s.exit_at_once = exit_at_once
    s.start()
    return s


def restarted(s: Supervisor, slot: ProcessSlot) -> None:
    """Supervise until ``slot`` has a process again (bounded)."""
    deadline = time.monotonic() + 10
    while slot.proc is None or slot.proc.poll() is not None:
        assert time.monotonic() < deadline, "not restarted"
        s.check()
        time.sleep(0.01)


def test_a_killed_process_is_started_again_with_its_instance_id() -> None:
    s = supervisor(instance_id=500)
    try:
        assert [w.instance_id for w in s.slots] == [500, 501]
        first = s.slots[1].proc
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        restarted(s, s.slots[1])
        again = s.slots[1].proc
        assert again is not None and again.pid != first.pid and again.poll() is None
        assert s.slots[1].restarts == 1 and s.slots[1].instance_id == 501
        assert s.slots[0].restarts == 0
    finally:
        s.stop()
    assert all(w.proc is None or w.proc.poll() is not None for w in s.slots)
    assert s.run_dir is not None and not s.run_dir.exists()


def test_random_instance_ids_are_kept_across_restarts() -> None:
    s = supervisor(instance_id=0)
    try:
        ids = [w.instance_id for w in s.slots]
        assert all(ids) and ids[0] != ids[1]
    finally:
        s.stop()


def test_a_process_dying_young_is_restarted_later_and_later() -> None:
    s = supervisor(exit_at_once=True, instance_id=1)
    try:
        slot = s.slots[0]
        for expected in (1, 2, 4):  # base, then twice as long each time
            assert slot.proc is not None
            slot.proc.wait()
            before = time.monotonic()
            s.check()  # notices: due after the delay, from its own reading of the clock
            after = time.monotonic()
            assert slot.proc is None
            # due_at = (when check() read the clock, between before and after) + the delay
            delay = expected * RESTART_DELAY_S
            assert slot.due_at - after - 1e-9 <= delay <= slot.due_at - before + 1e-9
            restarted(s, slot)
            assert slot.started_at >= slot.due_at  # not started again before it was due
        assert slot.restarts == 3 and slot.delay_s == 8 * RESTART_DELAY_S
    finally:
        s.stop()


def test_processes_get_the_listening_socket_and_their_control_socket() -> None:
    s = Supervisor(host="127.0.0.1", port=0, count=2, instance_id=7,
                   env={"SLOT_TRACKER_REDIS_SENTINELS": "s1:26379"})  # fmt: skip
    s.bind()
    s.run_dir = Path("/run/x")
    try:
        slot = ProcessSlot(1, 8)
        command = s._command(slot)
        assert command[-4:] == ["--listen-fd", str(s.sock.fileno()), "--control-socket",
                                "/run/x/process-1.sock"]  # fmt: skip
        env = s._child_env(slot)
        assert env["SLOT_TRACKER_WORKERS"] == "1"
        assert env["SLOT_TRACKER_INSTANCE_ID"] == "8"
        assert "SLOT_TRACKER_REDIS_URL" not in env  # the configured Redis, here Sentinel
        assert env["SLOT_TRACKER_REDIS_SENTINELS"] == "s1:26379"
        assert control_socket_index("/run/x/process-1.sock") == 1
    finally:
        s.sock.close()


def test_workers_transport_is_the_hub() -> None:
    assert load_settings().workers_transport == "local"
    assert load_settings(workers_transport="local").workers_transport == "local"


@pytest.mark.parametrize("given", ["redis", "Redis", " redis "])
def test_the_removed_private_redis_transport_says_what_to_use_instead(given: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(workers_transport=given)
    assert (
        str(refused.value)
        == f"--workers-transport: {WORKERS_TRANSPORT_REDIS_REMOVED} (got {given!r})"
    )
    assert 'use workers_transport = "local" (the default), or set redis_url' in str(refused.value)


@pytest.mark.parametrize("given", ["", "tcp", "Local ", "zmq"])
def test_workers_transport_refuses_the_rest(given: str) -> None:
    with pytest.raises(ConfigError):
        load_settings(workers_transport=given)


def test_without_redis_the_supervisor_runs_the_hub_and_names_it_to_its_processes() -> None:
    s = supervisor(instance_id=7, hub=True)
    try:
        assert s.hub_thread is not None and s.hub_thread.alive()
        path = s.hub_thread.path
        assert path.parent == s.run_dir and path.is_socket()
        command = Supervisor._command(s, s.slots[0])
        assert command[command.index("--hub-socket") + 1] == str(path)
        assert "--redis-url" not in command
        s.check()  # a live hub: nothing to do
        s.hub_thread.stop()  # the hub ended: the supervisor stops rather than go on without it
        with pytest.raises(RuntimeError, match="hub ended"):
            s.check()
    finally:
        s.stop()
    assert s.run_dir is not None and not s.run_dir.exists()
