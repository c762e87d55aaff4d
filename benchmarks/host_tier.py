"""The prefix cache's host tier (L2) and, with ``--kv-store``, its shared KV store (L3) against
recomputing: a prompt's KV prefilled, moved out and fetched back as a prefill rank does it
(``PrefixPages.apply``).

    python -m benchmarks.host_tier [--out docs/benchmarks.md] [--tokens 8192,32768] [--kv-store]
    python -m benchmarks.host_tier --quick [--kv-store]   # CPU, the bundled tiny model

For each prompt length: the prefill forward of that many tokens (the cost of a cache miss),
then the page moves of its full pages: spill (device pages -> host tier) and load (host tier
-> device pages). The loaded KV is checked bit for bit against what the forward wrote. Target
(issue 38): a 32k-token prefix back on the GPU >= 5x faster than recomputing it.

A spill copies to host memory beside the step's stream on a GPU: the table gives how long it
holds that stream up (to an event queued on it right after the spill) against when its copy
landed, and a spill followed at once by a forward that overwrites the freed pages (loaded
back and checked bit for bit after) against the forward alone.

``--kv-store`` (needs Mooncake): for each prompt length a ``mooncake_master`` on loopback and
three store clients in this process, like three prefill workers: one lends the segment, one
writes the prompt's full pages (``PrefixPages.write_to_store``) and one fetches them into its
own device pages (``CacheMoves.fetch``), checked bit for bit against what the forward wrote.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.random_model import CONFIG_7B, build_random_model
from benchmarks.report import command_line, markdown_table, write_run_section
from services.common.paths import BUNDLED_MODEL
from services.engine.attention import ForwardMode
from services.engine.loader import load_model
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.step_inputs import StepInput
from services.prefill.kv_store_master import master_binary
from services.prefill.messages import CacheMoves
from services.prefill.prefix_pages import PrefixPages

SECTION_TITLE = "## Prefix cache host tier (`python -m benchmarks.host_tier`)"
PAGE_SIZE = 16
TARGET_SPEEDUP = 5.0  # load vs recompute of a 32k-token prefix
NOTES = [
    "Recompute: one EXTEND forward of the prompt's tokens (random ids) writing its KV into "
    "the pool, median of the timed runs after a warm-up. L2 host rows: write is the spill, "
    "`PrefixPages.apply` of the full pages' keys into the host tier (a gather into page-major "
    "order on the device, then one copy per run of consecutive host slots into the tier's "
    "pinned tensor); fetch is the load, back into other device pages (one copy per run of "
    "slots into a device buffer, then a scatter on the device). Each move is timed to the "
    "device's synchronize; the loaded pages equal the computed ones bit for bit (checked every "
    "run). GB/s counts K and V of every layer of the moved pages (KV MB, 1e6 bytes); fetch "
    "ms/MB is fetch ms over KV MB; speedup is recompute ms over fetch ms.",
    "On a GPU the spill's gather runs on the step's stream and its copy to the pinned tier on a "
    "side stream (issue 38). Spill holds stream: from an event on the step's stream before "
    "`apply` to one queued on it right after (what a forward queued next waits for; it "
    "includes the CPU's launches). Spill copy landed: from the same start to an event queued on "
    "the tier's side stream after the copy. Spill + forward: the spill, then at once the "
    "recompute's forward on pages that include the ones just freed, to the synchronize; "
    "against recompute ms it shows what of the spill stays on the step's path (the spilled "
    "pages, loaded back, are checked bit for bit). On the CPU nothing overlaps: the spill "
    "holds the step for all of its time.",
]


def _time_ms(fn: Callable[[], object], on_cuda: bool, iters: int) -> float:
    times = []
    for _ in range(iters):
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _time_spill(pages: PrefixPages, keys: tuple[bytes, ...], on_cuda: bool) -> tuple[float, ...]:
    """One spill of ``keys``: ms to the synchronize, ms the step's stream is held up, ms to
    the copy landing in the host tier (the three are one time on the CPU)."""
    if not on_cuda:
        ms = _time_ms(lambda: pages.apply(CacheMoves(spill=keys)), False, 1)
        return ms, ms, ms
    assert pages.host is not None and pages.host.stream is not None
    start, held, landed = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize()
    begin = time.perf_counter()
    start.record()
    pages.apply(CacheMoves(spill=keys))
    held.record()  # what a forward queued now would wait for
    landed.record(pages.host.stream)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - begin) * 1e3
    return wall_ms, start.elapsed_time(held), start.elapsed_time(landed)


def _prompt(runner: ModelRunner, num_tokens: int) -> list[int]:
    return torch.randint(0, runner.model.config.text.vocab_size, (num_tokens,)).tolist()


def _page_keys(first: int, num_pages: int) -> tuple[bytes, ...]:
    return tuple(i.to_bytes(16, "little") for i in range(first, first + num_pages))


def _forward(runner: ModelRunner, request_id: str, ids: list[int]) -> None:
    step = StepInput(request_id, ids, torch.arange(len(ids)).expand(3, -1), 0)
    runner.forward(ForwardMode.EXTEND, [step])


def _prefill(
    runner: ModelRunner, pages: PrefixPages, ids: list[int], keys: tuple[bytes, ...]
) -> list[int]:
    """``ids`` computed into new pages; ``pages`` keeps the full ones under ``keys``. Their
    page numbers."""
    pages.lend("prompt", (), len(ids))
    _forward(runner, "prompt", ids)
    computed = runner.page_table.pages("prompt")[: len(keys)]
    pages.settle("prompt", (), keys, computed=True)
    return computed


def measure(runner: ModelRunner, num_tokens: int, iters: int) -> dict[str, float]:
    """Recompute, spill and load times (ms) and the bytes moved for a ``num_tokens`` prompt;
    the spill's hold on the step's stream, its copy's end, and a spill then a forward."""
    on_cuda = runner.device.type == "cuda"
    num_full = num_tokens // PAGE_SIZE
    pages = PrefixPages(runner.page_table, runner.kv_pool, num_host_pages=num_full)
    ids = _prompt(runner, num_tokens)
    keys = _page_keys(0, num_full)

    def forward(request_id: str) -> None:
        _forward(runner, request_id, ids)

    def spill_then_forward() -> None:
        """The spill, then at once a forward over pages that include the ones it freed."""
        pages.apply(CacheMoves(spill=keys))
        runner.page_table.reserve("overwrite", num_tokens)
        try:
            forward("overwrite")
        finally:
            runner.page_table.release("overwrite")

    runner.page_table.reserve("warm-up", num_tokens)
    try:
        forward("warm-up")
        recompute_ms = _time_ms(lambda: forward("warm-up"), on_cuda, iters)
    finally:
        runner.page_table.release("warm-up")
    first = _prefill(runner, pages, ids, keys)
    pool = runner.kv_pool
    k_ref, v_ref = pool.k_buffer[:, first].clone(), pool.v_buffer[:, first].clone()
    spill, hold, landed, load, overlapped = [], [], [], [], []

    def check() -> None:
        back = [pages._pages[k] for k in keys]  # noqa: SLF001 (the loaded copies)
        assert torch.equal(pool.k_buffer[:, back], k_ref), "the host tier changed K"
        assert torch.equal(pool.v_buffer[:, back], v_ref), "the host tier changed V"

    for _ in range(iters):
        wall_ms, hold_ms, landed_ms = _time_spill(pages, keys, on_cuda)
        spill.append(wall_ms)
        hold.append(hold_ms)
        landed.append(landed_ms)
        pool.k_buffer[:, first] = 0  # the pages it comes back to hold other KV now
        load.append(_time_ms(lambda: pages.apply(CacheMoves(load=keys)), on_cuda, 1))
        check()
        overlapped.append(_time_ms(spill_then_forward, on_cuda, 1))
        pages.apply(CacheMoves(load=keys))
        check()  # the forward right after the spill did not reach the spilled KV
    pages.clear()
    return {
        "recompute_ms": recompute_ms,
        "spill_ms": statistics.median(spill),
        "spill_hold_ms": statistics.median(hold),
        "spill_landed_ms": statistics.median(landed),
        "spill_forward_ms": statistics.median(overlapped),
        "load_ms": statistics.median(load),
        "bytes": 2 * pool.num_layers * pool.page_nbytes * num_full,
    }


def _row(
    num_tokens: int,
    tier: str,
    nbytes: int,
    recompute_ms: float,
    write_ms: float,
    fetch_ms: float,
    spill_stream: tuple[str, ...] = ("-", "-", "-"),
) -> tuple[str, ...]:
    mb = nbytes / 1e6
    return (
        f"{num_tokens:,}",
        tier,
        f"{mb:.1f}",
        f"{recompute_ms:.1f}",
        f"{write_ms:.1f}",
        f"{nbytes / write_ms / 1e6:.3g}",
        f"{fetch_ms:.1f}",
        f"{fetch_ms / mb:.3g}",
        f"{nbytes / fetch_ms / 1e6:.3g}",
        f"{recompute_ms / fetch_ms:.1f}x",
        *spill_stream,
    )


HEADER = (
    "tokens",
    "tier",
    "KV MB",
    "recompute ms",
    "write ms",
    "write GB/s",
    "fetch ms",
    "fetch ms/MB",
    "fetch GB/s",
    "speedup",
    "spill holds stream ms",
    "spill copy landed ms",
    "spill + forward ms",
)


def _measure_rows(
    runner: ModelRunner, num_tokens: int, iters: int, kv_store: bool
) -> tuple[list[tuple[str, ...]], dict[str, float]]:
    """The L2 row of ``num_tokens`` and (``kv_store``) its L3 row; the L3 measurement."""
    m = measure(runner, num_tokens, iters)
    spill_stream = tuple(
        f"{m[k]:.1f}" for k in ("spill_hold_ms", "spill_landed_ms", "spill_forward_ms")
    )
    rows = [
        _row(
            num_tokens,
            "L2 host",
            m["bytes"],
            m["recompute_ms"],
            m["spill_ms"],
            m["load_ms"],
            spill_stream,
        )
    ]
    if not kv_store:
        return rows, {}
    from benchmarks.host_tier_store import measure_store  # it imports this module's helpers

    s = measure_store(runner, num_tokens, iters)
    rows.append(
        _row(num_tokens, "L3 store", s["bytes"], m["recompute_ms"], s["put_ms"], s["fetch_ms"])
    )
    return rows, s


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.host_tier", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU, the bundled tiny model")
    p.add_argument(
        "--tokens", default=None, help="prompt lengths, comma-separated (default 8192,32768)"
    )
    p.add_argument("--iters", type=int, default=3, help="timed runs of each measurement")
    p.add_argument(
        "--kv-store",
        action="store_true",
        help="also the shared KV store (L3): a mooncake_master and clients on loopback",
    )
    p.add_argument("--out", default="docs/benchmarks.md", help="'' writes no section")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.kv_store:
        master_binary()  # without Mooncake: fails now, saying what to install
    lens = [
        int(t) for t in (args.tokens or ("256,1024" if args.quick else "8192,32768")).split(",")
    ]
    if args.quick:
        model = load_model(str(BUNDLED_MODEL), device="cpu", components=("language",))
        backend, weights = "torch", "bundled tiny model, CPU"
    else:
        model = build_random_model(CONFIG_7B)
        backend, weights = "flashinfer", "7B decoder dimensions, random bf16, one GPU"
    # the prompt, and the pages it comes back to (L2) or another rank fetches it into (L3)
    num_pages = -(-max(lens) // PAGE_SIZE) * 2 + 2
    runner = ModelRunner(
        model, KVCacheConfig(num_pages, PAGE_SIZE), backend, cuda_graph_batch_sizes=()
    )
    rows, stores = [], []
    for num_tokens in lens:
        length_rows, store = _measure_rows(runner, num_tokens, args.iters, args.kv_store)
        for row in length_rows:
            print(" | ".join(row), flush=True)
        rows += length_rows
        stores += [store] if store else []
    table = markdown_table(HEADER, rows)
    print("\n".join(table))
    # the L2 row's speedup at 32k tokens
    at_32k = [r[9] for r in rows if r[0] == f"{32768:,}" and r[1] == "L2 host"]
    verdict = (
        f"target: a 32k-token prefix loaded >= {TARGET_SPEEDUP:g}x faster than recomputed: "
        + (
            ("met" if float(at_32k[0][:-1]) >= TARGET_SPEEDUP else "not met") + f" ({at_32k[0]})"
            if at_32k
            else "not measured in this run"
        )
    )
    info = [f"- model: {weights}; {PAGE_SIZE}-token pages; attention {backend}", f"- {verdict}"]
    notes = NOTES
    if args.kv_store:
        from benchmarks.host_tier_store import STORE_NOTE, store_info

        info += store_info(lens, stores)
        notes = [*NOTES, STORE_NOTE]
    write_run_section(
        args.out, SECTION_TITLE, command_line("benchmarks.host_tier", argv), info, table, notes
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
