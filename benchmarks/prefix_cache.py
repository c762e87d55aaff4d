"""Prefix cache benchmark: the whole system with prefill's prefix cache on, then off.

    python -m benchmarks.prefix_cache [--out docs/benchmarks.md] [--concurrency 64]
        [--num-requests 128] [--prefix-len 4096] [--suffix-len 200] [--num-prefixes 2]
        [--output-len 64] [--num-turns 4] [--turn-len 256] [--num-conversations 64]
        [--image-size 640x480] [--no-image-row] [--host-cache-gb GB]
    python -m benchmarks.prefix_cache --quick   # CPU smoke run on the bundled tiny model

Writes (or reuses) the system benchmark's checkpoint (7B dimensions, vision tower included,
random bf16 weights: benchmarks/system_model.py) and starts ``stageserve up`` on it twice, one
system after the other: first with the prefix cache on (up's default), then with it off
(``--disable-prefix-cache``); ``--host-cache-gb`` gives the cache-on system up's host tier.
Each system runs the same rows, each through the serving
benchmark's client (``benchmarks/serve_run.py``), closed loop at ``--concurrency``, greedy,
ignore_eos, after a few warm-up requests of their own; a row's load is spread over client
processes (``--client-processes``, by default one per 32 in flight; each with its share of the
concurrency, of the conversations and of the shared prefixes) that build and warm up, then
start together, as ``benchmarks/system_load.py``'s do, so the client is not the bottleneck:

- *shared prefix*: the ``prefix_repetition`` dataset, ``--num-prefixes`` prompts of
  ``--prefix-len`` tokens shared by all the requests, each followed by ``--suffix-len`` tokens
  of its own (a shared system prompt);
- *multi-turn*: the ``multi_turn`` dataset, ``--num-conversations`` conversations of
  ``--num-turns`` user turns of ``--turn-len`` tokens, each turn sent with the whole history in
  front of it; its TTFT also apart for turn 1 and the turns after it;
- *new tokens only*: the reference of the multi-turn rows, random prompts as long as what a
  later turn adds (the previous reply and the new user turn: ``--turn-len + --output-len``),
  as many as the multi-turn rows' later turns;
- *image multi-turn* (unless ``--no-image-row``): the multi-turn rows with one
  ``--image-size`` noise JPEG per conversation, in its first turn.

The cache hit rate is prefill's Prometheus counters over the row (after its warm-up):
``stageserve_prefill_prefix_cache_hits_total / ..._queries_total`` (prompt tokens; a system
with the cache off counts neither). Prints one table and writes its section of ``--out``,
with the issue's targets computed from it. Tests never assert on these numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shlex
from collections.abc import Iterator
from pathlib import Path

from benchmarks.prefix_cache_rows import CACHE_STATES, RowRun, Sizes, rows, run_row
from benchmarks.prefix_cache_table import NOTES, lines_of, table_lines, target_lines
from benchmarks.report import command_line, write_run_section
from benchmarks.serve_images import parse_size
from benchmarks.system_load import CPU_UP, GPU_UP, System, add_system_args, running_system
from benchmarks.system_model import write_checkpoint
from services.cli import BUNDLED_MODEL
from services.engine.processing import TextProcessor

SECTION_TITLE = "## Prefix cache (`python -m benchmarks.prefix_cache`)"
PAGE_TOKENS = 16  # up's default --page-size
TEMPLATE_SLACK = 64  # the chat template's tokens around each turn, at most


def _up_args(quick: bool, model_dir: Path, sizes: Sizes) -> list[str]:
    if quick:
        return [*CPU_UP, "--model", str(model_dir), "--num-pages", "1024"]
    s = sizes
    width, height = s.image_size or (0, 0)
    image_tokens = math.ceil(width / 28) * math.ceil(height / 28) + 8 if s.image_size else 0
    longest = max(
        s.prefix_len + s.suffix_len + TEMPLATE_SLACK,
        s.num_turns * (s.turn_len + s.output_len + TEMPLATE_SLACK) + image_tokens,
    )
    num_pages = s.concurrency * math.ceil((longest + s.output_len) / PAGE_TOKENS) + 64
    return [
        *GPU_UP,
        "--model",
        str(model_dir),
        "--num-pages",
        str(num_pages),
        "--prefill-num-pages",  # the cache's room: 128k tokens, ~7.5 GB at 7B dims
        "8192",
        "--max-running-requests",  # every request in flight decodes at once; fewer graphs
        str(s.concurrency),
        "--max-concurrent-requests",
        str(max(2 * s.concurrency, 64)),
        "--ready-timeout-s",
        "1800",
    ]


@contextlib.contextmanager
def cache_system(
    up_args: list[str], cache: str, workdir: Path | None, keep: list[System]
) -> Iterator[System]:
    """``stageserve up`` with ``up_args`` (the cache's flags included) in ``workdir``'s
    ``cache-<cache>``, kept in ``keep``."""
    sub = workdir / f"cache-{cache}" if workdir else None
    with running_system(up_args, sub, f"stageserve-prefix-cache-{cache}-") as system:
        keep.append(system)
        yield system


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.prefix_cache", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, tiny sizes")
    add_system_args(p)
    for flag, text in (
        ("--concurrency", "requests in flight (default 64; --quick 4)"),
        ("--num-requests", "the shared-prefix row's requests (default 128; --quick 8)"),
        ("--prefix-len", "tokens of each shared prefix (default 4096; --quick 256)"),
        ("--suffix-len", "tokens after it, each request's own (default 200; --quick 32)"),
        ("--num-prefixes", "distinct shared prefixes (default 2; --quick 2)"),
        ("--output-len", "max_tokens of every request (default 64; --quick 8)"),
        ("--num-turns", "user turns per conversation, >= 2 (default 4; --quick 2)"),
        ("--turn-len", "tokens of each user turn (default 256; --quick 32)"),
        ("--num-conversations", "per multi-turn row (default: --concurrency)"),
        ("--num-warmups", "warm-up requests per row, whole conversations (default 8; --quick 2)"),
        ("--client-processes", "most client processes per row (default: one per 32 in flight)"),
    ):
        p.add_argument(flag, type=int, default=None, help=text)
    p.add_argument("--image-size", default=None, help="WxH (default 640x480; --quick 160x120)")
    p.add_argument("--no-image-row", action="store_true", help="leave out the image multi-turn")
    p.add_argument(
        "--host-cache-gb",
        type=float,
        default=None,
        help="up's --host-cache-gb for the cache-on system (default: up's, no host tier)",
    )
    args = p.parse_args(argv)
    for name in ("concurrency", "num_requests", "prefix_len", "output_len", "turn_len"):
        if (getattr(args, name) or 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if (args.num_turns or 2) < 2:
        p.error("--num-turns must be >= 2 (a later turn is what the multi-turn rows measure)")
    for name in ("suffix_len", "num_warmups"):
        if (getattr(args, name) or 0) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("num_prefixes", "num_conversations", "client_processes"):
        if (getattr(args, name) or 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def sizes_from_args(args: argparse.Namespace) -> Sizes:
    quick = args.quick

    def pick(value: int | None, full: int, small: int) -> int:
        return value if value is not None else (small if quick else full)

    concurrency = pick(args.concurrency, 64, 4)
    image = None if args.no_image_row else (args.image_size or ("160x120" if quick else "640x480"))
    return Sizes(
        concurrency=concurrency,
        num_requests=pick(args.num_requests, 128, 8),
        prefix_len=pick(args.prefix_len, 4096, 256),
        suffix_len=pick(args.suffix_len, 200, 32),
        num_prefixes=pick(args.num_prefixes, 2, 2),
        output_len=pick(args.output_len, 64, 8),
        num_turns=pick(args.num_turns, 4, 2),
        turn_len=pick(args.turn_len, 256, 32),
        num_conversations=args.num_conversations or concurrency,
        image_size=parse_size(image) if image else None,
        num_warmups=pick(args.num_warmups, 8, 2),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sizes = sizes_from_args(args)
    model_dir = BUNDLED_MODEL if args.quick else write_checkpoint(args.checkpoint_dir, "cuda")
    up_args = _up_args(args.quick, model_dir, sizes)
    tokenizer = model_dir / "tokenizer.json"  # the checkpoint's own: what the server counts
    processes = args.client_processes or math.ceil(sizes.concurrency / 32)
    host = [] if args.host_cache_gb is None else ["--host-cache-gb", f"{args.host_cache_gb:g}"]
    cache_args = {"on": host, "off": ["--disable-prefix-cache"]}
    runs: list[RowRun] = []
    systems: list[System] = []
    for cache in CACHE_STATES:
        with cache_system([*up_args, *cache_args[cache]], cache, args.workdir, systems) as system:
            model = system.served_model() or model_dir.name
            for seed, row in enumerate(rows(sizes), start=1):
                run = run_row(
                    system, model, tokenizer, row, cache, sizes, seed * 1_000_003, processes
                )
                runs.append(run)
                line = lines_of(run)[0]
                print(table_lines([line])[-1], flush=True)
    lines = [line for run in runs for line in lines_of(run)]
    table = table_lines(lines)
    targets = target_lines(lines, sizes)
    print("\n".join([*table, "", *targets]))
    s = sizes
    weights = (
        "bundled tiny model" if args.quick else "7B dimensions (vision tower included), random bf16"
    )
    codes = " / ".join(str(system.process.returncode) for system in systems)
    image = f"{s.image_size[0]}x{s.image_size[1]} noise JPEG" if s.image_size else "no image row"
    info = [
        f"- model: {weights}, a byte-level BPE vocabulary of "
        f"{TextProcessor.from_dir(model_dir).vocab_size:,} ids; cache on: `stageserve up "
        f"{shlex.join([*up_args, *cache_args['on']])}`; cache off: the same with "
        f"`{shlex.join(cache_args['off'])}`; stop exit codes (on / off) {codes}",
        f"- workload: concurrency {s.concurrency}, greedy, ignore_eos, output {s.output_len} "
        f"tokens; shared prefix: {s.num_requests} requests, {s.num_prefixes} x {s.prefix_len} "
        f"prefix tokens + {s.suffix_len}; multi-turn: {s.num_conversations} conversations x "
        f"{s.num_turns} turns of {s.turn_len} tokens; new tokens only: "
        f"{s.num_conversations * (s.num_turns - 1)} prompts of {s.turn_len + s.output_len} "
        f"tokens; image: {image} in each conversation's first turn; {s.num_warmups} warm-up "
        f"requests per row (whole conversations); client processes per row: at most "
        f"{processes}",
    ]
    command = command_line("benchmarks.prefix_cache", argv)
    write_run_section(args.out, SECTION_TITLE, command, info, [*table, "", *targets], NOTES)
    return 0 if all(line.num_ok == line.num_requests for line in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
