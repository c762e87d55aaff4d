"""Engine benchmark: the machine's ceilings, then prefill / decode / ViT / KV transfer on a
7B-class model.

    python -m benchmarks.engine [--out docs/benchmarks.md] [--quick] [--no-hf] [--no-transfer]

Everything runs in one process on GPU 0 with random bf16 weights made on the GPU
(benchmarks/random_model.py); transformers runs on the same weights afterwards; the
KV-transfer rows (2+ GPUs) spawn one process per GPU. Prints the table and writes
``--out``. Tests never assert on these numbers.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import engine_rows as er
from benchmarks import hf_rows
from benchmarks.measure import Ceilings, decoder_weight_bytes, measure_ceilings
from benchmarks.random_model import CONFIG_7B, build_random_model, hf_peer
from benchmarks.report import Row, git_commit, hardware, table_lines, write_markdown
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model.registry import model_class

SECTIONS = ("prefill", "decode", "vit", "hf", "transfer")
NOTES = [
    "How to read it: *floor* is the least time the row "
    "could take on this machine: decode reads every",
    "decoder + LM-head weight once plus each request's "
    "KV (`bytes / measured copy bandwidth`); prefill and",
    "ViT do their matmul + attention FLOPs (`FLOPs / "
    "measured bf16 matmul rate`); KV transfer moves its",
    "bytes (`bytes / measured NCCL send/recv bandwidth`). "
    "*floor/ours* is the fraction of the ceiling",
    "reached. A decode step is the wall time per step "
    "of a 40-step greedy decode loop (after 5 warm-up",
    "steps; every step counted): attention plan, input "
    "upload, CUDA-graph replay, argmax, the argmax fed",
    "back on the device as the next step's input, and "
    "the tokens read on the host one step late, so the",
    "host plans step N+1 while the GPU runs step N "
    "(`benchmarks/engine_rows.py: decode_loop`; positions",
    "stay at the context length). The note gives the "
    "graph replay alone and the unpipelined step (plan,",
    "replay, argmax, sync, one at a time). transformers runs bf16 with",
    "SDPA and a DynamicCache (decode = one forward with `past_key_values`), no CUDA graphs.",
    "",
    "KV transfer (`benchmarks/transfer_bench.py`; one "
    "process per GPU, the 7B KV layout in 16-token pages,",
    "destination pages shuffled): raw NCCL send/recv is the link's ceiling; the CUDA IPC",
    "backend is one-sided, timed on prefill's rank from a shared barrier until the last",
    "write landed. A plain row is one request after the barrier "
    "(the link idle for the few ms since the previous",
    "sample); an `N x M MiB back to back` row starts N "
    "requests, then waits for each (what the prefill",
    "worker does with a batch). Each case's last "
    "transfer is checked page by page on decode's rank.",
    "The `behind a 28-layer prefill forward` rows: a "
    "stand-in forward (per layer an attention GEMM, the",
    "layer's KV counted as stored, an MLP GEMM; 0.55 TFLOP "
    "per layer) timed alone, with a 64 MiB request's",
    "KV sent after it, and with it sent layer by layer "
    "during it, interleaved; *ours* is the time the KV",
    "adds to the forward, the note also the time from the forward's end until the KV landed.",
    "",
    "Targets (issue 4): decode batch 1 <= 1.25x floor; "
    "decode batch 64 @1k >= 70% of floor throughput;",
    "prefill 8k >= 70% of the measured matmul rate; KV "
    "transfer >= 70% of NCCL bandwidth from 64 MiB;",
    "every row faster than transformers.",
]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks.engine", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=str(CONFIG_7B), help="model config directory (random weights)"
    )
    parser.add_argument("--out", default="docs/benchmarks.md", help="markdown report to write")
    parser.add_argument("--quick", action="store_true", help="a few rows only (smoke run)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument(
        "--no-transfer", action="store_true", help="skip the 2-GPU KV transfer rows"
    )
    parser.add_argument("--commit", default=None, help="commit to report (default: git rev-parse)")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}"
    )
    return parser.parse_args(argv)


def _guarded(section: str, fn: Callable[[], list[Row]]) -> list[Row]:
    try:
        rows = fn()
        for line in table_lines(rows)[2:]:  # progress: each section's rows as soon as they exist
            print(line, flush=True)
        return rows
    except Exception as exc:
        # the harness's last resort: one failed section must not lose the others
        traceback.print_exc()
        return [Row(section, "failed", None, None, note=f"{type(exc).__name__}: {exc}"[:300])]


def _engine_rows(
    model: Qwen2_5_VLModel, ceilings: Ceilings, quick: bool, sections: set[str]
) -> list[Row]:
    contexts = (1024,) if quick else er.DECODE_CONTEXTS
    batches = (1, 64) if quick else er.DECODE_BATCHES
    prefill_lens = (1024, 8192) if quick else er.PREFILL_LENS
    rows: list[Row] = []
    runner = er.make_runner(model, max(prefill_lens))  # a pool for one prompt, not decode's
    if "prefill" in sections:
        rows += _guarded("prefill", lambda: er.prefill_rows(runner, ceilings, prefill_lens))
    if "vit" in sections:
        rows += _guarded(
            "vit", lambda: er.vit_rows(runner, ceilings, (1,) if quick else er.IMAGE_COUNTS)
        )
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    if "decode" in sections:
        wanted = max(batches) * (max(contexts) + 1)
        runner = er.make_runner(model, er.pages_that_fit(model, wanted))
        rows += _guarded("decode", lambda: er.decode_rows(runner, ceilings, contexts, batches))
    return rows


def _add_hf_rows(
    rows: list[Row], model: Qwen2_5_VLModel, config_dir: str, quick: bool
) -> list[Row]:
    by_key = {(r.section, r.name): r for r in rows}
    peer = hf_peer(model, config_dir)
    measures: list[tuple[str, str, Callable[[], float]]] = []
    for batch_size in (1, 8) if quick else hf_rows.HF_DECODE_BATCHES:
        for context_len in hf_rows.HF_DECODE_CONTEXTS:
            measures.append(
                (
                    "decode",
                    er.decode_row_name(batch_size, context_len),
                    lambda b=batch_size, c=context_len: hf_rows.hf_decode_ms(peer, b, c),
                )
            )
    for num_tokens in hf_rows.HF_PREFILL_LENS:
        measures.append(
            (
                "prefill",
                er.prefill_row_name(num_tokens),
                lambda n=num_tokens: hf_rows.hf_prefill_ms(peer, n),
            )
        )
    for num_images in (1,) if quick else er.IMAGE_COUNTS:
        measures.append(
            (
                "vit",
                er.vit_row_name(num_images),
                lambda k=num_images: hf_rows.hf_vit_ms(peer, *er.image_pixels(model, k)),
            )
        )
    failed = []
    for section, name, measure in measures:
        row = by_key.get((section, name))
        if row is None:
            continue
        row.hf_ms = _guarded(
            "transformers",
            lambda m=measure, r=row: [Row(r.section, f"{r.name} (transformers)", m(), None)],
        )[0].ms
        if row.hf_ms is None:
            failed.append(
                Row(
                    "transformers",
                    f"{section} {name}",
                    None,
                    None,
                    note="failed (traceback in the log)",
                )
            )
        torch.cuda.empty_cache()
    return failed


def _transfer_rows() -> list[Row]:
    from benchmarks.transfer_bench import run_transfer_benchmark

    return run_transfer_benchmark()


def _measure_model_rows(args: argparse.Namespace) -> tuple[list[Row], str]:
    ceilings = measure_ceilings()
    ceiling_line = (
        "- ceilings (measured in this run): device copy "
        f"{ceilings.copy_bytes_per_s / 1e12:.2f} TB/s (read + write), bf16 matmul "
        f"{ceilings.matmul_flops_per_s / 1e12:.0f} TFLOP/s (8192^3)"
    )
    print(ceiling_line, flush=True)
    sections = set(args.sections.split(","))
    if not sections & {"prefill", "decode", "vit", "hf"}:
        return [], ceiling_line
    model = build_random_model(args.config)
    rows = _engine_rows(model, ceilings, args.quick, sections)
    gc.collect()
    torch.cuda.empty_cache()
    if not args.no_hf and "hf" in sections:
        rows += _guarded("transformers", lambda: _add_hf_rows(rows, model, args.config, args.quick))
    return rows, ceiling_line


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("benchmarks.engine needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows, ceiling_line = _measure_model_rows(args)
    gc.collect()
    torch.cuda.empty_cache()
    if (
        not args.no_transfer
        and "transfer" in args.sections.split(",")
        and torch.cuda.device_count() >= 2
    ):
        rows += _guarded("transfer", _transfer_rows)
    header = [
        f"- hardware: {hardware()}",
        "- command: `python -m benchmarks.engine "
        f"{shlex.join(sys.argv[1:] if argv is None else argv)}`",
        f"- commit: {args.commit or git_commit()}",
        f"- model: {Path(args.config).name} dimensions, random bf16 weights made on the GPU "
        f"(decoder + LM head {decoder_weight_bytes_of(args.config) / 1e9:.2f} "
        "GB read per decode step)",
        ceiling_line,
    ]
    print("\n".join(table_lines(rows)))
    write_markdown(Path(args.out), rows, header, NOTES)
    print(f"wrote {args.out}")
    return 0


def decoder_weight_bytes_of(config_dir: str) -> int:
    from services.engine.config import ModelConfig

    config = ModelConfig.from_dir(config_dir)
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    return decoder_weight_bytes(model) // 2  # meta params are fp32 here; the benchmark runs bf16


if __name__ == "__main__":
    raise SystemExit(main())
