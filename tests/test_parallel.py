"""What lets the suite run under pytest-xdist: ``tests.ports.free_port`` (disjoint per worker,
never the same number twice in a cycle, never a port something holds) and the units and order
``tests/conftest.py`` hands the workers."""

from __future__ import annotations

import socket

import pytest

from tests import ports


def draws(monkeypatch: pytest.MonkeyPatch, worker: str, n: int) -> list[int]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setattr(ports, "_SLICE", ports._Slice())
    return [ports.free_port() for _ in range(n)]


def test_workers_draw_from_disjoint_slices_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gw0, gw1, gw7 = (draws(monkeypatch, w, 50) for w in ("gw0", "gw1", "gw7"))
    floor = ports._ephemeral_floor()
    for i, got in ((0, gw0), (1, gw1), (7, gw7)):
        start = ports.FIRST_PORT + i * ports.SLICE
        assert all(start <= p < min(start + ports.SLICE, floor) for p in got), (i, got)
        assert len(set(got)) == len(got)


def test_a_held_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    slice_ = ports._Slice()
    monkeypatch.setattr(ports, "_SLICE", slice_)
    first = ports.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 1 if first + 1 < slice_.end else slice_.start))
        held.listen()
        slice_.next = first + 1 if first + 1 < slice_.end else slice_.start  # held is next
        assert ports.free_port() != held.getsockname()[1]


def test_a_whole_cycle_hands_out_each_port_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw5")
    slice_ = ports._Slice()
    monkeypatch.setattr(ports, "_SLICE", slice_)
    monkeypatch.setattr(ports, "_bindable", lambda port: True)
    got = [ports.free_port() for _ in range(ports.SLICE)]
    assert sorted(got) == list(range(slice_.start, slice_.end))


def test_xdist_work_units() -> None:
    """What ``make test`` hands one xdist worker as a whole (tests/conftest.py)."""
    from tests.conftest import work_unit

    assert work_unit("tests/ha/test_cluster.py::test_x") == "redis-ha"
    assert work_unit("tests/e2e/test_consistency.py::test_y[redis]") == "processes"
    assert work_unit("tests/browser/test_docs.py::test_z") == "browser"
    assert work_unit("tests/api/test_docs.py::test_z") == "tests/api/test_docs.py"
    assert work_unit("tests/test_cli.py::test_a[x@y]") == "tests/test_cli.py"
    assert work_unit("tests/unit/test_a.py::test_b@mine") == "mine"


def test_the_long_units_exist() -> None:
    """Every unit named to go first is a group or a test module of the suite."""
    from tests.conftest import GROUPS, LONG_UNITS, TESTS

    for unit in LONG_UNITS:
        assert unit in GROUPS.values() or (TESTS.parent / unit).is_file(), unit
