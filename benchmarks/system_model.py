"""The system benchmarks' model: a checkpoint of a config's dimensions (Qwen2.5-VL-7B by default,
``--config`` another, e.g. ``benchmarks/configs/qwen3-vl-8b``), random bf16 weights and the real
vocabulary size, and the engine's own times on the same weights.

The checkpoint takes the config, its vocabulary size included (152,064 for the 7B, 151,936 for
Qwen3-VL-8B), with the special token ids of the config family's tiny model in
``services/assets`` (``tiny-qwen2.5-vl`` or ``tiny-qwen3-vl``: ``tokenizer_dir_for``), at the
top level and in ``text_config`` alike; its ``tokenizer.json`` is that model's grown to the
vocabulary size (``benchmarks/vocab_tokenizer.py``) and its tokenizer config (chat template) and
generation config are copied, so the ``lm_head`` and the sampler cover the real model's logits,
every id the model samples decodes to text and a client counts the tokens the server does. Its
vision tower and ``preprocessor_config.json`` are the config's (7B: 14-pixel patches, images up
to 12.8 M pixels; Qwen3-VL-8B: 16-pixel patches, DeepStack), so an image becomes as many tokens
as with the real model. The weights are ``build_random_model``'s (seeded, made on the device),
so the engine rows, timed in the benchmark's process on weights built the same way from the
checkpoint's config (quantized and with a KV pool as ``--quantization`` and ``--kv-cache-dtype``
say, as the services' are), see the same model as the services that load the file. Each config
gets its own checkpoint directory by default (``default_checkpoint_dir``) and each config and
precision its own section of the report (``section_title``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import engine_rows as er
from benchmarks.gpu_monitor import GpuMonitor, GpuSummary
from benchmarks.precision import Precision
from benchmarks.random_model import CONFIG_7B, build_random_model
from benchmarks.vocab_tokenizer import write_grown_tokenizer
from services.cli import BUNDLED_MODEL
from services.engine.attention import ForwardMode
from services.engine.config import ModelConfig
from services.engine.model.registry import family
from services.engine.model_runner import ModelRunner
from services.engine.step_inputs import StepInput

TOKENIZER_FILES = ("tokenizer_config.json", "generation_config.json")  # tokenizer.json is grown
PREPROCESSOR_FILE = (
    "preprocessor_config.json"  # the config's: image sizes belong to the vision tower
)
SPECIAL_ID_FIELDS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


REPO = Path(__file__).resolve().parent.parent
QWEN3_TOKENIZER_DIR = BUNDLED_MODEL.parent / "tiny-qwen3-vl"  # the Qwen3-VL family's tiny model


def is_default_config(config_dir: str | Path) -> bool:
    """Whether ``config_dir`` is the 7B config the benchmarks default to."""
    return Path(config_dir).resolve() == CONFIG_7B.resolve()


def config_label(config_dir: str | Path) -> str:
    """``config_dir`` as a command names it: relative to the repository when inside it."""
    path = Path(config_dir).resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(config_dir)


def default_checkpoint_dir(config_dir: str | Path) -> Path:
    """The checkpoint directory of a config's random model: one per config, so a run on one
    config never loads another's weights (the 7B's keeps its old name)."""
    name = "7b" if is_default_config(config_dir) else Path(config_dir).resolve().name
    return Path(tempfile.gettempdir()) / f"stageserve-{name}-random"


def section_title(
    default_title: str,
    heading: str,
    module: str,
    config_dir: str | Path,
    precision: Precision = Precision(),
) -> str:
    """``default_title`` for the 7B config in the default precision; otherwise a title naming
    the config and the precision, e.g. ``## System at qwen3-vl-8b dimensions (`python -m
    benchmarks.system --config ...`)`` or ``## System with FP8 weights and FP8 KV cache
    (`python -m benchmarks.system --quantization fp8 --kv-cache-dtype fp8_e4m3`)``."""
    is_default = is_default_config(config_dir)
    if is_default and precision.is_default:
        return default_title
    name, flags = heading, []
    if not is_default:
        name += f" at {Path(config_dir).resolve().name} dimensions"
        flags += ["--config", config_label(config_dir)]
    if not precision.is_default:
        name += f" with {precision.title()}"
        flags += precision.flags()
    return f"## {name} (`python -m {module} {' '.join(flags)}`)"


def add_config_arg(p: argparse.ArgumentParser) -> None:
    """``--config``, and ``--checkpoint-dir`` (``add_system_args``'s) defaulting to the config's
    own directory; call ``resolve_checkpoint_dir`` on the parsed arguments."""
    p.add_argument(
        "--config",
        type=Path,
        default=CONFIG_7B,
        help="model config directory whose dimensions the random checkpoint takes (default: "
        "Qwen2.5-VL-7B's, benchmarks/configs/qwen2.5-vl-7b; e.g. benchmarks/configs/qwen3-vl-8b)",
    )
    p.set_defaults(checkpoint_dir=None)


def resolve_checkpoint_dir(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.config / "config.json").is_file():
        p.error(f"--config {args.config}: no config.json there")
    if args.checkpoint_dir is None:
        args.checkpoint_dir = default_checkpoint_dir(args.config)


def tokenizer_dir_for(config_dir: str | Path) -> Path:
    """The tiny model of ``config_dir``'s family whose tokenizer, chat template and special ids
    the checkpoint takes: ``tiny-qwen3-vl`` for a Qwen3-VL config, the bundled one otherwise."""
    config = ModelConfig.from_dict(json.loads((Path(config_dir) / "config.json").read_text()))
    return QWEN3_TOKENIZER_DIR if family(config.architecture).is_qwen3 else BUNDLED_MODEL


def _special_ids(raw: dict) -> dict:
    """A config's special token ids, wherever it keeps them (``text_config`` first)."""
    merged = {**raw, **(raw.get("text_config") or {})}
    return {name: merged[name] for name in SPECIAL_ID_FIELDS if name in merged}


def checkpoint_config(config_dir: Path = CONFIG_7B, tokenizer_dir: Path | None = None) -> dict:
    """The config (its vocabulary size kept) with the tokenizer model's special token ids: at the
    top level, and in ``text_config`` where it holds them (Qwen3-VL keeps bos/eos there)."""
    config = json.loads((Path(config_dir) / "config.json").read_text())
    tokenizer_dir = tokenizer_dir or tokenizer_dir_for(config_dir)
    ids = _special_ids(json.loads((Path(tokenizer_dir) / "config.json").read_text()))
    text = config.get("text_config")
    for name, value in ids.items():
        if text is not None and name in text:
            text[name] = value
        if text is None or name in config or name not in text:
            config[name] = value
    return config


def checkpoint_vocab_size(config: dict) -> int:
    return ModelConfig.from_dict(config).text.vocab_size


def write_checkpoint(
    out_dir: Path,
    device: str,
    seed: int = 0,
    config_dir: Path = CONFIG_7B,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write the benchmark checkpoint of ``config_dir`` in ``out_dir``; its weights are kept when
    its config matches (the tokenizer, grown to the config's vocabulary size, and the
    preprocessor file are written every time). ``tokenizer_dir``: default the config family's
    tiny model (``tokenizer_dir_for``)."""
    config_dir = Path(config_dir)
    tokenizer_dir = Path(tokenizer_dir or tokenizer_dir_for(config_dir))
    config = checkpoint_config(config_dir, tokenizer_dir)
    weights = out_dir / "model.safetensors"
    config_path = out_dir / "config.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    write_grown_tokenizer(
        tokenizer_dir / "tokenizer.json", out_dir / "tokenizer.json", checkpoint_vocab_size(config)
    )
    shutil.copy(config_dir / PREPROCESSOR_FILE, out_dir / PREPROCESSOR_FILE)
    if (
        weights.is_file()
        and config_path.is_file()
        and json.loads(config_path.read_text()) == config
    ):
        return out_dir
    from safetensors.torch import save_file

    config_path.write_text(json.dumps(config, indent=2))
    started = time.monotonic()
    model = build_random_model(out_dir, device=device, seed=seed)
    state = {name: tensor.contiguous().cpu() for name, tensor in model.state_dict().items()}
    del model  # the caller then starts the system on the same GPU: hold none of its memory
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    save_file(state, str(weights))
    print(
        f"wrote {weights} ({weights.stat().st_size / 1e9:.1f} GB) "
        f"in {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return out_dir


@dataclass(frozen=True)
class EngineTimes:
    """The engine alone on the benchmark's model: one prompt's prefill, a decode step per batch.

    The first times are a few runs each after an idle GPU (as ``benchmarks.engine`` times its
    rows); the sustained ones the same work back to back for seconds, the GPU at the power and
    clocks a loaded run holds it to (an H200 under this workload runs at its 700 W cap)."""

    prompt_len: int
    context_len: int  # of the decode rows: the prompt plus half the output (the run's mean)
    prefill_ms: float
    decode_ms: dict[int, float]  # batch -> pipelined step (the decode rank's loop)
    decode_unpipelined_ms: dict[int, float]
    sustained_prefill_ms: float | None = None
    sustained_decode_ms: dict[int, float] = field(default_factory=dict)
    gpu: dict[str, GpuSummary | None] = field(default_factory=dict)  # phase -> nvidia-smi
    held: str = ""  # what the timed model and pool held (``held_dtypes``)

    def bound_tok_s(self, batch: int, output_len: int) -> float:
        """Output tok/s if the GPU did nothing but these: each request's prefill, then its
        ``output_len`` tokens at ``batch`` per step (prefill and decode time-share the GPU)."""
        return _bound(self.prefill_ms, self.decode_ms[batch], batch, output_len)

    def sustained_bound_tok_s(self, batch: int, output_len: int) -> float | None:
        """``bound_tok_s`` of the sustained times; None where they were not measured."""
        step = self.sustained_decode_ms.get(batch)
        if self.sustained_prefill_ms is None or step is None:
            return None
        return _bound(self.sustained_prefill_ms, step, batch, output_len)


def _bound(prefill_ms: float, step_ms: float, batch: int, output_len: int) -> float:
    per_request_ms = prefill_ms + output_len * step_ms / batch
    return output_len / per_request_ms * 1e3


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_ms(
    runner: ModelRunner, num_tokens: int, iters: int = 3, sustain_s: float = 0.0
) -> float:
    """Median wall time of one prompt's EXTEND step, the device idle before and after each;
    with ``sustain_s``, of the second half of such steps run back to back for that long."""
    request_id = "bench-prefill"
    runner.page_table.reserve(request_id, num_tokens)
    step = StepInput(request_id, [7] * num_tokens, torch.arange(num_tokens).expand(3, -1), 0)
    times = []
    try:
        end = time.perf_counter() + sustain_s
        for i in itertools.count():
            _synchronize(runner.device)
            start = time.perf_counter()
            runner.forward(ForwardMode.EXTEND, [step])
            _synchronize(runner.device)
            if i:  # the first is a warm-up
                times.append((time.perf_counter() - start) * 1e3)
            if i >= iters and time.perf_counter() >= end:
                break
    finally:
        runner.page_table.release(request_id)
    times = times[len(times) // 2 :] if sustain_s else times
    return sorted(times)[len(times) // 2]


def sustained_decode_ms(runner: ModelRunner, steps: list[StepInput], sustain_s: float) -> float:
    """``decode_loop_ms``'s step with loops run back to back for ``sustain_s``: the mean of the
    second half's."""
    times = [er.decode_loop_ms(runner, steps, warmup=0)]
    end = time.perf_counter() + sustain_s
    while time.perf_counter() < end:
        times.append(er.decode_loop_ms(runner, steps, warmup=0))
    half = times[len(times) // 2 :]
    return sum(half) / len(half)


def engine_times(
    model_dir: Path,
    device: str,
    attention: str,
    prompt_len: int,
    output_len: int,
    batches: tuple[int, ...],
    random_weights: bool,
    sustain_s: float = 0.0,
    monitor: GpuMonitor | None = None,
    precision: Precision = Precision(),
) -> EngineTimes:
    """Time the engine on the benchmark's model (built as the checkpoint was, or loaded from it),
    its weights and KV pool in ``precision``, as the services hold them.

    ``sustain_s`` > 0: also the sustained times, each phase back to back for that long;
    ``monitor``: what the GPU did in each phase (``EngineTimes.gpu``)."""
    from services.engine.loader import load_model

    quantization = precision.quantization
    if random_weights:
        model = build_random_model(model_dir, device=device, quantization=quantization)
    else:
        components = ("language",)
        model = load_model(model_dir, device, components=components, quantization=quantization)
    context_len = prompt_len + output_len // 2
    max_tokens = max(batches) * (context_len + 1) + prompt_len
    runner = er.make_runner(
        model, max_tokens, attention, max(batches), kv_cache_dtype=precision.kv_cache_dtype
    )
    held = held_dtypes(runner)
    decode, unpipelined, sustained = {}, {}, {}
    gpu: dict[str, GpuSummary | None] = {}

    def watched(phase: str, measure, *args, **kwargs) -> float:
        start = time.monotonic()
        result = measure(*args, **kwargs)
        if monitor is not None:
            gpu[phase] = monitor.window(start, time.monotonic())
        return result

    request_ids = [f"bench-decode-{i}" for i in range(max(batches))]
    steps = {batch: er._decode_steps(request_ids[:batch], context_len) for batch in batches}
    for request_id in request_ids:
        runner.page_table.reserve(request_id, context_len + 1)
    try:  # the short times first, on a GPU that was idle
        for batch in batches:
            decode[batch] = watched(f"decode b{batch}", er.decode_loop_ms, runner, steps[batch])
            unpipelined[batch] = er.decode_loop_ms(
                runner, steps[batch], num_steps=20, warmup=3, is_overlapped=False
            )
        prefill = watched("prefill", prefill_ms, runner, prompt_len)
        sustained_prefill = None
        if sustain_s > 0:
            for batch in batches:
                sustained[batch] = watched(
                    f"sustained decode b{batch}",
                    sustained_decode_ms,
                    *(runner, steps[batch], sustain_s),
                )
            sustained_prefill = watched(
                "sustained prefill", prefill_ms, runner, prompt_len, sustain_s=sustain_s
            )
    finally:
        for request_id in request_ids:
            runner.page_table.release(request_id)
    del runner, model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return EngineTimes(
        prompt_len,
        context_len,
        prefill,
        decode,
        unpipelined,
        sustained_prefill,
        sustained,
        gpu,
        held,
    )


def held_dtypes(runner: ModelRunner) -> str:
    """The dtypes of the first decoder layer's fused q/k/v weight (FP8 with --quantization fp8)
    and of the runner's KV pages (FP8 with --kv-cache-dtype fp8_e4m3)."""
    qkv = runner.model.model.layers[0].self_attn.qkv_weight
    names = [str(dtype).removeprefix("torch.") for dtype in (qkv.dtype, runner.kv_pool.dtype)]
    return f"q/k/v weights {names[0]}, KV pages {names[1]}"
