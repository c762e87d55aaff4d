"""A rank process the test drives by hand: ``python -m tests.common.fake_rank`` with a rank's
arguments (``procs.RankLaunch``), named by ``RankGroupConfig.rank_module``.

It connects to its leader like ``rank_main`` and to the test's puppet socket (``PUPPETS_ENV``),
announces itself there (``Announce``), then relays frames both ways unchanged: every frame
from the leader goes to the test; from the test, ``[b"send", frame]`` goes to the leader and
``[b"exit", code]`` ends this process with that code. So the rank says exactly what the test
makes it say, garbage included (``ranks_fake_helpers.FakeRank`` is the test's end). It imports
no torch, and it exits when its leader (its parent) is gone.
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec
import zmq

from services.common.ranks.channel import RankChannel

PUPPETS_ENV = "STAGESERVE_TEST_PUPPETS"  # the test's ROUTER (tcp://127.0.0.1:PORT)
POLL_MS = 200  # how often the parent is looked for


class Announce(msgspec.Struct, frozen=True):
    """A fake rank's first frame to the test: what its Hello must say."""

    rank: int
    world_size: int
    formation: int
    pid: int


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fake_rank")
    for flag in ("--formation", "--rank", "--world-size", "--parent-pid"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--leader", required=True)
    args, _ = p.parse_known_args(argv)
    leader = RankChannel(args.leader)
    context = zmq.Context()
    test = context.socket(zmq.DEALER)
    test.setsockopt(zmq.LINGER, 0)
    test.connect(os.environ[PUPPETS_ENV])
    try:
        announce = Announce(args.rank, args.world_size, args.formation, os.getpid())
        test.send(msgspec.msgpack.encode(announce))
        poller = zmq.Poller()
        poller.register(leader.socket, zmq.POLLIN)
        poller.register(test, zmq.POLLIN)
        while os.getppid() == args.parent_pid:
            events = dict(poller.poll(POLL_MS))
            if leader.socket in events:
                test.send(leader.socket.recv())
            if test in events:
                verb, frame = test.recv_multipart()
                if verb == b"exit":
                    return int(frame)
                leader.socket.send(frame)
        return 1
    finally:
        test.close()
        context.term()
        leader.close()


if __name__ == "__main__":
    sys.exit(main())
