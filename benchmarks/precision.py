"""The precision a system benchmark runs its model in: ``--quantization`` (the decoder's dense
linears' weights) and ``--kv-cache-dtype`` (the KV pages), the engine's own flags and choices
(services/engine/quantization.py). The benchmark gives them to ``stageserve up``, which passes
them to prefill and decode, and builds the engine bound's model and KV pool with them; a run
whose services' command lines say otherwise is refused (``check_services``). Kept free of torch:
the command line reads it."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.engine.quantization import (
    AUTO_KV_CACHE_DTYPE,
    FP8,
    FP8_E4M3,
    KV_CACHE_DTYPE_CHOICES,
    KV_CACHE_DTYPE_HELP,
    NO_QUANTIZATION,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
)

QUANTIZATION_OPTION = "--quantization"
KV_CACHE_DTYPE_OPTION = "--kv-cache-dtype"
SERVICES = ("prefill", "decode")  # the services that load the decoder and hold KV pages
_TITLES = {FP8: "FP8 weights", FP8_E4M3: "FP8 KV cache"}
_INFO = {
    NO_QUANTIZATION: "weights in the checkpoint's dtype",
    FP8: "the decoder's dense linears in FP8 e4m3 with per-channel scales, quantized at load; "
    "embedding, norms, LM head and MoE experts in the checkpoint's dtype",
    AUTO_KV_CACHE_DTYPE: "KV pages in the model's dtype",
    FP8_E4M3: "KV pages in FP8 e4m3, 1 byte an element, with per-layer scales",
}


@dataclass(frozen=True)
class Precision:
    """The model's weights (``quantization``) and KV pages (``kv_cache_dtype``)."""

    quantization: str = NO_QUANTIZATION
    kv_cache_dtype: str = AUTO_KV_CACHE_DTYPE

    def __post_init__(self) -> None:
        assert self.quantization in QUANTIZATION_CHOICES, self.quantization
        assert self.kv_cache_dtype in KV_CACHE_DTYPE_CHOICES, self.kv_cache_dtype

    @classmethod
    def of(cls, args: argparse.Namespace) -> Precision:
        """The precision of arguments parsed with ``add_precision_args``."""
        return cls(args.quantization, args.kv_cache_dtype)

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> Precision:
        """The precision a service's command line gives (an option it leaves out: the default,
        as ``up`` leaves out default settings)."""
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        add_precision_args(parser)
        known, _ = parser.parse_known_args(list(argv))
        return cls.of(known)

    @property
    def is_default(self) -> bool:
        return self == Precision()

    def flags(self) -> list[str]:
        """The options of the non-default settings, as ``stageserve up`` and the benchmarks take
        them."""
        flags = []
        if self.quantization != NO_QUANTIZATION:
            flags += [QUANTIZATION_OPTION, self.quantization]
        if self.kv_cache_dtype != AUTO_KV_CACHE_DTYPE:
            flags += [KV_CACHE_DTYPE_OPTION, self.kv_cache_dtype]
        return flags

    def title(self) -> str:
        """What a report's section title adds for it, e.g. ``FP8 weights and FP8 KV cache``;
        '' for the default."""
        parts = [_TITLES[s] for s in (self.quantization, self.kv_cache_dtype) if s in _TITLES]
        return " and ".join(parts)

    def describe(self) -> str:
        """Both settings as options, each with what it makes of the model."""
        return (
            f"`{QUANTIZATION_OPTION} {self.quantization}` ({_INFO[self.quantization]}), "
            f"`{KV_CACHE_DTYPE_OPTION} {self.kv_cache_dtype}` ({_INFO[self.kv_cache_dtype]})"
        )


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--quantization`` and ``--kv-cache-dtype``, the engine's choices and defaults."""
    p.add_argument(
        QUANTIZATION_OPTION,
        default=NO_QUANTIZATION,
        choices=QUANTIZATION_CHOICES,
        help=f"up's and the engine bound's {QUANTIZATION_OPTION}: {QUANTIZATION_HELP}",
    )
    p.add_argument(
        KV_CACHE_DTYPE_OPTION,
        default=AUTO_KV_CACHE_DTYPE,
        choices=KV_CACHE_DTYPE_CHOICES,
        help=f"up's and the engine bound's {KV_CACHE_DTYPE_OPTION}: {KV_CACHE_DTYPE_HELP}",
    )


def check_services(precision: Precision, argvs: Mapping[str, Sequence[str]]) -> str:
    """The report's line on what each service ran (``argvs``: service -> its command line);
    ``RuntimeError`` naming them when one ran another precision than ``precision``."""
    ran = {service: Precision.from_argv(argv) for service, argv in argvs.items()}
    wrong = {service: p for service, p in ran.items() if p != precision}
    if wrong:
        raise RuntimeError(
            f"the benchmark asked for {precision.describe()}, but "
            + "; ".join(f"{service} ran {p.describe()}" for service, p in wrong.items())
        )
    return f"{' and '.join(ran)} ran {precision.describe()} (their command lines)"
