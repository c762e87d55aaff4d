"""The serving benchmark's dataset flags: ``--dataset-name`` and each dataset's own flags.

A flag of a dataset other than the one ``--dataset-name`` names is an error (never ignored).
The generated datasets' flags are named ``--<dataset>-<field>`` (vLLM's names for
``prefix_repetition``) and fill that dataset's spec in ``benchmarks/serve_dataset.py`` in order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.serve_dataset import (
    MooncakeTraceSpec,
    MultiTurnSpec,
    PrefixRepetitionSpec,
    ShareGptSpec,
)

# dataset -> (spec, ((flag suffix, default, minimum, help), ...) in the spec's field order)
GENERATED = {
    "prefix_repetition": (
        PrefixRepetitionSpec,
        (
            ("prefix-len", 256, 1, "tokens of each shared prefix"),
            ("suffix-len", 256, 0, "tokens after the prefix, distinct per request"),
            ("num-prefixes", 10, 1, "distinct prefixes"),
            ("output-len", 128, 1, "max_tokens"),
        ),
    ),
    "multi_turn": (
        MultiTurnSpec,
        (
            ("num-turns", 3, 1, "user turns per conversation (--num-requests: all turns)"),
            ("turn-len", 256, 1, "tokens of each user turn"),
            ("output-len", 128, 1, "max_tokens of each turn"),
        ),
    ),
}
DATASETS = ("random", "sharegpt", "mooncake", *GENERATED)
Dataset = ShareGptSpec | PrefixRepetitionSpec | MultiTurnSpec | MooncakeTraceSpec
MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in the published Mooncake traces


def add_dataset_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument(
        "--dataset-path",
        type=Path,
        default=None,
        help="a local ShareGPT JSON file, or a Mooncake trace (JSON lines)",
    )
    p.add_argument(
        "--mooncake-slowdown-factor",
        type=float,
        default=None,
        help="mooncake: times between the trace's timestamps are multiplied by this (1)",
    )
    p.add_argument(
        "--mooncake-block-size",
        type=int,
        default=None,
        help=f"mooncake: tokens per hash id ({MOONCAKE_BLOCK_SIZE})",
    )
    p.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="max_tokens (default: the reply's tokens)",
    )
    p.add_argument(
        "--sharegpt-context-len", type=int, default=None, help="skip longer prompt + reply pairs"
    )
    for dataset, (_, flags) in GENERATED.items():
        for name, default, _, text in flags:
            flag = f"--{dataset.replace('_', '-')}-{name}"
            p.add_argument(flag, type=int, default=None, help=f"{dataset}: {text} ({default})")


def dataset_from_args(args: argparse.Namespace) -> Dataset | None:
    """The dataset ``--dataset-name`` names (None: random prompts); ValueError on a flag of
    another dataset or a value out of range."""
    name = args.dataset_name
    sharegpt = args.sharegpt_output_len or args.sharegpt_context_len
    mooncake = args.mooncake_slowdown_factor is not None or args.mooncake_block_size is not None
    if name != "sharegpt" and sharegpt:
        raise ValueError("--sharegpt-* need --dataset-name sharegpt")
    if name != "mooncake" and mooncake:
        raise ValueError("--mooncake-* need --dataset-name mooncake")
    if name not in ("sharegpt", "mooncake") and args.dataset_path:
        raise ValueError("--dataset-path needs --dataset-name sharegpt or mooncake")
    for dataset, (_, flags) in GENERATED.items():
        if dataset != name and any(_value(args, dataset, f[0]) is not None for f in flags):
            prefix = dataset.replace("_", "-")
            raise ValueError(f"--{prefix}-* need --dataset-name {dataset}")
    if name == "random":
        return None
    if args.input_len_range or args.output_len_range:
        raise ValueError("--input-len-range / --output-len-range apply to --dataset-name random")
    if name in GENERATED:
        return _generated(args, name)
    if args.dataset_path is None:
        raise ValueError(
            f"--dataset-name {name} needs --dataset-path (a local file; nothing is downloaded)"
        )
    if name == "mooncake":
        slowdown = 1.0 if args.mooncake_slowdown_factor is None else args.mooncake_slowdown_factor
        block_size = args.mooncake_block_size or MOONCAKE_BLOCK_SIZE
        if slowdown <= 0 or block_size < 1:
            raise ValueError("--mooncake-slowdown-factor must be > 0, -block-size >= 1")
        return MooncakeTraceSpec(args.dataset_path, slowdown, block_size)
    if (args.sharegpt_output_len or 1) < 1:
        raise ValueError("--sharegpt-output-len must be >= 1")
    return ShareGptSpec(args.dataset_path, args.sharegpt_output_len, args.sharegpt_context_len)


def _value(args: argparse.Namespace, dataset: str, name: str) -> int | None:
    return getattr(args, f"{dataset}_{name.replace('-', '_')}")


def _generated(args: argparse.Namespace, dataset: str) -> Dataset:
    spec, flags = GENERATED[dataset]
    values = []
    for name, default, minimum, _ in flags:
        value = _value(args, dataset, name)
        value = default if value is None else value
        if value < minimum:
            raise ValueError(f"--{dataset.replace('_', '-')}-{name} must be >= {minimum}")
        values.append(value)
    return spec(*values)
