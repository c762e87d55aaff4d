"""Vision encoder throughput on W rank processes: images/s on cache misses, and a 50% repeated mix.

    python -m benchmarks.encoder [--devices cuda:0 cuda:0,cuda:1] [--quick] [--out FILE.md]

Each ``--devices`` entry is one encoder: its leader and gRPC server in this process, one
rank process per listed device (``cuda:0,cuda:0``: two ranks on one GPU). With 7B
dimensions (``--config``, default benchmarks/configs/qwen2.5-vl-7b) every rank builds the
vision tower with random bf16 weights on its GPU; ``--quick`` runs the bundled tiny
checkpoint on the CPU (``--devices cpu cpu,cpu``), a smoke run. The client sends one
Encode call of B distinct 1920x1080 random-noise JPEGs (quality 90, ~1.9 MB each, what
sglang's and vLLM's bench tools send) for B in 1, 4, 16, fresh images every call (cache
misses), calls of 16 where 8 images were encoded before (the mix), and calls of one image
encoded before (a cache hit: the call's latency without a ViT, what a cached image costs
prefill); rows go to a prefill-like receiver in this process (``--transfer-backend``).
Prints a table and writes its section of ``--out``. Tests never assert on these numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from prometheus_client import CollectorRegistry
from torch import nn

from benchmarks.random_model import CONFIG_7B
from benchmarks.report import git_commit, hardware, write_section
from services.common.clients.vision_encoder import EncodeSpanInput, VisionEncoderClient
from services.common.envs import Envs
from services.common.paths import BUNDLED_MODEL
from services.common.server import HealthState
from services.common.types import ImageSpanRef
from services.engine.config import ModelConfig
from services.engine.loader import finish_model
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.processing.image import ImageProcessor
from services.engine.processing.image_file import content_hash, image_size
from services.transfer import create_embedding_receiver
from services.transfer.embeddings import BaseEmbeddingReceiver, EmbeddingBuffer
from services.vision_encoder.app import build_app, create_grpc_server
from services.vision_encoder.config import VisionEncoderConfig
from services.vision_encoder.metrics import VisionEncoderMetrics
from services.vision_encoder.rank_messages import EncoderRankInit
from services.vision_encoder.rank_step import EncoderRankStep

RANDOM_STEP = "benchmarks.encoder:RandomWeightsEncoderStep"
SECTION_TITLE = "## Vision encoder (`python -m benchmarks.encoder`)"
BATCHES = (1, 4, 16)
MIX_BATCH = 16  # half of it encoded before
CALL_TIMEOUT_S = 600.0


class RandomWeightsEncoderStep(EncoderRankStep):
    """The encoder's rank step with the vision tower built from a config alone (random weights)."""

    def load_model(self, init: EncoderRankInit, device: torch.device) -> Qwen2_5_VLModel:
        return random_vision_tower(init.model, device, getattr(torch, init.dtype or "bfloat16"))


def random_vision_tower(
    config_dir: str | Path, device: torch.device, dtype: torch.dtype
) -> Qwen2_5_VLModel:
    """Only the ViT of ``config_dir``'s model, random weights (std 0.02, norms 1) on ``device``."""
    with torch.device("meta"):
        model = Qwen2_5_VLModel(ModelConfig.from_dir(config_dir))
    model.model = model.lm_head = None
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            data = torch.empty(param.shape, dtype=dtype, device=device)
            if "norm" in type(module).__name__.lower():
                data.fill_(1.0)
            else:  # as benchmarks/random_model.py fills the whole model
                data.normal_(0.0, 0.002 if name == "bias" else 0.02, generator=generator)
            setattr(module, name, nn.Parameter(data, requires_grad=False))
    return finish_model(model, device)


def noise_jpeg(seed: int, width: int = 1920, height: int = 1080) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buf, "JPEG", quality=90
    )
    return buf.getvalue()


class Images:
    """Fresh noise JPEGs on demand (each a cache miss the first time it is sent)."""

    def __init__(self, processor: ImageProcessor) -> None:
        self.processor = processor
        self._next_seed = 0

    def fresh(self, count: int) -> list[bytes]:
        seeds = range(self._next_seed, self._next_seed + count)
        self._next_seed += count
        return [noise_jpeg(seed) for seed in seeds]

    def spans(self, images: list[bytes]) -> list[EncodeSpanInput]:
        spans, row = [], 0
        for data in images:
            grid = self.processor.grid_for_size(*image_size(data, 1 << 30))
            length = self.processor.num_image_tokens(grid)
            spans.append(
                EncodeSpanInput(ImageSpanRef(0, length, content_hash(data), grid), data, row)
            )
            row += length
        return spans


@dataclass
class Result:
    devices: str
    case: str  # "B misses" or "16, 8 cached"
    num_images: int  # per call
    call_ms: float  # median
    images_per_s: float
    vit_ms: float | None  # mean per rank-batch (None: no ViT forward ran)
    preprocess_ms: float | None


Snapshot = dict[str, tuple[float, float]]  # histogram -> (sum, count)
HISTOGRAMS = ("vit_seconds", "preprocess_seconds")


def snapshot(registry: CollectorRegistry) -> Snapshot:
    def value(name: str) -> float:
        return registry.get_sample_value(f"stageserve_vision_encoder_{name}") or 0.0

    return {h: (value(f"{h}_sum"), value(f"{h}_count")) for h in HISTOGRAMS}


def mean_ms(registry: CollectorRegistry, since: Snapshot, histogram: str) -> float | None:
    (total, count), (total0, count0) = snapshot(registry)[histogram], since[histogram]
    return 1e3 * (total - total0) / (count - count0) if count > count0 else None


async def run_encoder(args: argparse.Namespace, devices: str, images: Images) -> list[Result]:
    config = VisionEncoderConfig(
        model=Path(args.model_dir),
        devices=tuple(devices.split(",")),
        dtype=args.dtype,
        transfer_backend=args.transfer_backend,
        max_batch_images=max(BATCHES),
        step_timeout_s=600.0,
        default_timeout_s=600.0,
    )
    registry = CollectorRegistry()
    metrics = VisionEncoderMetrics(registry)
    app = build_app(config, metrics, Envs.from_environ(), step_target=args.step_target)
    health = HealthState()
    server, port = create_grpc_server(app, config, health)
    await server.start()
    receiver = create_embedding_receiver(args.transfer_backend)
    bench = Bench(
        args, devices, images, VisionEncoderClient(f"127.0.0.1:{port}"), receiver, registry
    )
    try:
        await app.start(health)
        rows_per_image = images.spans(images.fresh(1))[0].span.length
        dtype = getattr(torch, args.dtype or "float32")
        receiver.register(
            EmbeddingBuffer(rows_per_image * max(BATCHES), app.limits.hidden_size, dtype)
        )
        cases = [(f"{b} misses", b, 0) for b in BATCHES]
        cases.append((f"{MIX_BATCH}, half cached", MIX_BATCH, MIX_BATCH // 2))
        cases.append(("1 cached", 1, 1))
        results = []
        for case, batch, num_cached in cases:
            results.append(await bench.measure(case, batch, num_cached))
            print(format_row(results[-1]), flush=True)
        return results
    finally:
        await bench.client.close()
        await server.stop(None)
        await app.close()
        receiver.close()


@dataclass
class Bench:
    args: argparse.Namespace
    devices: str
    images: Images
    client: VisionEncoderClient
    receiver: BaseEmbeddingReceiver
    registry: CollectorRegistry

    async def call(self, request_id: str, images: list[bytes]) -> tuple[float, int]:
        """Seconds of one Encode call of ``images``, and its cache hits."""
        spans = self.images.spans(images)
        dst = self.receiver.destination(request_id, 0, sum(s.span.length for s in spans))
        start = time.perf_counter()
        results = await self.client.encode(request_id, spans, dst, CALL_TIMEOUT_S)
        return time.perf_counter() - start, sum(r.is_cache_hit for r in results)

    async def measure(self, case: str, batch: int, num_cached: int) -> Result:
        cached = self.images.fresh(num_cached)
        if cached:  # encoded once up front: in their owners' caches from now on
            await self.call(f"{case}-warm", cached)
        times: list[float] = []
        since = snapshot(self.registry)
        for i in range(self.args.warmup + self.args.iters):
            if i == self.args.warmup:
                since = snapshot(self.registry)
            elapsed, num_hits = await self.call(
                f"{case}-{i}", [*cached, *self.images.fresh(batch - num_cached)]
            )
            assert num_hits == num_cached, (case, num_hits)
            if i >= self.args.warmup:
                times.append(elapsed)
        return Result(
            self.devices,
            case,
            batch,
            1e3 * statistics.median(times),
            batch * len(times) / sum(times),
            mean_ms(self.registry, since, "vit_seconds"),
            mean_ms(self.registry, since, "preprocess_seconds"),
        )


HEADER = (
    "devices (one rank each)",
    "call",
    "ms per call (median)",
    "images/s",
    "x the first devices",
    "ViT ms per rank-batch",
    "decode + pixels ms per rank-batch",
)


def format_row(r: Result, base: Result | None = None) -> str:
    speedup = f"{r.images_per_s / base.images_per_s:.2f}x" if base else "-"
    cells = (
        r.devices,
        r.case,
        f"{r.call_ms:.1f}",
        f"{r.images_per_s:.2f}",
        speedup,
        "-" if r.vit_ms is None else f"{r.vit_ms:.1f}",
        "-" if r.preprocess_ms is None else f"{r.preprocess_ms:.1f}",
    )
    return "| " + " | ".join(cells) + " |"


def table_lines(results: list[Result]) -> list[str]:
    first = {r.case: r for r in results if r.devices == results[0].devices}
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return lines + [format_row(r, first.get(r.case)) for r in results]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.encoder", description=__doc__.splitlines()[0])
    p.add_argument(
        "--devices",
        nargs="+",
        default=None,
        help="one encoder per entry, one rank per listed device (default: cuda:0 cuda:0,cuda:1; "
        "--quick: cpu cpu,cpu)",
    )
    p.add_argument(
        "--config", default=str(CONFIG_7B), help="model config directory (random bf16 weights)"
    )
    p.add_argument(
        "--quick", action="store_true", help="the tiny checkpoint on the CPU, few calls (smoke run)"
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed calls per row (default 5; --quick 2)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before each row")
    p.add_argument(
        "--transfer-backend",
        default="shm",
        choices=("shm", "mooncake"),
        help="how rows reach this process's receiver (shm: /dev/shm, needs ~0.3 GB at 7B)",
    )
    p.add_argument(
        "--out", default="docs/benchmarks.md", help="markdown report to write ('' : none)"
    )
    p.add_argument("--commit", default=None, help="commit to report (default: git rev-parse)")
    args = p.parse_args(argv)
    args.devices = args.devices or (
        ["cpu", "cpu,cpu"] if args.quick else ["cuda:0", "cuda:0,cuda:1"]
    )
    args.iters = args.iters or (2 if args.quick else 5)
    args.model_dir = str(BUNDLED_MODEL) if args.quick else args.config
    args.step_target = (
        "services.vision_encoder.rank_step:EncoderRankStep" if args.quick else RANDOM_STEP
    )
    args.dtype = None if args.quick else "bfloat16"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.quick and not torch.cuda.is_available():
        print("benchmarks.encoder needs a CUDA GPU (or --quick)", file=sys.stderr)
        return 2
    images = Images(ImageProcessor.from_dir(args.model_dir))
    results: list[Result] = []
    for devices in args.devices:
        results += asyncio.run(run_encoder(args, devices, images))
    lines = table_lines(results)
    print("\n".join(lines))
    if args.out:
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = shlex.join(sys.argv[1:] if argv is None else argv)
        machine = hardware() if torch.cuda.is_available() else f"CPU only, {os.cpu_count()} cores"
        weights = "its weights" if args.quick else "random bf16 vision tower"
        header = [
            f"- hardware: {machine}",
            f"- command: `python -m benchmarks.encoder {command}`",
            f"- commit: {args.commit or git_commit()}",
            f"- model: {Path(args.model_dir).name} ({weights})",
            f"- date: {date}",
            "",
        ]
        notes = [
            "",
            "One Encode call per sample, through gRPC; a rank-batch: one rank's share of a step.",
            "Target (issue 11): W = 2 on two GPUs >= 1.8x W = 1 on cache misses.",
        ]
        write_section(Path(args.out), SECTION_TITLE, header + lines + notes)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
