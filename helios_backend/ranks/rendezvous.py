"""The rendezvous of tensor-parallel rank processes: a TCP store on rank 0, joined by every peer.

    rank 0:  store = RankStore.open(("0.0.0.0", 29400), identity)       # listens
             links = store.gather(session, timeout_s)                    # every peer joined, or an error
    peer r:  link, session = join(("host0", 29400), r, identity, timeout_s)

A peer connects (retrying until rank 0 listens), sends HELLO {rank, identity}; rank 0 checks
it against its own identity (the world size, the core's content digest, the contract's
digest, the executor) and either answers WELCOME with the session (the programs to load,
the cache pages, the NCCL unique id: everything a peer must share with rank 0) or REFUSED
with the first field that differs, and closes that connection. A refused peer exits with
that message and rank 0's startup fails at once with the same message (a serving stack
whose ranks disagree is a deployment error, not something to wait out). A connection that
sends no valid hello is dropped and waited past. The connection a peer joined on carries its
frames afterwards.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, Mapping

from helios_proto import contract_pb2 as C

from helios_backend.ranks.wire import Kind, Link, RankLostError

log = logging.getLogger("helios.ranks")
ACCEPT_POLL_S = 0.2
CONNECT_RETRY_S = 0.2
HELLO_TIMEOUT_S = 10.0


class RendezvousError(Exception):
    """The ranks could not meet: a timeout, or a peer refused because it does not fit rank 0."""


class RendezvousRefused(RendezvousError):
    """This rank was refused by rank 0; the message names the field that differs."""


def parse_address(text: str, option: str = "rank_store") -> tuple[str, int]:
    """HOST:PORT (IPv6 hosts in brackets); ValueError naming the option otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{option}: {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class RankIdentity:
    """What every rank of one model must share (checked at rendezvous)."""

    world_size: int
    core: str              # Core.content_digest(): manifest and signed resource digests
    contract: str          # sha256 of the serialized ServingContract
    executor: str          # numpy, cpu or cuda

    @classmethod
    def of(cls, contract: C.ServingContract, world_size: int, core_digest: str, executor: str) -> "RankIdentity":
        return cls(world_size=max(1, world_size), core=core_digest, executor=executor,
                   contract=hashlib.sha256(contract.SerializeToString(deterministic=True)).hexdigest())

    def mismatch(self, other: "RankIdentity") -> str | None:
        """The first field in which `other` differs from this identity, as a sentence."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                return f"{f.name} differs: rank 0 has {str(mine)[:16]}, the joining rank {str(theirs)[:16]}"
        return None


def _hello(rank: int, identity: RankIdentity) -> bytes:
    return json.dumps({"rank": rank, "identity": dataclasses.asdict(identity)}).encode()


class RankStore:
    """Rank 0's listening socket and the peers that joined it."""

    def __init__(self, server: socket.socket, identity: RankIdentity, link_timeout_s: float) -> None:
        self._server = server
        self.identity = identity
        self.link_timeout_s = link_timeout_s

    @classmethod
    def open(cls, address: tuple[str, int], identity: RankIdentity, link_timeout_s: float) -> "RankStore":
        server = socket.create_server(address, reuse_port=False)
        server.settimeout(ACCEPT_POLL_S)
        return cls(server, identity, link_timeout_s)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.getsockname()[:2]
        return host, port

    def gather(self, session: Mapping[str, Any], timeout_s: float) -> list[Link]:
        """Links to ranks 1..world_size-1 (index r-1 is rank r), each welcomed with `session`."""
        peers: dict[int, Link] = {}
        deadline = time.monotonic() + timeout_s
        world = self.identity.world_size
        try:
            while len(peers) < world - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, world)) - set(peers))
                    raise RendezvousError(f"ranks {missing} did not join the store at {self.address[0]}:"
                                          f"{self.address[1]} within {timeout_s:.0f}s")
                try:
                    sock, where = self._server.accept()
                except socket.timeout:
                    continue
                refusal = self._admit(sock, where, peers)
                if refusal is not None:
                    raise RendezvousError(refusal)
            payload = json.dumps(dict(session)).encode()
            for link in peers.values():
                link.send(Kind.WELCOME, payload=payload)
        except BaseException:
            for link in peers.values():
                link.close()
            raise
        return [peers[r] for r in range(1, world)]

    def _admit(self, sock: socket.socket, where: Any, peers: dict[int, Link]) -> str | None:
        """Check one HELLO; the peer's link, or a refusal (sent, connection closed)."""
        link = Link(sock, -1, HELLO_TIMEOUT_S)
        try:
            hello = json.loads(link.receive(Kind.HELLO).payload)
            rank = int(hello["rank"])
            identity = RankIdentity(**hello["identity"])
        except (RankLostError, ValueError, KeyError, TypeError) as exc:
            link.close()
            log.warning("rendezvous: a connection from %s sent no valid hello (%s); dropped", where, exc)
            return None
        link.rank = rank
        reason = self.identity.mismatch(identity)
        if reason is None and not 1 <= rank < self.identity.world_size:
            reason = f"rank {rank} is outside 1..{self.identity.world_size - 1}"
        if reason is None and rank in peers:
            reason = f"rank {rank} joined already"
        if reason is not None:
            message = f"rank {rank} refused at rendezvous: {reason}"
            try:
                link.send(Kind.REFUSED, payload=message.encode())
            except RankLostError:
                pass
            link.close()
            return message
        link.set_timeout(self.link_timeout_s)
        peers[rank] = link
        return None

    def close(self) -> None:
        self._server.close()


def join(address: tuple[str, int], rank: int, identity: RankIdentity, timeout_s: float,
         link_timeout_s: float | None = None) -> tuple[Link, dict[str, Any]]:
    """Connect to rank 0's store (retrying until it listens), introduce this rank, and return
    the link and the session; RendezvousRefused with rank 0's reason when it does not fit."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RendezvousError(f"no rank 0 store at {address[0]}:{address[1]} within {timeout_s:.0f}s "
                                      f"({exc})") from None
            time.sleep(CONNECT_RETRY_S)
    link = Link(sock, 0, max(0.1, deadline - time.monotonic()))
    try:
        link.send(Kind.HELLO, payload=_hello(rank, identity))
        while True:
            message = link.next_message()
            if message.kind == Kind.REFUSED:
                raise RendezvousRefused(message.payload.decode("utf-8", "replace"))
            if message.kind == Kind.WELCOME:
                break
    except RankLostError as exc:
        link.close()
        raise RendezvousError(f"the rendezvous with rank 0 failed: {exc}") from None
    except BaseException:
        link.close()
        raise
    link.set_timeout(link_timeout_s)
    return link, json.loads(message.payload)
