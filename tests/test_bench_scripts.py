"""Every benchmark script still imports against the code it measures (a renamed or moved name
breaks a script silently otherwise: benchmarks are not run by the suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))

# imports every module (their ``main`` stays behind ``if __name__ == "__main__"``) in one
# process, each on its own: a JSON line per script, its error or null
_IMPORT = """
import importlib.util, json, sys, traceback
for path in sys.argv[1:]:
    try:
        name = "bench_" + path.rsplit("/", 1)[-1][:-3]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        assert callable(getattr(module, "main", None)), f"{path} has no main()"
        error = None
    except BaseException:
        error = traceback.format_exc()[-2000:]
    print(json.dumps({"script": path.rsplit("/", 1)[-1], "error": error}), flush=True)
"""


def test_there_are_scripts() -> None:
    assert {"http_bench.py", "scaling_bench.py", "consistency_bench.py"} <= set(SCRIPTS)


@pytest.fixture(scope="module")
def imported() -> dict[str, str | None]:
    """Each script imported once, all in one process (one interpreter start, not one each)."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT, *(str(BENCH / name) for name in SCRIPTS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith('{"script"'):
            row = json.loads(line)
            results[row["script"]] = row["error"]
    assert set(results) == set(SCRIPTS), done.stderr[-2000:]
    return results


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports(name: str, imported: dict[str, str | None]) -> None:
    assert imported[name] is None, imported[name]


def test_edge_cost_runs_every_workload() -> None:
    """edge_cost's workloads (the in-process figures of bench/RESULTS.md) run on this code:
    ``direct`` asserts every call was answered by the direct protocol."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "edge_cost.py"), "--n", "20"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == [
        "lifecycle",
        "direct",
        "potential",
        "batch",
        "batch_mix",
        "batch_signed",
        "sel_reserve",
        "sel_kv",
    ]


def test_apply_cost_applies_every_record() -> None:
    """apply_cost's figures are of records that were all applied (it asserts none was
    rejected), on this code."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "apply_cost.py"), "--n", "100", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = done.stdout.splitlines()
    assert "us CPU per record (adds and frees alternating)" in line
    assert "1 rounds of 200 records" in line


def test_edge_cost_counts_opcodes_per_function() -> None:
    """``--opcodes`` traces the measured calls only: the batch's own functions are listed."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "edge_cost.py"), "--opcodes", "--only", "batch", "--n", "20"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("batch: ") and lines[0].endswith(" opcodes per operation")
    names = {line.split()[-1] for line in lines[1:]}
    assert {"sequences.py:release", "overlap.py:add", "operations.py:run_commands"} <= names
    assert not any("edge_cost.py" in name for name in names)  # nor the harness loop itself
