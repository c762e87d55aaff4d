"""Run jobs on tensor-parallel groups of real processes (gloo on 127.0.0.1).

``run_groups`` spawns ``world`` processes once (the imports are most of a rank's cost on a
small CPU) and runs every job on a group of each size it asks: ranks ``0 .. size - 1``, the
others idle meanwhile. A job is a module-level function called in each member as
``fn(rank, size, group, *args)``; what it returns comes back through a queue. Every process it
starts is stopped before it returns, on failure too, and no wait is unbounded.

``run_tp_groups`` runs the offline engine so: with an MoE model's experts split over the group
when asked (``expert_parallel``: ep = tp), or as DP-attention groups (``dp_attention``: only
the MLP and MoE layers split; every rank runs the same requests, so each forward has as many
rows on every rank, as decode's padding makes them). On ``cuda`` every rank uses ``cuda:0``
and the collectives stay on gloo (NCCL needs a GPU per rank), so graphs are off.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

COLLECTIVE_TIMEOUT_S = 60.0  # a rank stuck in a collective fails instead of hanging


@dataclass(frozen=True)
class RankResult:
    rank: int  # in its TP group
    prompt_logits: list[np.ndarray]  # per request [prompt_len, vocab] fp32
    token_ids: list[list[int]]  # greedy continuation of each request
    split_bytes: int  # bytes of this rank's slices of the split parameters
    split_total_bytes: int  # bytes those parameters have whole in the checkpoint
    expert_bytes: int  # bytes of this rank's expert parameters (0 for a dense model)


def _rank_main(rank, world, store_path, jobs, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        from services.common.ranks.rank_main import gloo_options

        options = gloo_options("127.0.0.1")
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store_path, world),
            rank=rank,
            world_size=world,
            timeout=timeout,
            pg_options=options,
        )
        sizes = sorted({size for _, _, job_sizes in jobs for size in job_sizes})
        groups = {  # every rank takes part in forming each group, members or not
            size: dist.new_group(list(range(size)), timeout=timeout, pg_options=options)
            for size in sizes
        }
        for job, (fn, args, job_sizes) in enumerate(jobs):
            for size in job_sizes:
                if rank < size:
                    out.put(((job, size, rank), fn(rank, size, groups[size], *args)))
    except BaseException:  # noqa: BLE001 (the parent reports any rank's failure)
        out.put(((None, None, rank), traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _engine_job(rank, size, group, model_dir, requests, layout, device, dtype) -> RankResult:
    from services.engine.parallel import TensorParallel

    expert_parallel, dp_attention = layout
    ep_size = size if expert_parallel else 1
    tp = TensorParallel(rank, size, group, ep_size, dp_attention)
    return _run(tp, model_dir, requests, device, dtype)


def _run(tp, model_dir: str, requests, device: str, dtype: str | None) -> RankResult:
    from services.engine.llm import LLMEngine
    from services.engine.loader import load_model, tp_shards
    from services.engine.model.moe import EXPERT_TENSORS
    from services.engine.model_runner import KVCacheConfig, ModelRunner

    loaded = load_model(model_dir, device=device, dtype=dtype, tp=tp)
    engine = LLMEngine(ModelRunner(loaded, KVCacheConfig(256, 4), cuda_graph_batch_sizes=()))
    model = engine.runner.model
    params = dict(model.named_parameters(remove_duplicate=False))
    shards = tp_shards(model)
    split_bytes = sum(params[n].numel() * params[n].element_size() for n in shards)
    total = sum(
        params[n].numel() * params[n].element_size() * s.total // s.size for n, s in shards.items()
    )
    experts = [p for n, p in params.items() if n.endswith(EXPERT_TENSORS)]
    expert_bytes = sum(p.numel() * p.element_size() for p in experts)
    logits = engine.prompt_logits(requests)
    outputs = engine.generate(requests)
    return RankResult(
        tp.rank,
        [x.float().cpu().numpy() for x in logits],
        [o.token_ids for o in outputs],
        split_bytes,
        total,
        expert_bytes,
    )


def run_tp_groups(
    world: int,
    sizes: tuple[int, ...],
    jobs: list[tuple[Path, list]],  # (model dir, engine requests)
    tmp_dir: Path,
    timeout_s: float = 240.0,
    expert_parallel: bool = False,
    dp_attention: bool = False,
    device: str = "cpu",
    dtype: str | None = None,
) -> dict[tuple[int, int, int], RankResult]:
    """``(job, size, rank) -> RankResult`` of the engine on every job at every group size (at
    most ``world``); ``AssertionError`` naming the rank if one fails, exits or does not answer
    within ``timeout_s``."""
    layout = (expert_parallel, dp_attention)
    engine_jobs = [
        (_engine_job, (str(d), requests, layout, device, dtype), sizes) for d, requests in jobs
    ]
    return run_groups(world, engine_jobs, tmp_dir, timeout_s)


def run_groups(world: int, jobs: list[tuple], tmp_dir: Path, timeout_s: float = 240.0) -> dict:
    """``(job, size, rank) -> fn's result`` of every job ``(fn, args, sizes)`` on each of its
    group sizes (at most ``world``); ``AssertionError`` naming the rank if one fails, exits or
    does not answer within ``timeout_s``."""
    assert all(0 < size <= world for _, _, sizes in jobs for size in sizes), (world, jobs)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_dir / "store")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, store, jobs, out)) for r in range(world)
    ]
    expected = {(j, s, r) for j, (_, _, sizes) in enumerate(jobs) for s in sizes for r in range(s)}
    results: dict = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < len(expected):
            try:
                key, result = out.get(timeout=1.0)
            except queue.Empty:  # all sent so far is read: a rank that exited sends no more
                pending = {r for _, _, r in expected - set(results)}
                dead = sorted(r for r in pending if procs[r].exitcode is not None)
                if dead or time.monotonic() > deadline:
                    why = f"exited with {[procs[r].exitcode for r in dead]}" if dead else "hung"
                    raise AssertionError(
                        f"ranks {dead or sorted(pending)} gave no result: {why}"
                    ) from None
                continue
            assert not isinstance(result, str), f"rank {key[2]} failed:\n{result}"
            results[key] = result
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        out.close()
    return results
