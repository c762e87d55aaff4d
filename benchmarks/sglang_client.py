"""SGLang's serving benchmark client against the running system (``benchmarks.system
--sglang-bench-serving PATH``).

``PATH`` is SGLang's standalone ``bench_serving.py`` (the file ``python -m
sglang.bench_serving`` ran up to the 0.4 releases, e.g. from the ``sglang==0.4.6.post5``
wheel; it needs aiohttp, numpy, requests, tqdm and transformers, not the rest of SGLang).
Later releases import the whole SGLang runtime from that module, which does not run here.

It runs as SGLang's docs show for a fixed-length workload: ``--backend sglang-oai`` (the
OpenAI completions endpoint), ``--dataset-name random --random-range-ratio 1.0``: each
prompt is text of a ShareGPT-format file, repeated or cut to exactly ``input_len`` tokens of
the model's tokenizer and decoded; ``output_len`` tokens with ignore_eos. With no network
for SGLang's ShareGPT download, the file is written here: conversations of the words our
own client builds prompts from (``serve_tokens.WORDS``). ``--dataset-name random-ids``
would need no file, but its token ids decode to text that sometimes holds the image
placeholder token, which the router refuses in a text prompt (400).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.gpu_monitor import GPU_COLUMNS, GpuMonitor, GpuSummary, gpu_cells
from benchmarks.report import fmt, markdown_table
from benchmarks.serve_tokens import WORDS

WORDS_PER_TURN = 300  # more than 1000 tokens' worth is not needed: bench_serving repeats them


@dataclass(frozen=True)
class SglangResult:
    concurrency: int
    num_requests: int
    completed: int
    output_tok_s: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    mean_itl_ms: float
    duration_s: float  # its benchmark's own duration (after its warm-up request)
    client_cpu: float  # its process's CPU seconds (start-up included) over that duration
    gpu: GpuSummary | None = None  # nvidia-smi over that duration
    mean_prompt_tokens: float | None = None  # as the server counted them, when it was asked


def write_sharegpt_words(path: Path, num_conversations: int, seed: int = 0) -> Path:
    """A ShareGPT-format file of ``num_conversations`` random-word conversations (two turns
    each): bench_serving sends at most one prompt per conversation."""
    rng = np.random.default_rng(seed)

    def turn() -> str:
        return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), WORDS_PER_TURN))

    conversations = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": turn()},
                {"from": "gpt", "value": turn()},
            ],
        }
        for i in range(num_conversations)
    ]
    path.write_text(json.dumps(conversations))
    return path


def run_sglang(
    script: Path,
    base_url: str,
    model: str,
    tokenizer_dir: Path,
    dataset: Path,
    concurrency: int,
    num_requests: int,
    input_len: int,
    output_len: int,
    out_dir: Path,
    monitor: GpuMonitor | None = None,
) -> SglangResult:
    """One run of ``script`` at ``concurrency``; raises ``RuntimeError`` when it fails.

    ``monitor``: the GPU's samples, summarized over the script's own benchmark duration, which
    ends when it wrote its result line (the file's mtime; its exit takes seconds more)."""
    out_file = out_dir / f"sglang-c{concurrency}.jsonl"
    out_file.unlink(missing_ok=True)
    command = [
        sys.executable,
        str(script),
        "--backend",
        "sglang-oai",
        "--base-url",
        base_url.removesuffix("/v1"),
        "--model",
        model,
        "--tokenizer",
        str(tokenizer_dir),
        "--dataset-name",
        "random",
        "--dataset-path",
        str(dataset),
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        "1.0",
        "--num-prompts",
        str(num_requests),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        str(concurrency),
        "--disable-tqdm",
        "--output-file",
        str(out_file),
    ]
    cpu_start = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    cpu_end = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = sum(getattr(cpu_end, f) - getattr(cpu_start, f) for f in ("ru_utime", "ru_stime"))
    if done.returncode != 0 or not out_file.is_file():
        tail = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"sglang bench_serving exited {done.returncode}:\n{tail}")
    result = json.loads(out_file.read_text().splitlines()[-1])
    duration_s = float(result["duration"])
    end = time.monotonic() - (time.time() - out_file.stat().st_mtime)  # when it was written
    return SglangResult(
        concurrency=concurrency,
        num_requests=num_requests,
        completed=int(result["completed"]),
        output_tok_s=float(result["output_throughput"]),
        mean_ttft_ms=float(result["mean_ttft_ms"]),
        mean_tpot_ms=float(result["mean_tpot_ms"]),
        mean_itl_ms=float(result["mean_itl_ms"]),
        duration_s=duration_s,
        client_cpu=cpu_s / duration_s,
        gpu=monitor.window(end - duration_s, end) if monitor is not None else None,
    )


def sglang_table_lines(
    runs: list[SglangResult],
    ours: dict[int, float],
    bounds: dict[int, float],
    sustained: dict[int, float | None] | None = None,
) -> list[str]:
    """SGLang's client at each level, beside our client's tok/s and the engine bound, and the
    sustained one (each by concurrency)."""
    sustained = sustained or {}
    header = (
        "concurrency",
        "sglang bench_serving tok/s",
        "our client tok/s",
        "engine bound tok/s",
        "sglang/bound",
        "sglang/sustained bound",
        "completed",
        "mean prompt tokens",
        "TTFT ms (sglang)",
        "TPOT ms (sglang)",
        "ITL ms (sglang)",
        "client CPU (cores)",
        *GPU_COLUMNS,
    )
    rows = []
    for run in runs:
        bound = bounds.get(run.concurrency)
        sustained_bound = sustained.get(run.concurrency)
        rows.append(
            (
                str(run.concurrency),
                fmt(run.output_tok_s, ".0f"),
                fmt(ours.get(run.concurrency), ".0f"),
                fmt(bound, ".0f"),
                fmt(bound and run.output_tok_s / bound, ".2f"),
                fmt(sustained_bound and run.output_tok_s / sustained_bound, ".2f"),
                f"{run.completed}/{run.num_requests}",
                fmt(run.mean_prompt_tokens, ".0f"),
                fmt(run.mean_ttft_ms, ".1f"),
                fmt(run.mean_tpot_ms, ".2f"),
                fmt(run.mean_itl_ms, ".2f"),
                fmt(run.client_cpu, ".2f"),
                *gpu_cells(run.gpu),
            )
        )
    return markdown_table(header, rows)
