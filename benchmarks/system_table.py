"""The system benchmark's table: one row per concurrency level, the engine bound beside it."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.gpu_monitor import GPU_COLUMNS, GpuSummary, gpu_cells
from benchmarks.report import fmt, markdown_table
from benchmarks.sglang_client import SglangResult, sglang_table_lines
from benchmarks.system_model import EngineTimes


@dataclass(frozen=True)
class Level:
    """One concurrency level's run, with what the services reported over it."""

    concurrency: int
    output_tok_s: float
    steady_tok_s: float | None  # while every client decoded (ramp and drain left out)
    tpot_ms: float | None
    ttft_ms: float | None
    num_ok: int
    num_requests: int
    mean_prompt_tokens: float | None
    step_ms: float | None  # decode's in-service step (its histogram's mean over the run)
    messages_per_step: float | None  # decode -> router messages per decode step
    prefill_ms: float | None  # prefill's in-service forward per batch (its histogram's mean)
    prefill_busy: float  # the fraction of the run prefill spent in forwards
    decode_held: float  # the fraction of the run decode held steps back for prefill's forwards
    num_steps: int  # decode steps read over the run
    router_cpu: tuple[float, ...]  # each router process's cores used
    decode_cpu: float  # the decode leader's cores used
    client_cpu: float  # the client processes' cores used, all together
    gpu: GpuSummary | None  # nvidia-smi over the level; None without one


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return fmt(value, spec)


def table_lines(levels: list[Level], engine: EngineTimes, output_len: int) -> list[str]:
    header = (
        "concurrency",
        "system tok/s",
        "engine bound tok/s",
        "system/bound",
        "sustained bound tok/s",
        "system/sustained bound",
        "steady tok/s",
        "steady/bound",
        "TPOT ms",
        "engine step ms",
        "TPOT/step",
        "decode step ms (in service)",
        "in-service/engine step",
        "msgs/step",
        "prefill forward ms (in service)",
        "prefill busy",
        "decode held",
        "decode steps",
        "router CPU (cores each)",
        "decode leader CPU",
        "client CPU (cores)",
        *GPU_COLUMNS,
        "ok",
        "mean prompt tokens",
        "TTFT ms",
    )

    def cells(level: Level) -> tuple[str, ...]:
        step = engine.decode_ms.get(level.concurrency)
        bound = engine.bound_tok_s(level.concurrency, output_len) if step else None
        sustained = engine.sustained_bound_tok_s(level.concurrency, output_len)
        return (
            str(level.concurrency),
            _fmt(level.output_tok_s, ".0f"),
            _fmt(bound, ".0f"),
            _fmt(bound and level.output_tok_s / bound),
            _fmt(sustained, ".0f"),
            _fmt(sustained and level.output_tok_s / sustained),
            _fmt(level.steady_tok_s, ".0f"),
            _fmt(bound and level.steady_tok_s and level.steady_tok_s / bound),
            _fmt(level.tpot_ms),
            _fmt(step),
            _fmt(level.tpot_ms and step and level.tpot_ms / step),
            _fmt(level.step_ms),
            _fmt(level.step_ms and step and level.step_ms / step),
            _fmt(level.messages_per_step),
            _fmt(level.prefill_ms),
            _fmt(level.prefill_busy),
            _fmt(level.decode_held),
            str(level.num_steps),
            " / ".join(f"{c:.2f}" for c in level.router_cpu),
            f"{level.decode_cpu:.2f}",
            f"{level.client_cpu:.2f}",
            *gpu_cells(level.gpu),
            f"{level.num_ok}/{level.num_requests}",
            _fmt(level.mean_prompt_tokens, ".0f"),
            _fmt(level.ttft_ms, ".1f"),
        )

    return markdown_table(header, [cells(level) for level in levels])


def sglang_lines(
    runs: list[SglangResult], levels: list[Level], engine: EngineTimes, output_len: int
) -> list[str]:
    ours = {level.concurrency: level.output_tok_s for level in levels}
    bounds = {c: engine.bound_tok_s(c, output_len) for c in ours if c in engine.decode_ms}
    sustained = {c: engine.sustained_bound_tok_s(c, output_len) for c in ours}
    return sglang_table_lines(runs, ours, bounds, sustained)


def engine_lines(engine: EngineTimes) -> list[str]:
    """The engine's times, short and sustained, each with what the GPU did meanwhile."""

    def gpu(phase: str) -> str:
        summary = engine.gpu.get(phase)
        if summary is None:
            return ""
        return (
            f" (GPU busy {summary.busy:.2f}, SM {summary.sm_mhz:.0f} MHz, "
            + (f"{summary.power_w:.0f} W, " if summary.power_w is not None else "")
            + f"clocks slowed {fmt(summary.slowed, '.2f')})"
        )

    short = [f"prefill {engine.prefill_ms:.2f} ms{gpu('prefill')}"]
    short += [f"b{b} {ms:.3f} ms{gpu(f'decode b{b}')}" for b, ms in engine.decode_ms.items()]
    lines = ["engine, after an idle GPU: " + ", ".join(short)]
    if engine.sustained_prefill_ms is not None:
        sustained = [f"prefill {engine.sustained_prefill_ms:.2f} ms{gpu('sustained prefill')}"]
        sustained += [
            f"b{b} {ms:.3f} ms{gpu(f'sustained decode b{b}')}"
            for b, ms in engine.sustained_decode_ms.items()
        ]
        lines.append("engine, sustained (each phase back to back): " + ", ".join(sustained))
    return lines


NOTES = [
    "How to read it: *engine bound* is the output "
    "throughput if the GPU did nothing but the engine's",
    "own work for this workload: per request one prefill "
    "of the prompt, then its output tokens at the",
    "concurrency's batch per decode step (the decode "
    "rank's pipelined loop, `benchmarks/engine_rows.py:",
    "decode_loop`, at context prompt + output/2); prefill "
    "and decode share the one GPU, so their times add.",
    "Those times are a few runs each after an idle GPU; *sustained bound* takes the same work",
    "run back to back (`--sustain-s` seconds each, the second half counted), the GPU at the",
    "power and clocks it holds under load (the engine lines above give both, with nvidia-smi).",
    "*steady tok/s*: the output rate while every client decoded (from the concurrency-th first",
    "token to the last request's start: the first wave's prefill queue and the drain left out,",
    "the next wave's prefills in; `benchmarks/serve_metrics.py: steady_output_throughput`).",
    "*prefill forward ms*:",
    "prefill's forward per batch in service (its histogram's mean); *prefill busy*: the",
    "fraction of the run it spent in forwards; *decode held*: the fraction decode held its",
    "steps back while a prefill forward ran (prefill first on a shared GPU, `--prefill-first-ms`",
    "of `stageserve up`); *decode steps*: the steps decode read over the run.",
    "*engine step* is that loop's step; *TPOT* the "
    "client's mean time per output token; *decode step (in",
    "service)* decode's own step histogram over the run; "
    "*msgs/step* the messages decode sent to the routers",
    "per decode step (at most one per router process). CPU "
    "columns: cores used over the run (utime + stime /",
    "wall); *client CPU* all the client processes together. The load comes from several client",
    "processes so the client is never the bottleneck. GPU columns (`nvidia-smi` every 200 ms",
    "over the level, benchmarks/gpu_monitor.py): *GPU busy* the mean share of time a kernel ran",
    "(any process), *SM MHz* the mean SM clock, *GPU W* the mean power draw, *clocks slowed*",
    "the share of samples with a power-cap or thermal slowdown active.",
]
