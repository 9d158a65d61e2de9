"""A KV-event publisher speaking the engines' framing, in the test's process.

As vLLM's and SGLang's ``ZmqEventPublisher`` define it: a PUB socket sends ``[topic, seq (8 bytes,
big-endian), msgpack payload]`` per batch and keeps the batch in a replay buffer; a ROUTER socket
answers a DEALER's ``[b"", start (8 bytes)]`` with ``[b"", topic, seq, payload]`` for every
buffered batch from ``start`` on, then ``[b"", b"", -1 (8 bytes, signed), b""]``. ``legacy``
answers in the 3-frame form ``[b"", seq, payload]`` older publishers used.

The PUB socket is used from the test's thread only; the ROUTER is served by a thread of its own.
Both bind on 127.0.0.1 port 0 (the socket that bound keeps the port) or on an ipc path.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BS = 4
TOKENS = list(range(100, 164))  # sixteen blocks of BS tokens


def stored(hashes: list[int], first: int, parent: int | None = None) -> list:
    """A ``BlockStored`` as vLLM's tagged array: blocks ``first .. first+len-1`` of ``TOKENS``."""
    tokens = TOKENS[first * BS : (first + len(hashes)) * BS]
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU", None]


def removed(hashes: list[int]) -> list:
    return ["BlockRemoved", hashes, "GPU"]


def chain(n: int, base: int = 1) -> list[list]:
    """``n`` one-block stores of hashes ``base, base+1, ...``, each under the previous."""
    return [[stored([base + i], i, None if i == 0 else base + i - 1)] for i in range(n)]


class FakeEngine:
    def __init__(
        self,
        ctx: zmq.Context,
        *,
        topic: bytes = b"",
        dp_rank: int | None = 0,
        ipc_dir: str | None = None,
        replay: bool = True,
        legacy: bool = False,
        buffer_steps: int = 10_000,
    ) -> None:
        self.ctx, self.topic, self.dp_rank, self.legacy = ctx, topic, dp_rank, legacy
        self.buffer_steps = buffer_steps
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.next_seq = 0
        self.ipc_dir = ipc_dir
        self.pub = self._bind_pub()
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind("tcp://127.0.0.1:0")
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    def _bind_pub(self) -> zmq.Socket:
        # an XPUB sends exactly what a PUB does; it also shows the test each subscription
        pub = self.ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        pub.bind(f"ipc://{self.ipc_dir}/pub" if self.ipc_dir else "tcp://127.0.0.1:0")
        return pub

    # -- publishing --------------------------------------------------------------------------

    def payload(self, events: list, dp_rank: Any = "default") -> bytes:
        rank = self.dp_rank if dp_rank == "default" else dp_rank
        return msgpack.packb([0.0, events, rank])

    def publish(
        self, events: list, *, send: bool = True, seq: int | None = None, dp_rank: Any = "default"
    ) -> int:
        """Publish the next batch (or batch ``seq``); ``send=False`` only buffers it (lost on the
        wire, still in the replay buffer)."""
        if seq is None:
            seq, self.next_seq = self.next_seq, self.next_seq + 1
        payload = self.payload(events, dp_rank)
        with self.lock:
            self.buffer.append((seq, payload))
            del self.buffer[: -self.buffer_steps]
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Until a subscriber's subscription reached the PUB socket (what it sends from then on
        is delivered). An unsubscription read first (a subscriber that closed its socket, as
        a listener does before it reconnects) is passed over."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pub.poll(int(left * 1000)):
                raise AssertionError(f"nobody subscribed to {self.endpoint} in {timeout} s")
            frame = self.pub.recv()
            if frame[:1] == b"\x01":
                return
            assert frame[:1] == b"\x00", frame  # an unsubscription, nothing else

    def raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def forget(self, upto: int) -> None:
        """Drop batches below ``upto`` from the replay buffer (it no longer reaches back)."""
        with self.lock:
            self.buffer = [(s, p) for s, p in self.buffer if s >= upto]

    def restart(self) -> None:
        """An engine restart: numbering from 0 again, an empty buffer (same sockets)."""
        with self.lock:
            self.buffer.clear()
        self.next_seq = 0

    def kill_pub(self) -> None:
        """Close the PUB socket (the connection drops); ``revive_pub`` binds it again."""
        self.pub.close(0)

    def revive_pub(self) -> None:
        assert self.ipc_dir is not None, "only an ipc endpoint can be bound again"
        self.pub = self._bind_pub()

    # -- the ROUTER ---------------------------------------------------------------------------

    def _serve(self, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(20):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start = frames
                start_seq = int.from_bytes(start, "big")
                self.replay_requests.append(start_seq)
                with self.lock:
                    batches = [(s, p) for s, p in self.buffer if s >= start_seq]
                for s, p in batches:
                    if self.legacy:
                        router.send_multipart([client, b"", s.to_bytes(8, "big"), p])
                    else:
                        router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
                if self.legacy:
                    router.send_multipart([client, b"", END_SEQ, b""])
                else:
                    router.send_multipart([client, b"", b"", END_SEQ, b""])
        finally:
            router.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.pub.close(0)
