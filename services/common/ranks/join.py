"""A rank that joins its group from another host: ``stageserve join-rank`` (this module's
``main``).

A rank group that spans hosts has ``join`` entries in its service's ``--devices``: its leader
spawns the ranks of its own host and waits, at each formation, for a Hello from each joining
rank (``formation.py``). A LeaderWorkerSet's worker pod runs this agent for one of them. A
formation is one set of processes and one rendezvous, so the agent starts a ``rank_main``
process (formation -1: whichever one the leader is forming), waits for it to exit (the leader
shut it down, the group failed, or the leader went away), and starts the next one after
``--retry-s``. SIGTERM or SIGINT stops it: its rank gets SIGTERM, SIGKILL after
``--stop-grace-s``, and the agent exits 0. The rank process dies with the agent (its parent
pid), and the group's internal token comes from the environment, as for every service.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from services.common.envs import Envs
from services.common.ranks.config import RANK_MAIN
from services.common.ranks.messages import ANY_FORMATION
from services.common.settings import positive, positive_int

logger = logging.getLogger("services.common.ranks.join")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stageserve join-rank", description=__doc__.split("\n\n")[1].replace("\n", " ")
    )
    p.add_argument(
        "--leader",
        required=True,
        help="the group's control address, tcp://HOST:PORT (its service's --rank-address)",
    )
    p.add_argument("--rank", type=int, required=True, help="this rank's index in the group")
    p.add_argument(
        "--world-size", type=positive_int, required=True, help="the group's number of ranks"
    )
    p.add_argument("--device", default="cpu", help="this rank's device: cpu or cuda:N")
    p.add_argument(
        "--host",
        required=True,
        help="this host's address the group's other ranks reach (a pod's IP): the rank's "
        "collectives listen on it",
    )
    p.add_argument(
        "--retry-s",
        type=positive,
        default=2.0,
        help="after a rank process exits, wait this long before the next one joins",
    )
    p.add_argument(
        "--rendezvous-timeout-s",
        type=positive,
        default=300.0,
        help="how long a rank process waits for its Setup and its peers",
    )
    p.add_argument(
        "--stop-grace-s",
        type=positive,
        default=10.0,
        help="on SIGTERM, how long the rank process has to exit before SIGKILL",
    )
    p.add_argument("--log-level", type=str.upper, default=Envs.from_environ().log_level)
    return p


def rank_argv(args: argparse.Namespace) -> list[str]:
    """One rank process's command line: ``rank_main`` for whatever formation is forming."""
    return [
        sys.executable,
        "-m",
        RANK_MAIN,
        "--leader",
        args.leader,
        "--formation",
        str(ANY_FORMATION),
        "--rank",
        str(args.rank),
        "--world-size",
        str(args.world_size),
        "--device",
        args.device,
        "--parent-pid",
        str(os.getpid()),
        "--rendezvous-timeout-s",
        str(args.rendezvous_timeout_s),
        "--host",
        args.host,
        "--log-level",
        args.log_level,
    ]


def check_args(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot join a group, or None."""
    if not args.leader.startswith("tcp://"):
        return f"--leader must be tcp://HOST:PORT, got {args.leader!r}"
    if not 0 < args.rank < args.world_size:
        return f"--rank must be 1 .. {args.world_size - 1} (rank 0 runs beside its leader)"
    if not Envs.from_environ().internal_token:
        return "no internal token in the environment: the leader refuses a rank without it"
    return None


class JoinAgent:
    """Starts one rank process after another until ``stop``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stopping = threading.Event()
        self.num_started = 0
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def run(self) -> int:
        while not self.stopping.is_set():
            with self._lock:
                if self.stopping.is_set():
                    break
                self._process = subprocess.Popen(rank_argv(self.args), stdin=subprocess.DEVNULL)
                self.num_started += 1
            logger.info(
                "rank %d: process %d (pid %d) joins %s",
                self.args.rank,
                self.num_started,
                self._process.pid,
                self.args.leader,
            )
            code = self._process.wait()
            logger.info(
                "rank %d: pid %d exited with code %d", self.args.rank, self._process.pid, code
            )
            self.stopping.wait(self.args.retry_s)
        return 0

    def stop(self) -> None:
        """Stop starting ranks; SIGTERM the running one, SIGKILL it after the grace."""
        with self._lock:
            self.stopping.set()
            process = self._process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(self.args.stop_grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s join-rank %(name)s: %(message)s",
    )
    problem = check_args(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    agent = JoinAgent(args)
    stopper = threading.Thread(target=agent.stop, daemon=True)

    def on_signal(signum: int, frame: object) -> None:
        if not stopper.is_alive() and not agent.stopping.is_set():
            stopper.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = agent.run()
    if stopper.is_alive():
        stopper.join()
    return code


if __name__ == "__main__":
    sys.exit(main())
