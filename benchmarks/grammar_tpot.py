"""Structured outputs' cost: the TPOT of JSON-schema requests against plain ones, whole system.

    python -m benchmarks.grammar_tpot [--concurrency 64] [--rounds 2] [--out docs/benchmarks.md]
    python -m benchmarks.grammar_tpot --quick      # CPU smoke run on the bundled tiny model

Writes (or reuses) the system benchmark's checkpoint (7B dimensions, random bf16 weights, the
real 152,064-id vocabulary), starts ``stageserve up`` on it as ``benchmarks.system`` does
(prefill and decode on one GPU), warms both modes up (the grammar compiles once in the router
and once per sampling process), then runs the same load ``--rounds`` times in each mode,
alternating (plain, schema, plain, schema, ...) so drift of the machine hits both: ``--
concurrency`` streams, greedy, ``--input-len`` / ``--output-len`` tokens with ignore_eos (the
schema mode without: a grammar decides where EOS may come). The schema (``response_format`` json_schema, strict) asks for an array of at least 200 objects, so
no output can complete it within the output length: the grammar constrains every token. Prints
one table (per mode: TPOT mean / p50 / p99, output tok/s, requests ok) and the schema rows'
TPOT over the plain rows', and writes its section of ``--out``. Tests never assert on these
numbers.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
from collections import Counter

from benchmarks.report import command_line, fmt, markdown_table, write_run_section
from benchmarks.serve_metrics import Slo, summarize
from benchmarks.system_load import (
    CPU_UP,
    GPU_UP,
    Load,
    add_system_args,
    run_load,
    running_system,
    template_tokens,
)
from benchmarks.system_model import write_checkpoint
from services.cli import BUNDLED_MODEL

SECTION_TITLE = "## Structured outputs' TPOT (`python -m benchmarks.grammar_tpot`)"
TEMPLATE_TOKENS = 64  # room for the chat template's tokens in each request's pages
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string", "maxLength": 16},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "name", "ok"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "ignore_eos": False,  # refused with a grammar: the schema keeps EOS out within the length
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "items", "schema": SCHEMA, "strict": True},
    },
}
MODES = {"plain": {}, "json_schema": RESPONSE_FORMAT}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.grammar_tpot", description=__doc__.splitlines()[0])
    add_system_args(p)
    p.add_argument("--quick", action="store_true", help="CPU, the bundled tiny model, short")
    p.add_argument("--concurrency", type=int, default=None, help="streams (default 64; quick 4)")
    p.add_argument("--requests", type=int, default=None, help="per run (default 2 x concurrency)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 1000)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (default 1000)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    quick = args.quick
    concurrency = args.concurrency or (4 if quick else 64)
    num_requests = args.requests or 2 * concurrency
    input_len = args.input_len or (64 if quick else 1000)
    output_len = args.output_len or (24 if quick else 1000)
    model_dir = BUNDLED_MODEL if quick else write_checkpoint(args.checkpoint_dir, "cuda")
    pages_per_request = -(-(input_len + output_len + TEMPLATE_TOKENS) // 16)
    up_args = [
        *(CPU_UP if quick else GPU_UP),
        "--model",
        str(model_dir),
        "--num-pages",
        str(concurrency * pages_per_request + 64),
        "--max-concurrent-requests",
        str(2 * concurrency),
        "--max-running-requests",
        str(concurrency),
        "--ready-timeout-s",
        "1800",
    ]
    tokenizer = model_dir / "tokenizer.json"
    runs: dict[str, list] = {mode: [] for mode in MODES}
    with running_system(up_args, args.workdir, "stageserve-grammar-") as system:
        model = system.served_model() or model_dir.name

        def load(num: int, out_len: int, text_len: int, body: dict, seed: int) -> Load:
            base = system.base_url
            return Load(base, model, min(concurrency, num), num, text_len, out_len, tokenizer,
                        seed=seed, extra_body=body)  # fmt: skip

        warm_up, _ = run_load(load(4, 8, input_len, {}, 99), 1)
        text_len = input_len - template_tokens(warm_up, input_len)
        for body in MODES.values():  # compiles the grammar everywhere before any timing
            run_load(load(concurrency, 16, text_len, body, 98), 1)
        for round_index in range(args.rounds):
            for mode, body in MODES.items():
                records, duration_s = run_load(
                    load(num_requests, output_len, text_len, body, round_index),
                    -(-concurrency // 32),
                )
                summary = summarize(records, duration_s, Slo(), num_requests)
                errors = Counter(r.error for r in records if r.error)
                for error, count in errors.most_common():
                    print(f"{mode}: {count} requests failed: {error}", flush=True)
                runs[mode].append(summary)
                tpot = summary.tpot
                print(
                    f"round {round_index} {mode}: TPOT mean "
                    f"{fmt(tpot.mean if tpot else None, '.2f')} ms, "
                    f"{summary.output_token_throughput:.0f} tok/s, "
                    f"{summary.num_ok}/{num_requests} ok",
                    flush=True,
                )
    code = system.process.returncode
    table, overhead = _table(runs, num_requests)
    print("\n".join(table))
    weights = "the bundled tiny model" if quick else "7B dimensions, random bf16 weights"
    info = [
        f"- model: {weights}; `stageserve up {shlex.join(up_args)}`; stop exit code {code}",
        f"- workload: {concurrency} streams, {num_requests} requests a run, {input_len} prompt "
        f"tokens, {output_len} output tokens (plain: ignore_eos), greedy; {args.rounds} runs of each "
        "mode, alternating; the schema mode's `response_format` is this module's `SCHEMA` "
        "(at least 200 objects: the grammar constrains every output token)",
    ]
    notes = [f"The schema rows' TPOT (mean of the runs' means) is {overhead:.3f}x the plain rows'."]
    write_run_section(
        args.out, SECTION_TITLE, command_line("benchmarks.grammar_tpot", argv), info, table, notes
    )
    return 0


def _table(runs: dict[str, list], num_requests: int) -> tuple[list[str], float]:
    """The markdown rows (one per run) and the schema mode's mean TPOT over the plain mode's."""
    header = ["mode", "run", "TPOT mean ms", "TPOT p50 ms", "TPOT p99 ms", "output tok/s"]
    header += ["output tokens / request", "ok"]
    rows, means = [], {}
    for mode, summaries in runs.items():
        values = []
        for index, summary in enumerate(summaries):
            tpot = summary.tpot
            if tpot is not None:
                values.append(tpot.mean)
            rows.append(
                [
                    mode,
                    str(index),
                    fmt(tpot.mean if tpot else None, ".2f"),
                    fmt(tpot.median if tpot else None, ".2f"),
                    fmt(tpot.at(99) if tpot else None, ".2f"),
                    f"{summary.output_token_throughput:.0f}",
                    fmt(
                        summary.total_output_tokens / summary.num_ok if summary.num_ok else None,
                        ".0f",
                    ),
                    f"{summary.num_ok}/{num_requests}",
                ]
            )
        means[mode] = statistics.fmean(values) if values else float("nan")
    return markdown_table(header, rows), means["json_schema"] / means["plain"]


if __name__ == "__main__":
    raise SystemExit(main())
