"""Messages between rank 0 and one peer rank: a fixed header and a payload, on one TCP connection.

    header (24 bytes, little-endian): kind u16 | frame u16 | item u32 | value i64 | payload bytes u64

Every receive is bounded by the link's timeout: a peer that died (EOF, reset) or stopped
answering (no byte within the bound) raises RankLostError naming the rank, which the
executor turns into the loss of every rank (nothing a lost rank owned can be trusted).
Sends are whole messages under a lock, so a peer's reply thread and its main thread never
interleave bytes.
"""
from __future__ import annotations

import enum
import socket
import struct
import threading
from collections import deque
from typing import NamedTuple

HEADER = struct.Struct("<HHIqQ")
MAX_PAYLOAD = 1 << 34            # a buffer read of a large cache plane stays far below this


class Kind(enum.IntEnum):
    HELLO = 1          # peer -> 0: the peer's rank and identity (JSON)
    WELCOME = 2        # 0 -> peer: the session (JSON: programs, options, NCCL unique id)
    REFUSED = 3        # 0 -> peer: why the peer may not join (text); the connection closes
    LAUNCH = 4         # 0 -> peer: frame, program index, sequence; payload: the frame runs it reads
    COMPLETION = 5     # peer -> 0: sequence; payload: the rank's completion words
    REDUCE = 6         # both ways: all-reduce index; payload: the region (peer: partial, 0: sum)
    READ = 7           # 0 -> peer: payload: a buffer name (diagnostics)
    BUFFER = 8         # peer -> 0: payload: the buffer's bytes
    PAGES = 9          # both ways: value: cache pages (peer: what fits, 0: the agreed count)
    FAILED = 10        # peer -> 0: the peer's executor raised (text); the peer then exits
    CLOSE = 11         # 0 -> peer: stop serving and exit 0
    GEOMETRY = 12      # peer -> 0: what loading produced (JSON: cache pages, buffer offsets, arena bytes)


class RankLostError(RuntimeError):
    """A peer rank died, closed its connection, failed, or did not answer within the bound."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} lost: {message}")
        self.rank = rank


class Message(NamedTuple):
    kind: Kind
    frame: int
    item: int
    value: int
    payload: bytes


class Link:
    """One connected socket between rank 0 and peer `rank`."""

    def __init__(self, sock: socket.socket, rank: int, timeout_s: float | None) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout_s)
        self.sock = sock
        self.rank = rank
        self.timeout_s = timeout_s
        self._send_lock = threading.Lock()
        self._stash: deque[Message] = deque()     # received ahead of the kind asked for
        self._header = bytearray(HEADER.size)

    def set_timeout(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.sock.settimeout(timeout_s)

    # ---- sending -------------------------------------------------------------------------
    def send(self, kind: Kind, *, frame: int = 0, item: int = 0, value: int = 0,
             payload: bytes | bytearray | memoryview = b"") -> None:
        view = memoryview(payload).cast("B")
        header = HEADER.pack(int(kind), frame, item, value, view.nbytes)
        try:
            with self._send_lock:
                if view.nbytes <= 4096:
                    self.sock.sendall(header + bytes(view))
                else:
                    self.sock.sendall(header)
                    self.sock.sendall(view)
        except socket.timeout:
            raise RankLostError(self.rank, f"did not take a message within {self.timeout_s:.1f}s") from None
        except OSError as exc:
            raise RankLostError(self.rank, f"connection broke while sending ({exc})") from None

    # ---- receiving -----------------------------------------------------------------------
    def receive(self, kind: Kind) -> Message:
        """The next message of `kind`; messages of other kinds that arrive first are kept for
        their own receive (a peer's completion words may precede the next round's reduces)."""
        for i, message in enumerate(self._stash):
            if message.kind == kind:
                del self._stash[i]
                return message
        while True:
            message = self.next_message()
            if message.kind == kind:
                return message
            self._stash.append(message)

    def receive_into(self, kind: Kind, out: memoryview) -> Message:
        """Like receive, with the payload written into `out` (exactly its size)."""
        out = out.cast("B")
        for i, message in enumerate(self._stash):
            if message.kind == kind:
                del self._stash[i]
                self._check_size(message, out.nbytes)
                out[:] = message.payload
                return message
        while True:
            kind_, frame, item, value, nbytes = self.read_header()
            if kind_ == kind:
                self._check_size(Message(Kind(kind_), frame, item, value, b""), out.nbytes, nbytes)
                self.read_exact(out)
                return Message(Kind(kind_), frame, item, value, b"")
            self._stash.append(self._finish(kind_, frame, item, value, nbytes))

    def _check_size(self, message: Message, expected: int, nbytes: int | None = None) -> None:
        got = len(message.payload) if nbytes is None else nbytes
        if got != expected:
            raise RankLostError(self.rank, f"sent {got} bytes for a {message.kind.name} of {expected}")

    def next_message(self) -> Message:
        kind, frame, item, value, nbytes = self.read_header()
        return self._finish(kind, frame, item, value, nbytes)

    def read_payload(self, nbytes: int) -> bytes:
        """The payload of a message whose header read_header returned."""
        payload = bytearray(nbytes)
        if nbytes:
            self.read_exact(memoryview(payload))
        return bytes(payload)

    def _finish(self, kind: int, frame: int, item: int, value: int, nbytes: int) -> Message:
        payload = bytearray(nbytes)
        if nbytes:
            self.read_exact(memoryview(payload))
        message = Message(Kind(kind), frame, item, value, bytes(payload))
        if message.kind == Kind.FAILED:
            raise RankLostError(self.rank, message.payload.decode("utf-8", "replace"))
        return message

    def read_header(self) -> tuple[int, int, int, int, int]:
        self.read_exact(memoryview(self._header))
        kind, frame, item, value, nbytes = HEADER.unpack(self._header)
        if kind not in Kind._value2member_map_ or nbytes > MAX_PAYLOAD:
            raise RankLostError(self.rank, f"sent a malformed message header (kind {kind}, {nbytes} bytes)")
        return kind, frame, item, value, nbytes

    def read_exact(self, out: memoryview) -> None:
        got = 0
        try:
            while got < out.nbytes:
                n = self.sock.recv_into(out[got:])
                if n == 0:
                    raise RankLostError(self.rank, "closed its connection (the process ended)")
                got += n
        except socket.timeout:
            raise RankLostError(self.rank, f"did not answer within {self.timeout_s:.1f}s") from None
        except ConnectionError as exc:
            raise RankLostError(self.rank, f"connection broke ({exc})") from None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
