"""System benchmark: the whole system at real model size against the engine's own bound.

    python -m benchmarks.system [--out docs/benchmarks.md] [--concurrency 1,64,256]
        [--input-len 1000] [--output-len 1000] [--decode-dp 1] [--router-workers 4]
    python -m benchmarks.system --config benchmarks/configs/qwen3-vl-8b --concurrency 256 \
        --requests-per-level 1.5 --sustain-s 2
        # Qwen3-VL-8B dimensions: its own checkpoint ($TMPDIR/stageserve-qwen3-vl-8b-random) and
        # its own section; c = 256 at 1000/1000 holds 78 GB of decode KV: an H200, not an H100
    python -m benchmarks.system --concurrency 256,512 --quantization fp8 \
        --kv-cache-dtype fp8_e4m3
        # FP8 weights (the decoder's dense linears) and FP8 KV pages, in the services and the
        # engine bound alike; its own section, so the bf16 one stays (bf16 at c = 512 holds
        # 61 GB of decode KV beside 2 x 15 GB of weights: more than an 80 GB H100)
    python -m benchmarks.system --quick      # CPU smoke run on the bundled tiny model
    python -m benchmarks.system --quick --config services/assets/tiny-qwen3-vl
        # CPU smoke run of a random checkpoint of a Qwen3-VL config (its tokenizer and processor)
    python -m benchmarks.system --decode-device cuda:0,cuda:1 --decode-tp 2 --prefill-tp 2
        # tensor parallelism on two GPUs (run it against the same command without the TP flags)
    python -m benchmarks.system --decode-device cuda:0,cuda:1 --decode-dp 2 --decode-dp-attention
        # DP attention on two GPUs (the 7B MLP split over both) against the same without it
    python -m benchmarks.system --sglang-bench-serving PATH/bench_serving.py  # SGLang's too

In one run: writes (or reuses) a checkpoint of ``--config``'s dimensions (default Qwen2.5-VL-7B's,
in ``$TMPDIR/stageserve-7b-random``; another config in ``$TMPDIR/stageserve-<config>-random``,
``--checkpoint-dir`` overrides), random bf16 weights and the real vocabulary size (152,064 for
the 7B: the config family's tiny tokenizer grown to it; benchmarks/system_model.py); checks that
both models' weights and decode's KV pool can fit the GPU (in the bytes ``--quantization`` and
``--kv-cache-dtype`` make of them: benchmarks/system_memory.py); times the engine alone on the
same checkpoint's model in the same precision (one prompt's prefill, the decode rank's
pipelined loop at each concurrency's batch); starts ``stageserve up`` on the checkpoint
(prefill and decode on one GPU, KV over CUDA IPC), warms it up; runs the serving client at each
concurrency, spread over client processes, ``--input-len`` prompt tokens (as the server counts
them: the text is shorter by the chat template's tokens, measured in the warm-up) and
``--output-len`` output tokens with ignore_eos; prints one table (system against engine:
throughput, TPOT, decode's in-service step, the messages decode sent per step, router,
decode-leader and client CPU, and what ``nvidia-smi`` saw of the GPU: busy share, SM clock,
power, slowdowns) and writes its section of ``--out`` (the 7B's ``SECTION_TITLE``; another
config's or precision's names it, so the 7B bf16 section stays). With ``--sglang-bench-serving``
each level also runs SGLang's client (same concurrency, requests and lengths;
benchmarks/sglang_client.py) after ours, in a second table. ``--quick`` runs on the CPU: the
bundled tiny model as it is, or with ``--config`` a random checkpoint of that config. Tests never
assert on these numbers.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from benchmarks.gpu_monitor import GpuMonitor, gpu_monitor
from benchmarks.precision import SERVICES, Precision, add_precision_args, check_services
from benchmarks.report import command_line, write_run_section
from benchmarks.serve_metrics import Slo, steady_output_throughput, summarize
from benchmarks.sglang_client import SglangResult, run_sglang, write_sharegpt_words
from benchmarks.system_load import (
    CPU_UP,
    GPU_UP,
    Load,
    MetricDelta,
    System,
    add_system_args,
    children_cpu_seconds,
    cpu_seconds,
    histogram_mean_ms,
    run_load,
    running_system,
    template_tokens,
)
from benchmarks.system_memory import default_num_pages, fits_one_gpu
from benchmarks.system_model import (
    add_config_arg,
    engine_times,
    is_default_config,
    resolve_checkpoint_dir,
    section_title,
    write_checkpoint,
)
from benchmarks.system_table import NOTES, Level, engine_lines, sglang_lines, table_lines
from services.cli import BUNDLED_MODEL
from services.engine.processing import TextProcessor

SECTION_TITLE = "## System (`python -m benchmarks.system`)"
STEP = ("step", "decode", "stageserve_decode_step_seconds")  # decode's step histogram
MESSAGES = ("messages", "decode", "stageserve_decode_stream_messages_total")
PREFILL = ("prefill", "prefill", "stageserve_prefill_forward_seconds")  # per batch
PROMPT_TOKENS = "stageserve_request_prompt_tokens"  # the router's histogram of them
PREFILL_WAIT = ("prefill wait", "decode", "stageserve_decode_prefill_wait_seconds_total")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.system", description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="CPU smoke run: tiny model, short requests, c = 1, 4"
    )
    add_system_args(p)
    add_config_arg(p)
    add_precision_args(p)
    p.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,64,256)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 1000)")
    p.add_argument(
        "--output-len", type=int, default=None, help="output tokens, ignore_eos (default 1000)"
    )
    p.add_argument(
        "--requests-per-level",
        type=float,
        default=4.0,
        help="requests = this x concurrency (default 4: the first wave's prefill queue and the "
        "last one's drain, which the bound leaves out, weigh a quarter of the run, not a half)",
    )
    p.add_argument(
        "--decode-dp", type=int, default=1, help="decode ranks, all on the GPU prefill uses"
    )
    p.add_argument(
        "--decode-device", default=None, help="decode's devices, e.g. cuda:0,cuda:1 (one rank each)"
    )
    p.add_argument("--router-workers", type=int, default=None, help="default: stageserve up's")
    for stage in ("prefill", "decode"):  # tensor and expert parallelism, passed to up
        p.add_argument(
            f"--{stage}-tp",
            type=int,
            default=1,
            help=f"up's --{stage}-tp (processes per {stage} rank, one GPU each on CUDA)",
        )
        p.add_argument(f"--{stage}-ep", type=int, default=1, help=f"up's --{stage}-ep")
    p.add_argument(
        "--decode-dp-attention",
        action="store_true",
        help="up's --decode-dp-attention: the --decode-dp ranks split the MLP and experts",
    )
    p.add_argument(
        "--prefill-first-ms",
        type=float,
        default=None,
        help="stageserve up's --prefill-first-ms (default: up's; 0: decode never waits)",
    )
    p.add_argument(
        "--client-processes", type=int, default=None, help="default: one per 32 concurrent"
    )
    p.add_argument(
        "--sustain-s",
        type=float,
        default=None,
        help="seconds each engine phase also runs back to back for the sustained bound "
        "(default 10; --quick 0.5; 0: none)",
    )
    p.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="decode KV pages per rank (default: fits the run)",
    )
    p.add_argument(
        "--sglang-bench-serving",
        type=Path,
        default=None,
        metavar="PATH",
        help="SGLang's standalone bench_serving.py: each level runs it after our client",
    )
    args = p.parse_args(argv)
    resolve_checkpoint_dir(p, args)
    if args.sglang_bench_serving is not None and not args.sglang_bench_serving.is_file():
        p.error(f"--sglang-bench-serving {args.sglang_bench_serving}: no such file")
    if args.sustain_s is not None and args.sustain_s < 0:
        p.error(f"--sustain-s must be >= 0, got {args.sustain_s}")
    return args


def _settings(args: argparse.Namespace) -> dict:
    quick = args.quick
    levels = args.concurrency or ("1,4" if quick else "1,64,256")
    return dict(
        device="cpu" if quick else "cuda",
        attention="torch" if quick else "flashinfer",
        concurrency=tuple(int(c) for c in levels.split(",")),
        input_len=args.input_len or (64 if quick else 1000),
        output_len=args.output_len or (16 if quick else 1000),
        up=CPU_UP if quick else GPU_UP,
        sustain_s=args.sustain_s if args.sustain_s is not None else (0.5 if quick else 10.0),
    )


def _prompt_histograms(system: System) -> list[tuple[str, str, str]]:
    """Each router process's histogram of the prompt tokens of its requests."""
    return [(name, name, PROMPT_TOKENS) for name in system.pids("router")]


def _mean(delta: dict[str, float]) -> float | None:
    """The mean of histograms summed over processes (a ``MetricDelta.since``)."""
    count = sum(v for k, v in delta.items() if k.endswith(" count"))
    return sum(v for k, v in delta.items() if k.endswith(" sum")) / count if count else None


def _run_level(system: System, load: Load, num_processes: int, monitor: GpuMonitor) -> Level:
    probe = MetricDelta(system, [MESSAGES, PREFILL_WAIT], [STEP, PREFILL])
    pids = {**system.pids("router"), "decode": system.state()["decode"]["pid"]}
    cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
    clients_cpu = children_cpu_seconds()
    records, duration_s = run_load(load, num_processes)
    end, clients_cpu = time.monotonic(), children_cpu_seconds() - clients_cpu
    cpu = {name: (cpu_seconds(pid) - cpu[name]) / duration_s for name, pid in pids.items()}
    delta = probe.since()
    num_steps = delta["step count"]
    summary = summarize(records, duration_s, Slo(), load.num_requests)
    errors = Counter(r.error for r in records if r.error)
    for error, count in errors.most_common():
        print(f"c = {load.concurrency}: {count} requests failed: {error}", flush=True)
    return Level(
        concurrency=load.concurrency,
        output_tok_s=summary.output_token_throughput,
        steady_tok_s=steady_output_throughput(records, load.concurrency),
        tpot_ms=summary.tpot.mean if summary.tpot else None,
        ttft_ms=summary.ttft.mean if summary.ttft else None,
        num_ok=summary.num_ok,
        num_requests=load.num_requests,
        mean_prompt_tokens=summary.mean_prompt_tokens,
        step_ms=histogram_mean_ms(delta, "step"),
        messages_per_step=delta["messages"] / num_steps if num_steps else None,
        prefill_ms=histogram_mean_ms(delta, "prefill"),
        prefill_busy=delta["prefill sum"] / duration_s,
        decode_held=delta["prefill wait"] / duration_s,
        num_steps=round(num_steps),
        router_cpu=tuple(cpu[name] for name in sorted(cpu) if name != "decode"),
        decode_cpu=cpu["decode"],
        client_cpu=clients_cpu / duration_s,
        gpu=monitor.window(end - duration_s, end),  # the clients' longest run, not their start
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    with gpu_monitor() as monitor:
        return _run(args, argv, monitor)


def _num_ranks(args: argparse.Namespace) -> int:
    if args.decode_device:
        return len(args.decode_device.split(",")) // args.decode_tp
    return args.decode_dp


def _run(args: argparse.Namespace, argv: list[str] | None, monitor: GpuMonitor) -> int:
    settings = _settings(args)
    precision = Precision.of(args)
    input_len, output_len, levels = (
        settings["input_len"],
        settings["output_len"],
        settings["concurrency"],
    )
    num_ranks = _num_ranks(args)
    num_pages = args.num_pages or default_num_pages(levels, input_len, output_len, num_ranks)
    if (reason := fits_one_gpu(args, num_pages)) is not None:
        print(f"benchmarks.system: {reason}", file=sys.stderr)
        return 2
    if args.quick and is_default_config(args.config):
        model_dir, random_weights = BUNDLED_MODEL, False
    else:
        device = settings["device"]
        model_dir = write_checkpoint(args.checkpoint_dir, device, config_dir=args.config)
        random_weights = True
    engine = engine_times(
        model_dir,
        settings["device"],
        settings["attention"],
        input_len,
        output_len,
        levels,
        random_weights,
        settings["sustain_s"],
        monitor,
        precision,
    )
    print("\n".join(engine_lines(engine)), flush=True)
    up_args = [
        *settings["up"],
        "--model",
        str(model_dir),
        "--num-pages",
        str(num_pages),
        "--decode-dp",
        str(args.decode_dp),
        "--max-concurrent-requests",
        str(max(levels) * 2),
        "--max-running-requests",  # every request of the top level decodes at once
        str(-(-max(levels) // num_ranks)),
        "--ready-timeout-s",
        "1800",
        *precision.flags(),
    ]
    if args.router_workers:
        up_args += ["--router-workers", str(args.router_workers)]
    if args.decode_device:
        up_args += ["--decode-device", args.decode_device]
    if args.prefill_first_ms is not None:
        up_args += ["--prefill-first-ms", str(args.prefill_first_ms)]
    for flag in ("prefill_tp", "prefill_ep", "decode_tp", "decode_ep"):
        if getattr(args, flag) != 1:
            up_args += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if args.decode_dp_attention:
        up_args.append("--decode-dp-attention")
    with running_system(up_args, args.workdir, "stageserve-system-") as system:
        services_ran = check_services(precision, {s: system.argv(s) for s in SERVICES})
        model = system.served_model() or model_dir.name
        tokenizer = model_dir / "tokenizer.json"  # prompts of exactly input_len tokens
        warm_up, _ = run_load(
            Load(system.base_url, model, 4, 8, input_len, min(output_len, 32), tokenizer, seed=99),
            1,
        )
        # the levels' prompts are input_len tokens as the server counts them, as the bound's
        text_len = input_len - template_tokens(warm_up, input_len)
        results: list[Level] = []
        sglang_runs: list[SglangResult] = []
        sglang_dir = system.state_file.parent if args.sglang_bench_serving else None
        requests = [max(c, round(args.requests_per_level * c)) for c in levels]
        dataset = sglang_dir and write_sharegpt_words(
            sglang_dir / "sharegpt-words.json", max(requests)
        )
        for concurrency, num_requests in zip(levels, requests, strict=True):
            load = Load(
                system.base_url,
                model,
                concurrency,
                num_requests,
                text_len,
                output_len,
                tokenizer,
                seed=concurrency,
            )
            processes = args.client_processes or -(-concurrency // 32)
            results.append(_run_level(system, load, processes, monitor))
            print("\n".join(table_lines(results, engine, output_len)[-1:]), flush=True)
            if args.sglang_bench_serving is not None:
                assert sglang_dir is not None and dataset is not None
                prompts = MetricDelta(system, histograms=_prompt_histograms(system))
                run = run_sglang(
                    args.sglang_bench_serving,
                    system.base_url,
                    model,
                    model_dir,
                    dataset,
                    concurrency,
                    num_requests,
                    input_len,
                    output_len,
                    sglang_dir,
                    monitor,
                )
                sglang_runs.append(replace(run, mean_prompt_tokens=_mean(prompts.since())))
                lines = sglang_lines(sglang_runs, results, engine, output_len)
                print(lines[-1], flush=True)
        routers = len(system.pids("router"))
    code = system.process.returncode
    lines = table_lines(results, engine, output_len)
    if sglang_runs:
        lines += ["", *sglang_lines(sglang_runs, results, engine, output_len)]
    print("\n".join(lines))
    weights = (
        "bundled tiny model"
        if not random_weights
        else f"{args.config.resolve().name} dimensions, random bf16 weights"
    )
    vocab = TextProcessor.from_dir(model_dir).vocab_size
    info = [
        f"- model: {weights}, a byte-level BPE vocabulary of {vocab:,} ids; "
        f"`stageserve up {shlex.join(up_args)}` ({routers} router "
        f"processes, decode DP {num_ranks}); stop exit code {code}",
        f"- workload: {input_len} prompt tokens ({text_len} of text and the chat template's "
        f"{input_len - text_len}), {output_len} output tokens (ignore_eos), "
        f"greedy; engine prefill {engine.prefill_ms:.2f} ms, unpipelined decode steps "
        + ", ".join(f"b{b} {ms:.3f} ms" for b, ms in engine.decode_unpipelined_ms.items()),
        f"- precision: {services_ran}; the engine bound's model and pool held {engine.held}",
        *(f"- {line}" for line in engine_lines(engine)),
    ]
    command = command_line("benchmarks.system", argv)
    title = section_title(SECTION_TITLE, "System", "benchmarks.system", args.config, precision)
    write_run_section(args.out, title, command, info, lines, NOTES)
    return 0 if all(level.num_ok == level.num_requests for level in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
