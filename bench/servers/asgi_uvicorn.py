"""The app on uvicorn's public API only (``uvicorn.run`` with the ASGI app, httptools, uvloop):
no protocol subclass, no patched module global. For ``bench/server_cost.py``.

    python bench/servers/asgi_uvicorn.py PORT
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import uvicorn  # noqa: E402

from kv_slot_tracker.gc_tuning import tune_gc  # noqa: E402
from kv_slot_tracker.main import create_app  # noqa: E402
from kv_slot_tracker.settings import load_settings  # noqa: E402

if __name__ == "__main__":
    app = create_app(load_settings())
    tune_gc()
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
