"""The system benchmark's model: a checkpoint with 7B dimensions, random bf16 weights and the
bundled tokenizer's vocabulary, and the engine's own times on the same weights.

The checkpoint takes the 7B config with the bundled tokenizer's vocabulary size and special
token ids, and that tokenizer's files, so every id the model samples decodes to text and a
client counts the tokens the server does; its vision tower and ``preprocessor_config.json``
(image sizes up to 12.8 M pixels) are the 7B config's, so an image becomes as many tokens as
with the real model. The weights are ``build_random_model``'s (seeded,
made on the device), so the engine rows, timed in the benchmark's process on weights built
the same way, see the same model as the services that load the file.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import engine_rows as er
from benchmarks.random_model import CONFIG_7B, build_random_model
from services.cli import BUNDLED_MODEL
from services.engine.attention import ForwardMode
from services.engine.model_runner import ModelRunner, StepInput

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
PREPROCESSOR_FILE = (
    "preprocessor_config.json"  # the config's: image sizes belong to the vision tower
)
TOKEN_ID_FIELDS = (
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


def checkpoint_config(config_dir: Path = CONFIG_7B, tokenizer_dir: Path = BUNDLED_MODEL) -> dict:
    """The 7B config with the tokenizer model's vocabulary size and special token ids."""
    config = json.loads((config_dir / "config.json").read_text())
    tokens = json.loads((tokenizer_dir / "config.json").read_text())
    config.update({name: tokens[name] for name in TOKEN_ID_FIELDS if name in tokens})
    return config


def write_checkpoint(
    out_dir: Path,
    device: str,
    seed: int = 0,
    config_dir: Path = CONFIG_7B,
    tokenizer_dir: Path = BUNDLED_MODEL,
) -> Path:
    """Write the benchmark checkpoint in ``out_dir``; its weights are kept when its config matches
    (the tokenizer and preprocessor files are copied every time)."""
    config = checkpoint_config(config_dir, tokenizer_dir)
    weights = out_dir / "model.safetensors"
    config_path = out_dir / "config.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
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
    save_file(state, str(weights))
    print(
        f"wrote {weights} ({weights.stat().st_size / 1e9:.1f} GB) "
        f"in {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return out_dir


@dataclass(frozen=True)
class EngineTimes:
    """The engine alone on the benchmark's model: one prompt's prefill, a decode step per batch."""

    prompt_len: int
    context_len: int  # of the decode rows: the prompt plus half the output (the run's mean)
    prefill_ms: float
    decode_ms: dict[int, float]  # batch -> pipelined step (the decode rank's loop)
    decode_unpipelined_ms: dict[int, float]

    def bound_tok_s(self, batch: int, output_len: int) -> float:
        """Output tok/s if the GPU did nothing but these: each request's prefill, then its
        ``output_len`` tokens at ``batch`` per step (prefill and decode time-share the GPU)."""
        per_request_ms = self.prefill_ms + output_len * self.decode_ms[batch] / batch
        return output_len / per_request_ms * 1e3


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_ms(runner: ModelRunner, num_tokens: int, iters: int = 3) -> float:
    """Median wall time of one prompt's EXTEND step, device idle before and after each."""
    request_id = "bench-prefill"
    runner.page_table.reserve(request_id, num_tokens)
    step = StepInput(request_id, [7] * num_tokens, torch.arange(num_tokens).expand(3, -1), 0)
    times = []
    try:
        for i in range(iters + 1):
            _synchronize(runner.device)
            start = time.perf_counter()
            runner.forward(ForwardMode.EXTEND, [step])
            _synchronize(runner.device)
            if i:  # the first is a warm-up
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        runner.page_table.release(request_id)
    return sorted(times)[len(times) // 2]


def engine_times(
    model_dir: Path,
    device: str,
    attention: str,
    prompt_len: int,
    output_len: int,
    batches: tuple[int, ...],
    random_weights: bool,
) -> EngineTimes:
    """Time the engine on the benchmark's model (built as the checkpoint was, or loaded from it)."""
    from services.engine.loader import load_model

    if random_weights:
        model = build_random_model(model_dir, device=device)
    else:
        model = load_model(model_dir, device=device, components=("language",))
    context_len = prompt_len + output_len // 2
    max_tokens = max(batches) * (context_len + 1) + prompt_len
    runner = er.make_runner(model, max_tokens, attention, max_batch=max(batches))
    decode, unpipelined = {}, {}
    request_ids = [f"bench-decode-{i}" for i in range(max(batches))]
    for request_id in request_ids:
        runner.page_table.reserve(request_id, context_len + 1)
    try:
        for batch in batches:
            steps = er._decode_steps(request_ids[:batch], context_len)
            decode[batch] = er.decode_loop_ms(runner, steps)
            unpipelined[batch] = er.decode_loop_ms(
                runner, steps, num_steps=20, warmup=3, is_overlapped=False
            )
    finally:
        for request_id in request_ids:
            runner.page_table.release(request_id)
    prefill = prefill_ms(runner, prompt_len)
    del runner, model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return EngineTimes(prompt_len, context_len, prefill, decode, unpipelined)
