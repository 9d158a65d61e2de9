"""The hub's frames in their total order, kept from the oldest one some process may still need.

Positions are 1, 2, 3, ... without holes. The frames kept are those after the position every
connected process has applied (they may be asked to a process joining from a sibling's state)
and, whatever that position, at most ``max_bytes`` of them: a process that lags beyond this
bound cannot be fed from here any more and must load a sibling's state (the hub's ``RESYNC``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Entry:
    sender: int  # the incarnation of the process that sent it
    last_seq: int  # the sender's last record sequence number in it
    data: bytes  # the DATA frame the siblings get, ready to write


class Retained:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: list[Entry] = []
        self._offset = 0  # entries before this index are trimmed (compacted now and then)
        self.first = 1  # the position of the oldest entry kept
        self.head = 0  # the position of the newest entry (0: none yet)
        self.bytes = 0

    def __len__(self) -> int:
        return self.head - self.first + 1

    def append(self, entry: Entry) -> int:
        self._entries.append(entry)
        self.head += 1
        self.bytes += len(entry.data)
        return self.head

    def get(self, position: int) -> Entry:
        """The entry at ``position`` (``first <= position <= head``)."""
        return self._entries[self._offset + position - self.first]

    def trim_through(self, position: int) -> None:
        """Forget the entries up to ``position``."""
        position = min(position, self.head)
        entries = self._entries
        while self.first <= position:
            self.bytes -= len(entries[self._offset].data)
            self._offset += 1
            self.first += 1
        if self._offset > 1024 and self._offset * 2 > len(entries):
            del entries[: self._offset]
            self._offset = 0

    def over_bound(self) -> bool:
        return self.bytes > self.max_bytes and len(self) > 1

    def trim_to_bound(self) -> None:
        """Forget the oldest entries until at most ``max_bytes`` are kept (the newest is kept
        whatever its size)."""
        while self.over_bound():
            self.trim_through(self.first)
