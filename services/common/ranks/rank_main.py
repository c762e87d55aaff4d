"""A rank process: ``python -m services.common.ranks.rank_main --leader ADDR ...``.

Start-up, in order; a failure at any stage reaches the leader as StartFailed naming this
rank, the stage and the cause, and the process exits 1: device -> (rank 0 of several: a
TCPStore on a free port) -> Hello -> Setup -> import -> rendezvous -> groups -> construct ->
warmup -> barrier -> Ready, then the step loop (``rank_loop.py``; in a free-running group,
``free_loop.py``: rank 0's ``FreeRankLoop``, the others' ``FollowerLoop``). A world of one
meets no peer: its rendezvous store is in-process. A free-running group of one (it runs no
collective) skips the rendezvous, the groups and the barrier: it has no process group at
all; a free-running group of several forms them as a stepped group does. The leader spawns
every rank (``procs.RankLaunch``). Exit codes: ``LoopExit``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist

from services.common import logs
from services.common.envs import Envs
from services.common.malloc import tune_malloc
from services.common.ranks.channel import Malformed, RankChannel
from services.common.ranks.free_loop import FollowerLoop, FreeRankLoop
from services.common.ranks.messages import (
    ANY_FORMATION,
    Hello,
    Ready,
    Setup,
    Shutdown,
    StartFailed,
    StartStage,
    error_text,
)
from services.common.ranks.rank_loop import LoopExit, RankLoop
from services.common.ranks.step import BaseRankStep, FreeRankStep, RankContext

logger = logging.getLogger("services.common.ranks.rank")
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LISTEN_BACKLOG = 128


@dataclass(frozen=True)
class RankArgs:
    leader: str
    formation: int  # the leader's formation
    rank: int
    world_size: int
    device: str
    parent_pid: int  # the leader (this rank leaves when it is gone); 0: none
    rendezvous_timeout_s: float
    log_level: str
    host: str = "127.0.0.1"  # where rank 0's store and this rank's gloo device listen


def parse_args(argv: list[str] | None = None) -> RankArgs:
    p = argparse.ArgumentParser(prog="rank_main", description=__doc__.splitlines()[0])
    p.add_argument(
        "--leader", required=True, help="the leader's control address (ipc:// or tcp://)"
    )
    p.add_argument(
        "--formation", type=int, default=-1, help="the leader's formation (-1: a joining rank)"
    )
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--world-size", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--rendezvous-timeout-s", type=float, default=300.0)
    p.add_argument("--log-level", type=str.upper, default=Envs.from_environ().log_level)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="this rank's address for the group's collectives (rank 0: and its store); "
        "loopback unless the group spans hosts",
    )
    a = p.parse_args(argv)
    if not 0 <= a.rank < a.world_size:
        p.error("needs --rank R --world-size W with 0 <= R < W")
    return RankArgs(
        a.leader,
        a.formation,
        a.rank,
        a.world_size,
        a.device,
        a.parent_pid,
        a.rendezvous_timeout_s,
        a.log_level,
        a.host,
    )


class _StartFailure(Exception):
    def __init__(self, stage: StartStage, rank: int, cause: BaseException) -> None:
        super().__init__(f"{stage.value}: {error_text(cause)}")
        self.stage, self.rank, self.cause = stage, rank, cause


@contextlib.contextmanager
def _stage(stage: StartStage, rank: int) -> Iterator[None]:
    try:
        yield
    except Exception as exc:  # any cause; it becomes this rank's start error
        raise _StartFailure(stage, rank, exc) from exc


@dataclass(frozen=True)
class _Started:
    rank: int
    setup: Setup
    step_fn: BaseRankStep


def bind_device(device: str) -> None:
    """Make ``device`` this process's current device; raises with the reason it cannot be."""
    parsed = torch.device(device)
    if parsed.type == "cpu":
        return
    if parsed.type != "cuda" or parsed.index is None:
        raise ValueError(f"device {device!r} is not 'cpu' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{device}: CUDA is not available on this host")
    if parsed.index >= torch.cuda.device_count():
        raise RuntimeError(f"{device}: this host has {torch.cuda.device_count()} CUDA devices")
    torch.cuda.set_device(parsed.index)


def import_step(target: str) -> type[BaseRankStep]:
    module_name, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), name)
    if not (isinstance(cls, type) and issubclass(cls, BaseRankStep)):
        raise TypeError(f"{target} is not a BaseRankStep subclass")
    return cls


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def group_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0: the group's TCPStore on a free port of ``host`` only (loopback unless ranks join
    from other hosts).

    A TCPStore given a port binds every interface; its socket is made here instead.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(LISTEN_BACKLOG)
        port = listener.getsockname()[1]
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=_timeout(timeout_s),
            master_listen_fd=listener.detach(),  # the store owns the socket from here on
        )
    finally:
        listener.close()  # no-op once detached


class Refused(Exception):
    """The leader answered this rank's Hello with Shutdown: it does not want this rank now."""


def _await_setup(channel: RankChannel, timeout_s: float) -> Setup:
    message = channel.receive(timeout_s)
    if isinstance(message, Setup):
        return message
    if message is None:
        raise TimeoutError(f"no Setup from the leader within {timeout_s:.0f} s")
    if isinstance(message, Malformed):
        raise ValueError(f"malformed Setup: {message.reason}")
    if isinstance(message, Shutdown):
        raise Refused()
    raise RuntimeError(f"the leader sent {type(message).__name__} before Setup")


def gloo_options(host: str) -> dist.ProcessGroupGloo._Options:
    """Gloo options whose device listens on ``host`` only: loopback when the ranks share one
    host, where gloo's default (the address the hostname resolves to) may be a public
    interface; the address peers on other hosts reach when ranks join."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return options


def _form_groups(
    device: str, host: str, timeout_s: float
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The gloo groups listen on ``host`` only."""
    gloo = gloo_options(host)
    cpu_group = dist.new_group(backend="gloo", timeout=_timeout(timeout_s), pg_options=gloo)
    if device.startswith("cuda"):
        device_group = dist.new_group(backend="nccl", timeout=_timeout(timeout_s))
    else:
        device_group = dist.new_group(backend="gloo", timeout=_timeout(timeout_s), pg_options=gloo)
    assert cpu_group is not None and device_group is not None
    return cpu_group, device_group


def _rendezvous(args: RankArgs, setup: Setup, store: dist.Store | None) -> None:
    """Join the group's default process group (gloo, on ``args.host`` only); ``store``: rank
    0's of a world of several, else None."""
    if store is None and args.world_size == 1:
        store = dist.HashStore()  # nobody to meet: no socket
    elif store is None:
        store = dist.TCPStore(
            setup.store_host,
            setup.store_port,
            args.world_size,
            is_master=False,
            timeout=_timeout(args.rendezvous_timeout_s),
        )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=args.rank,
        world_size=args.world_size,
        timeout=_timeout(setup.collective_timeout_s),
        pg_options=gloo_options(args.host),
    )


def _start(args: RankArgs, channel: RankChannel) -> _Started:
    rank, world_size, store = args.rank, args.world_size, None
    with _stage(StartStage.DEVICE, rank):
        bind_device(args.device)
    if rank == 0 and world_size > 1:
        with _stage(StartStage.RENDEZVOUS, rank):
            store = group_store(args.host, world_size, args.rendezvous_timeout_s)
    channel.send(
        Hello(
            rank=rank,
            world_size=world_size,
            formation=args.formation,
            pid=os.getpid(),
            device=args.device,
            store_port=store.port if store is not None else 0,
            token=Envs.from_environ().internal_token,
        )
    )
    with _stage(StartStage.SETUP, rank):
        setup = _await_setup(channel, args.rendezvous_timeout_s)
    with _stage(StartStage.IMPORT, rank):  # before the rendezvous: a bad target fails at once
        cls = import_step(setup.step_target)
        if setup.is_free_running is not issubclass(cls, FreeRankStep):
            mode = "free-running" if setup.is_free_running else "stepped"
            raise TypeError(f"{setup.step_target} cannot run in a {mode} group")
        is_alone = world_size == 1
        if issubclass(cls, FreeRankStep) and cls.follow is FreeRankStep.follow and not is_alone:
            raise TypeError(f"{setup.step_target} has no follow: it runs in a group of one")
    if _has_process_group(setup, world_size):
        with _stage(StartStage.RENDEZVOUS, rank):
            _rendezvous(args, setup, store)
    step_fn = _build_step(cls, args, setup)
    return _Started(rank, setup, step_fn)


def _has_process_group(setup: Setup, world_size: int) -> bool:
    """Every stepped rank (even a world of one) and every rank of a free-running group of
    several joins process groups; a free-running group of one runs no collective."""
    return not setup.is_free_running or world_size > 1


def _build_step(cls: type[BaseRankStep], args: RankArgs, setup: Setup) -> BaseRankStep:
    device, rank, world_size = args.device, args.rank, args.world_size
    cpu_group = device_group = None  # a free-running group of one has no process group
    is_grouped = _has_process_group(setup, world_size)
    if is_grouped:
        with _stage(StartStage.GROUPS, rank):
            cpu_group, device_group = _form_groups(device, args.host, setup.collective_timeout_s)
    ctx = RankContext(
        rank,
        world_size,
        device,
        cpu_group,
        device_group,
        setup.collective_timeout_s,
        args.host,
        joined=args.formation == ANY_FORMATION,
    )
    with _stage(StartStage.CONSTRUCT, rank):
        step_fn = cls(ctx, msgspec.msgpack.decode(setup.init, type=cls.init_type))
    try:
        with _stage(StartStage.WARMUP, rank):
            step_fn.warmup()
        if is_grouped:
            with _stage(StartStage.BARRIER, rank):  # names every rank that did not come
                dist.monitored_barrier(
                    timeout=_timeout(setup.collective_timeout_s), wait_all_ranks=True
                )
    except _StartFailure:
        step_fn.close()
        raise
    return step_fn


def _serve(channel: RankChannel, started: _Started, parent_pid: int) -> LoopExit:
    step_fn, setup, rank = started.step_fn, started.setup, started.rank
    if not isinstance(step_fn, FreeRankStep):
        return RankLoop(channel, step_fn, dist.group.WORLD, rank, setup, parent_pid).serve()
    if rank == 0:
        return FreeRankLoop(channel, step_fn, rank, setup, parent_pid).serve()
    return FollowerLoop(channel, step_fn, rank, setup, parent_pid).serve()


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its leader dies (Linux), even in the middle of
    start-up."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    except (OSError, AttributeError) as exc:  # the step loop's parent check still applies
        logger.warning("cannot tie this rank to its leader's life: %s", exc)
    if os.getppid() != parent_pid:  # it died before the prctl
        sys.exit(int(LoopExit.ORPHANED))


class _RankField(logging.Filter):
    rank = "?"

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank_field = _RankField()
    if Envs.from_environ().log_format == "json":  # as its service logs (service_main)
        logs.configure(os.environ.get("STAGESERVE_LOG_SERVICE", "rank"), args.log_level, "json")
    else:
        logging.basicConfig(
            level=args.log_level,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s rank %(rank)s %(name)s: %(message)s",
        )
    for handler in logging.getLogger().handlers:
        handler.addFilter(rank_field)
    rank_field.rank = str(args.rank)
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    tune_malloc(Envs.from_environ())
    channel = RankChannel(args.leader, Envs.from_environ().internal_token)
    try:
        try:
            started = _start(args, channel)
        except _StartFailure as failure:
            if isinstance(failure.cause, Refused):  # the leader logged why; nothing to report
                logger.warning("the leader refused this rank's Hello (see its log)")
                return int(LoopExit.SHUTDOWN)
            logger.error("start-up failed at %s", failure.stage.value, exc_info=failure.cause)
            channel.send(
                StartFailed(
                    rank=failure.rank,
                    formation=args.formation,
                    stage=failure.stage,
                    error=error_text(failure.cause),
                )
            )
            return int(LoopExit.BROKEN)
        channel.send(Ready(rank=started.rank))
        exit_code = _serve(channel, started, args.parent_pid)
        started.step_fn.close()
        # A broken group's collectives may never return; a free-running group of one has none.
        if exit_code is LoopExit.SHUTDOWN and dist.is_initialized():
            dist.destroy_process_group()
        return int(exit_code)
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
