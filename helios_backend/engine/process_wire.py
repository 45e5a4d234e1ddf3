"""The messages between the stub and its engine process (process_engine.py, process_child.py).

One socket pair carries pickled tuples `(kind, *values)` framed by
multiprocessing.connection. Each side sends from several threads, so `Wire.send` holds a
lock; each side receives on one thread only.

    stub -> engine   START options origin_ns | SUBMIT serial spec grammar_bytes | CANCEL serial
                     | STOP drain timeout_s
    engine -> stub   READY assets_bytes spec_defaults description | FAILED message
                     | EVENTS rows | METRICS updates | DEATH reason | EXIT lost

EVENTS is one message per delivery (one per round while decoding). Token events travel as
plain tuples, which pickle in a fraction of a NamedTuple's time (~0.15 us against ~1 us a
token), the tokens of a round's columnar decode lanes as a list (TokenBlock.to_wire: its arrays'
bytes, which pickle ~20x faster than the arrays); a terminal event as one bytes object (its serial
and first_token, then its TerminalEvent serialized: ~0.5 us against ~2.5-4 us to pickle the
Terminal and its protobuf through copyreg). `pack_events` and `unpack_events` keep the order of
the worker's list; the stub's ResponseHub expands the blocks.
"""
from __future__ import annotations

import socket
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any, Sequence

from helios_proto import exchange_pb2 as ep

from helios_backend.scheduler.events import Emitted, Terminal, TokenBlock, WorkerEvent

START, SUBMIT, CANCEL, STOP = "start", "submit", "cancel", "stop"
READY, FAILED, EVENTS, METRICS, DEATH, EXIT = "ready", "failed", "events", "metrics", "death", "exit"


class WireClosed(Exception):
    """The other side closed the wire or exited."""


class Wire:
    def __init__(self, sock: socket.socket) -> None:
        self._connection = Connection(sock.detach())
        self._send_lock = threading.Lock()

    @classmethod
    def from_fd(cls, fd: int) -> "Wire":
        return cls(socket.socket(fileno=fd))

    def send(self, *message: Any) -> None:
        try:
            with self._send_lock:
                self._connection.send(message)
        except (OSError, ValueError) as exc:       # ValueError: sent after close
            raise WireClosed(str(exc)) from None

    def receive(self) -> tuple[Any, ...]:
        try:
            return self._connection.recv()
        except (EOFError, OSError) as exc:
            raise WireClosed(str(exc) or "end of stream") from None

    def close(self) -> None:
        self._connection.close()


_TERMINAL_HEAD = struct.Struct("<q?")         # a terminal's serial and first_token, before its event


def pack_events(events: Sequence[WorkerEvent]) -> list[Any]:
    return [tuple(ev) if type(ev) is Emitted else ev.to_wire() if type(ev) is TokenBlock
            else _TERMINAL_HEAD.pack(ev.serial, ev.first_token) + ev.event.SerializeToString() if type(ev) is Terminal
            else ev for ev in events]


def unpack_events(rows: list[Any]) -> list[WorkerEvent]:
    return [Emitted(*row) if type(row) is tuple else TokenBlock.from_wire(row) if type(row) is list
            else _terminal(row) if type(row) is bytes else row for row in rows]


def _terminal(row: bytes) -> Terminal:
    serial, first_token = _TERMINAL_HEAD.unpack_from(row)
    return Terminal(serial, ep.TerminalEvent.FromString(row[_TERMINAL_HEAD.size:]), first_token)
