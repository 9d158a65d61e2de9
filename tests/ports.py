"""Loopback TCP ports for servers a test starts, safe when pytest-xdist runs tests in parallel.

Binding port 0, closing the socket and passing the number on is a race: until the server binds
it, the kernel may hand the same number to anyone asking for an ephemeral port (another worker's
``bind(0)``, any outgoing connection). Instead, each xdist worker (``PYTEST_XDIST_WORKER`` =
``gw<N>``) draws from a slice of its own below the kernel's ephemeral range, which neither
``bind(0)`` nor outgoing connections use; within the slice the numbers are handed out in turn,
each once per cycle, and only when a bind shows nothing holds it now (another run of the suite
on the same machine, a server still in TIME_WAIT). Start in the slice is random, so two runs of
the suite at once rarely walk the same numbers.
"""

from __future__ import annotations

import errno
import os
import random
import re
import socket
import threading

FIRST_PORT = 12_000  # below every usual ip_local_port_range (Linux: 32768-60999)
SLICE = 1_000  # ports per worker
SLICES = 20  # gw0 .. gw19 (gw20 shares gw0's slice, and so on)


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def worker_index() -> int:
    """0 for ``gw0`` or without xdist, N for ``gwN``."""
    m = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(m.group(1)) if m else 0


class _Slice:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = -1
        self.start = self.end = self.next = 0

    def ports(self) -> tuple[int, int]:
        start = FIRST_PORT + (worker_index() % SLICES) * SLICE
        end = min(start + SLICE, _ephemeral_floor())
        if end - start < 100:
            raise RuntimeError(f"no room for test ports below the ephemeral range at {start}")
        return start, end

    def draw(self) -> int:
        with self.lock:
            if self.pid != os.getpid():  # a forked child walks its own way
                self.pid = os.getpid()
                self.start, self.end = self.ports()
                self.next = random.randrange(self.start, self.end)
            for _ in range(self.end - self.start):
                port = self.next
                self.next = self.start + (self.next + 1 - self.start) % (self.end - self.start)
                if _bindable(port):
                    return port
        raise RuntimeError(f"every port of {self.start}..{self.end - 1} is taken")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


_SLICE = _Slice()


def free_port() -> int:
    """A loopback port nothing holds now and no other test of this run is handed."""
    return _SLICE.draw()
