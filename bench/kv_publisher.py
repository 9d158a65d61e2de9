"""A KV-event publisher process speaking vLLM's wire format, driven line by line over stdin.

It stands in for inference engines in tests and in the differential harness: per rank, a PUB
socket (an XPUB, which is the same on the wire, so it can tell when a subscriber has joined) and a
replay ROUTER socket behaving as vLLM's ``ZmqEventPublisher``: multipart ``(topic, seq as 8 bytes
big-endian, msgpack [ts, [events], data_parallel_rank])``, a replay buffer answering a DEALER's
``[b"", start_seq]`` with ``[b"", seq, payload]`` per buffered batch and ``[b"", -1, b""]``.

    python bench/kv_publisher.py --ranks 2 [--topic kv]

The first stdout line is ``{"endpoints": [...], "replay_endpoints": [...]}`` (bound on
127.0.0.1, free ports). Then one JSON command per stdin line, one JSON answer per stdout line:

* ``{"op": "publish", "rank": r, "events": [...], "dp_rank": r, "drop": false}`` -> ``{"seq": n}``;
  events as vLLM's tagged arrays; ``drop`` keeps the batch in the replay buffer without sending
  it (a gap the subscriber will see);
* ``{"op": "raw", "rank": r, "frames": ["hex", ...]}`` -> ``{}``: send frames as given;
* ``{"op": "bulk", "batches": [[r, [events]], ...]}`` -> ``{"published": n}``: many batches, each
  on rank r with data_parallel_rank 0 (benchmarks);
* ``{"op": "subscribers", "rank": r}`` -> ``{"subscribers": n}``: subscriptions seen so far;
* ``{"op": "restart", "rank": r}`` -> ``{}``: sequence numbers start again at 0, buffer emptied;
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Rank:
    def __init__(
        self, ctx: zmq.Context, topic: bytes, buffer_steps: int, host: str = "127.0.0.1"
    ) -> None:
        """Binds on ``host`` (an address the subscribers reach), on ports of the kernel's choice."""
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        rport = self.replay.bind_to_random_port(f"tcp://{host}")
        self.replay_endpoint = f"tcp://{host}:{rport}"
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.subscribers = 0

    def publish(self, events: list, dp_rank: int | None, drop: bool) -> int:
        seq = self.seq
        self.seq += 1
        payload = msgpack.packb([time.time(), events, dp_rank])
        self.buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def serve_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self.buffer:
            if seq >= first:
                # as the engines: [delimiter, topic, seq, payload], then the end marker
                self.replay.send_multipart(
                    [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                )
        self.replay.send_multipart([client, b"", b"", END_SEQ, b""])

    def read_subscriptions(self) -> None:
        while self.pub.poll(0):
            msg = self.pub.recv()
            if msg[:1] == b"\x01":
                self.subscribers += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--topic", default="")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    args = ap.parse_args(argv)
    ctx = zmq.Context()
    ranks = [Rank(ctx, args.topic.encode(), args.buffer_steps) for _ in range(args.ranks)]
    out = sys.stdout

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply(
        {
            "endpoints": [r.endpoint for r in ranks],
            "replay_endpoints": [r.replay_endpoint for r in ranks],
        }
    )
    poller = zmq.Poller()
    stdin = sys.stdin.fileno()
    poller.register(stdin, zmq.POLLIN)
    for r in ranks:
        poller.register(r.replay, zmq.POLLIN)
        poller.register(r.pub, zmq.POLLIN)
    pending = b""
    while True:
        ready = dict(poller.poll())
        for r in ranks:
            if ready.get(r.replay):
                r.serve_replay()
            if ready.get(r.pub):
                r.read_subscriptions()
        if ready.get(stdin):
            chunk = os.read(stdin, 1 << 20)
            if not chunk:
                return 0
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if not line.strip():
                    continue
                cmd = json.loads(line)
                op = cmd.get("op")
                if op == "quit":
                    return 0
                rank = ranks[cmd.get("rank", 0)]
                if op == "publish":
                    dp = cmd.get("dp_rank", cmd.get("rank", 0))
                    reply({"seq": rank.publish(cmd["events"], dp, bool(cmd.get("drop")))})
                elif op == "bulk":  # many batches in one command: [[rank, events], ...]
                    for r, events in cmd["batches"]:
                        ranks[r].publish(events, 0, False)
                    reply({"published": len(cmd["batches"])})
                elif op == "raw":
                    rank.pub.send_multipart([bytes.fromhex(f) for f in cmd["frames"]])
                    reply({})
                elif op == "subscribers":
                    rank.read_subscriptions()
                    reply({"subscribers": rank.subscribers})
                elif op == "restart":
                    rank.seq = 0
                    rank.buffer.clear()
                    reply({})
                else:
                    reply({"error": f"unknown op {op!r}"})


class PublisherProcess:
    """This script as a child process, driven from another (tests, the differential harness)."""

    def __init__(self, ranks: int = 1, topic: str = "", python: str | None = None) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            [python or sys.executable, os.path.abspath(__file__), "--ranks", str(ranks),
             "--topic", topic],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        hello = self._read()
        self.endpoints: list[str] = hello["endpoints"]
        self.replay_endpoints: list[str] = hello["replay_endpoints"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("publisher process exited")
        return json.loads(line)

    def call(self, **cmd: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def publish(
        self, rank: int, events: list, *, dp_rank: int | None = -1, drop: bool = False
    ) -> int:
        cmd: dict = {"op": "publish", "rank": rank, "events": events, "drop": drop}
        if dp_rank != -1:
            cmd["dp_rank"] = dp_rank
        return self.call(**cmd)["seq"]

    def raw(self, rank: int, frames: list[bytes]) -> None:
        self.call(op="raw", rank=rank, frames=[f.hex() for f in frames])

    def subscribers(self, rank: int) -> int:
        return self.call(op="subscribers", rank=rank)["subscribers"]

    def wait_subscribers(self, rank: int, n: int, timeout: float = 10.0) -> None:
        """Block until ``n`` subscribers have joined ``rank`` (the slow-joiner guard)."""
        deadline = time.monotonic() + timeout
        while self.subscribers(rank) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: fewer than {n} subscribers after {timeout}s")
            time.sleep(0.01)

    def restart(self, rank: int) -> None:
        self.call(op="restart", rank=rank)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except Exception:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> PublisherProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stored(
    hashes: list[int],
    tokens: list[int],
    block_size: int,
    parent: int | None = None,
    medium: str | None = "GPU",
    lora_name: str | None = None,
) -> list:
    """A ``BlockStored`` event as vLLM's tagged array."""
    return ["BlockStored", hashes, parent, tokens, block_size, None, medium, lora_name]


def removed(hashes: list[int], medium: str | None = "GPU") -> list:
    return ["BlockRemoved", hashes, medium]


CLEARED = ["AllBlocksCleared"]


if __name__ == "__main__":
    sys.exit(main())
