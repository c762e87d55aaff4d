"""A tensor-parallel decode rank: TP rank 0 runs the rank (scheduler, batch, sampling) and every
forward it launches runs on its followers too, with the same inputs, so their shards join the
forward's collectives.

Rank 0's ``StepMirror.send`` puts a step's host inputs (positions, KV lengths, page tables,
output slots: ``ForwardHeader``) on a pyzmq PUSH socket to each follower and broadcasts the
step's token ids, which are still on the device (the previous step's samples), over the device
group. A follower's ``StepFollower.receive`` waits on its PULL socket (at most a timeout, so its
loop answers the leader's pings), joins the broadcast and returns the ``DecodeInputs`` to run.
The followers' ipc sockets (``Pull``; rank 0's ``Pushes``, also the DP-attention group's order
channel) are named over the group's CPU collective at construction. Rank 0's
decisions (what to admit, which pages) never depend on a follower: a follower holds no
scheduler, only its pool of the KV heads it owns, addressed by rank 0's page ids.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import zmq

from services.engine.step_inputs import DecodeInputs


class ForwardHeader(msgspec.Struct, frozen=True, tag="forward"):
    """One DECODE step's host inputs (``DecodeInputs`` but the device-side token ids)."""

    positions: bytes  # [3, B] int64
    seq_lens: list[int]
    page_tables: list[list[int]]
    out_slots: bytes  # [B] int64


class WarmupDone(msgspec.Struct, frozen=True, tag="warmup_done"):
    """Rank 0's warm-up is over: a follower's ends too."""


Message = ForwardHeader | WarmupDone
_decoder = msgspec.msgpack.Decoder(Message)


def _int64(data: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.int64).reshape(shape).copy())


class Pushes:
    """PUSH sockets to followers' ``Pull`` addresses, in follower order."""

    def __init__(self, addresses: list[str]) -> None:
        context = zmq.Context.instance()
        self._sockets = []
        for address in addresses:
            socket = context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self._sockets.append(socket)

    def send(self, data: bytes, to: int | None = None) -> None:
        """``data`` to follower ``to`` (None: to every follower)."""
        for socket in self._sockets if to is None else [self._sockets[to]]:
            socket.send(data)

    def close(self) -> None:
        for socket in self._sockets:
            socket.close(0)
        self._sockets = []


class Pull:
    """A follower's PULL socket on a fresh ipc path (``address``), bound at construction."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="stageserve-rank-")
        self.address = f"ipc://{os.path.join(self._dir, 'steps')}"
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)

    def receive(self, timeout_s: float) -> bytes | None:
        """The next message, or None when nothing came within ``timeout_s``."""
        if not self._socket.poll(int(timeout_s * 1000)):
            return None
        return self._socket.recv()

    def close(self) -> None:
        self._socket.close(0)
        try:
            os.unlink(self.address.removeprefix("ipc://"))
            os.rmdir(self._dir)
        except OSError:
            pass


class StepMirror:
    """Rank 0's side: ``send`` every DECODE step before running it."""

    def __init__(self, addresses: list[str], device: torch.device, group: Any) -> None:
        self._pushes = Pushes(addresses)
        self.device, self._group = device, group
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, inputs: DecodeInputs) -> None:
        header = ForwardHeader(
            positions=inputs.positions.contiguous().numpy().tobytes(),
            seq_lens=list(inputs.seq_lens),
            page_tables=[list(p) for p in inputs.page_tables],
            out_slots=inputs.out_slots.contiguous().numpy().tobytes(),
        )
        self._pushes.send(self._encoder.encode(header))
        ids = inputs.input_ids.to(self.device, torch.long).contiguous()
        dist.broadcast(ids, src=0, group=self._group)

    def warmup_done(self) -> None:
        self._pushes.send(self._encoder.encode(WarmupDone()))

    def close(self) -> None:
        self._pushes.close()


class StepFollower:
    """A follower's side: its PULL socket, bound at construction (``address``)."""

    def __init__(self, device: torch.device, group: Any) -> None:
        self._pull = Pull()
        self.address = self._pull.address
        self.device, self._group = device, group

    def receive(self, timeout_s: float) -> DecodeInputs | WarmupDone | None:
        """The next step's inputs (its token ids broadcast from rank 0), ``WarmupDone``, or
        None when nothing came within ``timeout_s``."""
        data = self._pull.receive(timeout_s)
        if data is None:
            return None
        message = _decoder.decode(data)
        if isinstance(message, WarmupDone):
            return message
        batch = len(message.seq_lens)
        ids = torch.empty(batch, dtype=torch.long, device=self.device)
        dist.broadcast(ids, src=0, group=self._group)
        return DecodeInputs(
            ids,
            _int64(message.positions, (3, batch)),
            message.seq_lens,
            message.page_tables,
            _int64(message.out_slots, (batch,)),
        )

    def close(self) -> None:
        self._pull.close()


def exchange_addresses(
    follower: StepFollower | Pull | None, rank: int, world_size: int, group: Any
):
    """Every follower's address, rank order (rank 0 contributes none); all ranks call it."""
    mine = follower.address if follower is not None else ""
    addresses: list[str] = [""] * world_size
    dist.all_gather_object(addresses, mine, group=group)
    assert (rank == 0) == (follower is None)
    return addresses[1:]
