"""``subgroups.split_world``: a world of C x T gloo processes splits into C inner groups of T
adjacent ranks and T outer groups of the ranks at the same inner place (collectives over each
sum exactly its members); ``agree_on_manifest`` refuses, on every rank, a group whose ranks
read different checkpoints, naming the rank."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.ranks.rank_main import gloo_options
from services.common.ranks.step import RankContext
from services.common.ranks.subgroups import (
    agree_on_manifest,
    disagreement,
    model_manifest,
    split_world,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, world: int, inner: int, port: int, model_dirs: list[str], out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=_td(60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, pg_options=gloo_options("127.0.0.1")
    )
    cpu = dist.new_group(backend="gloo", pg_options=gloo_options("127.0.0.1"))
    ctx = RankContext(rank, world, "cpu", cpu, dist.group.WORLD, 30.0)
    groups = split_world(ctx, inner)
    sums = []
    for group in (groups.inner_group, groups.outer_group):
        x = torch.tensor([float(rank)])
        if group is not None:
            dist.all_reduce(x, group=group)
        sums.append(x.item())
    try:
        agree_on_manifest(ctx, model_manifest(model_dirs[rank], tp_size=inner))
        agreed = ""
    except ValueError as exc:
        agreed = str(exc)
    out.put((rank, groups.inner_rank, groups.outer_rank, groups.outer_size, sums, agreed))
    dist.destroy_process_group()


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def run_world(world: int, inner: int, model_dirs: list[str]) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=run_rank, args=(r, world, inner, port, model_dirs, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, *rest = out.get(timeout=120)
        results[rank] = tuple(rest)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def checkpoint(tmp_path, name: str, layers: int) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    return str(path)


@pytest.mark.parametrize(("world", "inner"), [(4, 2), (2, 2), (2, 1)])
def test_split_world_sums_over_exactly_its_groups(tmp_path, world: int, inner: int) -> None:
    same = checkpoint(tmp_path, "model", 2)
    results = run_world(world, inner, [same] * world)
    for rank, (inner_rank, outer_rank, outer_size, sums, agreed) in results.items():
        assert (outer_rank, inner_rank) == divmod(rank, inner)
        assert outer_size == world // inner
        inner_members = [outer_rank * inner + i for i in range(inner)]
        outer_members = [o * inner + inner_rank for o in range(world // inner)]
        assert sums == [float(sum(inner_members)), float(sum(outer_members))], rank
        assert agreed == ""


def test_a_rank_reading_another_checkpoint_stops_the_group_naming_it(tmp_path) -> None:
    same, other = checkpoint(tmp_path, "a", 2), checkpoint(tmp_path, "b", 3)
    results = run_world(2, 2, [same, other])
    for _, (*_, agreed) in results.items():
        assert "rank 1 disagrees with rank 0 about config.json" in agreed


def test_disagreement_names_the_first_rank_and_key() -> None:
    a = {"config.json": "x", "tp_size": 2}
    assert disagreement([a, dict(a), dict(a)]) is None
    assert disagreement([a, dict(a), {**a, "tp_size": 4}]) == (
        "rank 2 disagrees with rank 0 about tp_size: 4 against 2"
    )
    assert "about config.json: None" in str(disagreement([a, {"tp_size": 2}]))
