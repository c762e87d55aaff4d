"""TTFT of context-parallel prefill: one text request at several lengths, CP = 1 vs C ranks.

Each configuration is a real prefill rank group (``services.prefill.rank_step``), driven with
one ``RankPlan`` per measurement: the time is the step's (forward over every layer with the
per-layer K/V all-gather, first token, the KV write into a decode pool held by this process),
what prefill adds to TTFT apart from Encode. The all-gather's share is timed inside the ranks
(each gather synchronized on GPU) in a separate, instrumented run, so it does not slow the
TTFT runs. ``--quick``: the bundled tiny model on CPU ranks (a smoke run for CI machines).

Two GPUs (the targets: >= 1.7x at 8k, >= 1.9x at 32k, never slower at >= 2k, all-gather
<= 5 % of layer time):
  python -m benchmarks.cp_ttft --configs "cuda:0;cuda:0,cuda:1" --lengths 2048,8192,32768 \\
      --block-tokens 64,128 --random-7b
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

import msgspec
import torch

from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.group import RankGroup
from services.common.ranks.step import RankContext
from services.common.types import SamplingParams
from services.engine.attention.context_parallel import KvExchange
from services.engine.config import ModelConfig
from services.engine.kv_cache import KVPool
from services.prefill.messages import SHARDED, PassSegment, RankPlan, RankRequest, RankResult
from services.prefill.rank_step import PrefillRankInit, PrefillRankStep
from services.transfer import create_kv_receiver

TINY = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tiny-qwen2.5-vl"
)
TARGET = "benchmarks.cp_ttft:BenchStep"


class BenchInit(msgspec.Struct, frozen=True):
    prefill: PrefillRankInit
    random_7b: bool = (
        False  # seeded random Qwen2.5-VL-7B weights made on the device (same on every rank)
    )
    time_gathers: bool = False


class BenchResult(RankResult, frozen=True):
    gather_s: float = 0.0  # this rank's time in K/V all-gathers (time_gathers only)


class BenchStep(PrefillRankStep):
    """The production step; optionally a random 7B model and timed all-gathers."""

    init_type = BenchInit
    result_type = BenchResult

    def __init__(self, ctx: RankContext, init: BenchInit) -> None:
        if init.random_7b:
            import services.prefill.rank_step as rank_step
            from benchmarks import random_model

            def random_7b(*args, **kwargs):
                return random_model.build_random_model(device=ctx.device)

            rank_step.load_model = random_7b  # type: ignore[attr-defined]
        super().__init__(ctx, init.prefill)
        self._gather_s = 0.0
        if init.time_gathers:
            self._time_gathers()

    def _time_gathers(self) -> None:
        gather = KvExchange._gather
        step = self

        def timed(exchange, rows, poison):
            sync = torch.cuda.synchronize if exchange.device.type == "cuda" else (lambda: None)
            sync()
            start = time.perf_counter()
            out = gather(exchange, rows, poison)
            sync()
            step._gather_s += time.perf_counter() - start
            return out

        KvExchange._gather = timed  # type: ignore[method-assign]

    def execute(self, step: int, payload) -> BenchResult:
        self._gather_s = 0.0
        result = super().execute(step, payload)
        return BenchResult(**msgspec.structs.asdict(result), gather_s=self._gather_s)


@dataclass
class Config:
    devices: tuple[str, ...]
    model: str
    dtype: str | None
    random_7b: bool
    page_size: int
    kv_backend: str


def decode_pool(config: ModelConfig, num_tokens: int, page_size: int, device: str, backend: str):
    text = config.text
    num_pages = -(-num_tokens // page_size)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    pool = KVPool(
        text.num_hidden_layers,
        num_pages,
        page_size,
        text.num_key_value_heads,
        text.head_dim,
        dtype,
        device,
    )
    receiver = create_kv_receiver(backend)
    receiver.register(pool)
    return receiver


async def measure(
    cfg: Config, lengths: list[int], blocks: list[int], repeats: int, time_gathers: bool
):
    """{(length, block): (mean step s, max gather share)} of one rank group."""
    model_config = ModelConfig.from_dir(cfg.model)
    max_len = max(lengths)
    init = PrefillRankInit(
        model=cfg.model,
        dtype=cfg.dtype,
        num_pages=-(-max_len // cfg.page_size) + 8,
        page_size=cfg.page_size,
        embedding_rows=16,
        attention_backend="flashinfer" if cfg.devices[0].startswith("cuda") else "torch",
        transfer_backend="shm",
        kv_backend=cfg.kv_backend,
        transfer_hostname="127.0.0.1",
        kv_exchange_over_cpu=len(set(cfg.devices)) < len(cfg.devices),
    )
    group = RankGroup(
        RankGroupConfig(
            name=f"bench-cp{len(cfg.devices)}",
            devices=cfg.devices,
            step_timeout_s=600,
            start_timeout_s=900,
            collective_timeout_s=600,
            internal_token=os.environ.get("STAGESERVE_INTERNAL_TOKEN", ""),
        ),
        StepSpec(TARGET, BenchResult, BenchInit(init, cfg.random_7b, time_gathers)),
    )
    await group.start()
    receiver = decode_pool(
        model_config,
        max_len,
        cfg.page_size,
        "cpu" if cfg.kv_backend == "shm" else cfg.devices[-1],
        cfg.kv_backend,
    )
    out: dict[tuple[int, int], tuple[float, float]] = {}
    try:
        plan_id = 0
        for length in lengths:
            ids = tuple(
                int(t) for t in torch.randint(10, model_config.text.vocab_size - 10, (length,))
            )
            for block in blocks if len(cfg.devices) > 1 else [1]:
                times, shares = [], []
                for _ in range(repeats + 1):  # the first run warms this shape up
                    plan_id += 1
                    dst = receiver.destination(
                        f"r{plan_id}", list(range(-(-length // cfg.page_size)))
                    )
                    request = RankRequest(
                        f"r{plan_id}",
                        ids,
                        (),
                        SamplingParams(temperature=0.0),
                        dst,
                        time.time() + 600,
                        -1,
                    )
                    plan = RankPlan(
                        plan_id, (request,), ((PassSegment(0, 0, length),),), SHARDED, block
                    )
                    start = time.perf_counter()
                    results = await group.step(plan)
                    times.append(time.perf_counter() - start)
                    shares.append(
                        max((r.gather_s / r.forward_s if r.forward_s else 0.0) for r in results)
                    )
                out[(length, block)] = (sum(times[1:]) / repeats, max(shares[1:]))
    finally:
        await group.aclose()
        receiver.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cp_ttft", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--configs", default="cuda:0;cuda:0,cuda:1", help="';'-separated rank device lists"
    )
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument(
        "--block-tokens", default="64,128", help="--cp-block-tokens values tried at C > 1"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=TINY)
    p.add_argument(
        "--random-7b", action="store_true", help="seeded random Qwen2.5-VL-7B weights on each GPU"
    )
    p.add_argument(
        "--kv-backend", default=None, help="decode pool transfer: shm (CPU) | cuda_ipc (GPU)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny model on CPU ranks: cpu;cpu,cpu at 256,1024 tokens",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.configs, args.lengths, args.block_tokens, args.repeats = (
            "cpu;cpu,cpu",
            "256,1024",
            "1,16,64,128",
            2,
        )
    configs = [tuple(c.split(",")) for c in args.configs.split(";")]
    lengths = [int(x) for x in args.lengths.split(",")]
    blocks = [int(x) for x in args.block_tokens.split(",")]
    model = (
        str(__import__("benchmarks.random_model", fromlist=["CONFIG_7B"]).CONFIG_7B)
        if args.random_7b
        else args.model
    )
    rows = {}
    for devices in configs:
        backend = args.kv_backend or ("cuda_ipc" if devices[0].startswith("cuda") else "shm")
        cfg = Config(
            devices,
            model,
            "bfloat16" if devices[0].startswith("cuda") else None,
            args.random_7b,
            16,
            backend,
        )
        ttft = asyncio.run(measure(cfg, lengths, blocks, args.repeats, time_gathers=False))
        gathers = (
            asyncio.run(measure(cfg, lengths, blocks, 1, time_gathers=True))
            if len(devices) > 1
            else {}
        )
        for key, (seconds, _) in ttft.items():
            rows[(len(devices), *key)] = (seconds, gathers.get(key, (0.0, 0.0))[1])
    print(f"{'tokens':>7} {'C':>2} {'block':>5} {'step ms':>9} {'vs C=1':>7} {'gather share':>12}")
    for (c, length, block), (seconds, share) in sorted(
        rows.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])
    ):
        base = rows.get((1, length, 1), (None,))[0]
        speedup = f"{base / seconds:6.2f}x" if base and c > 1 else "      -"
        print(
            f"{length:>7} {c:>2} {block:>5} {seconds * 1e3:>9.1f} {speedup} {share * 100:>11.1f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
