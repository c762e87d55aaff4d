"""The control channel's transport: pyzmq, one ROUTER on the leader, one DEALER per rank.

The leader binds (a private ``ipc://`` socket by default, or the configured address) and
every rank connects, so ranks started by a deployment find their leader the same way as
spawned ones. Frames are the msgpack messages of ``messages.py``; a frame that does not
decode comes back as ``Malformed`` (a bug to log and fail the step with), never raises.
Each side's socket is used by one thread only.

Over ``tcp://`` (ranks that join from other hosts) the channel is encrypted with CURVE: the
leader's key pair is derived from the group's internal token, so only a holder of the token
can complete the handshake, and every frame (Hellos, payloads, results) is private on the
wire. A rank with another token cannot connect: it hears no Setup and says so.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils import z85

from services.common.ranks.messages import (
    ToLeader,
    ToRank,
    decode_to_leader,
    decode_to_rank,
    encode,
)

logger = logging.getLogger(__name__)
RANK_LINGER_MS = 2000  # a rank's last words (StartFailed, a BROKEN reply) get out before it exits
_KEY_CONTEXT = b"stageserve rank control v1\0"


def is_encrypted(addr: str, token: str) -> bool:
    """Whether the channel at ``addr`` uses CURVE: over TCP, with a token to key it."""
    return addr.startswith("tcp://") and bool(token)


def leader_keys(token: str) -> tuple[bytes, bytes]:
    """The leader's CURVE (public, secret) key pair, z85, derived from ``token``."""
    secret = z85.encode(hashlib.sha256(_KEY_CONTEXT + token.encode()).digest())
    return zmq.curve_public(secret), secret


@dataclass(frozen=True)
class Malformed:
    """A frame that is not a valid message of its direction."""

    reason: str


class LeaderChannel:
    """The leader's ROUTER socket; peers are zmq routing ids, bound to ranks by their Hello."""

    def __init__(self, addr: str = "", token: str = "") -> None:
        self._tmpdir = tempfile.mkdtemp(prefix="stageserve-ranks-") if not addr else None
        if self._tmpdir is not None:
            addr = f"ipc://{os.path.join(self._tmpdir, 'control')}"
        self._context = zmq.Context(io_threads=1)
        self.socket = self._context.socket(zmq.ROUTER)
        if is_encrypted(addr, token):
            public, secret = leader_keys(token)
            self.socket.curve_server = True
            self.socket.curve_publickey, self.socket.curve_secretkey = public, secret
        self.socket.setsockopt(zmq.LINGER, 0)  # at stop, nothing left is worth waiting for
        # A send to a peer that is gone raises instead of being dropped: a vanished rank is noticed.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.socket.bind(addr)
        except zmq.ZMQError:
            self.close()
            raise
        self.addr = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, peer: bytes, message: msgspec.Struct) -> bool:
        """False when ``peer`` is unreachable (disconnected, or not reading: its queue is full)."""
        try:
            self.socket.send_multipart([peer, encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("send to peer %r failed: %s", peer, exc)
            return False
        return True

    def receive_ready(self) -> list[tuple[bytes, ToLeader | Malformed]]:
        """Every message waiting now, without blocking."""
        received: list[tuple[bytes, ToLeader | Malformed]] = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return received
            if len(frames) != 2:
                received.append((frames[0], Malformed(f"{len(frames) - 1} frames, expected 1")))
                continue
            try:
                received.append((frames[0], decode_to_leader(frames[1])))
            except msgspec.DecodeError as exc:
                received.append((frames[0], Malformed(f"{exc} ({len(frames[1])} bytes)")))

    def close(self) -> None:
        self.socket.close(linger=0)
        self._context.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)


class RankChannel:
    """A rank's DEALER socket, connected to its leader."""

    def __init__(self, addr: str, token: str = "") -> None:
        self._context = zmq.Context(io_threads=1)
        self.socket = self._context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, RANK_LINGER_MS)
        if is_encrypted(addr, token):
            self.socket.curve_serverkey = leader_keys(token)[0]
            self.socket.curve_publickey, self.socket.curve_secretkey = zmq.curve_keypair()
        self.socket.connect(addr)

    def send(self, message: msgspec.Struct) -> None:
        self.socket.send(encode(message))

    def receive(self, timeout_s: float) -> ToRank | Malformed | None:
        """The next message, or None when none came within ``timeout_s``."""
        if not self.socket.poll(max(int(timeout_s * 1000), 0)):
            return None
        data = self.socket.recv()
        try:
            return decode_to_rank(data)
        except msgspec.DecodeError as exc:
            return Malformed(f"{exc} ({len(data)} bytes)")

    def close(self) -> None:
        self.socket.close()
        self._context.term()
