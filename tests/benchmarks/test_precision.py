"""The system benchmark's ``--quantization`` / ``--kv-cache-dtype``: the flags ``up`` gives
prefill and decode read back as the precision asked for, and a service that runs another is
refused, by name."""

from __future__ import annotations

import pytest

from benchmarks.precision import SERVICES, Precision, check_services
from services.engine.quantization import FP8, FP8_E4M3
from services.launch_config import LaunchConfig
from services.launch_spec import decode_spec, prefill_spec

FP8_BOTH = Precision(FP8, FP8_E4M3)


def _services_argv(cfg: LaunchConfig) -> dict[str, list[str]]:
    """Each service's command line as ``up`` starts it for ``cfg``."""
    specs = {"prefill": prefill_spec(cfg, ""), "decode": decode_spec(cfg)}
    return {name: ["python", "-m", f"services.{name}", *specs[name].args] for name in SERVICES}


@pytest.mark.parametrize(
    "precision", [Precision(), Precision(FP8), Precision(kv_cache_dtype=FP8_E4M3), FP8_BOTH]
)
def test_what_up_gives_the_services_reads_back_as_the_precision(precision) -> None:
    cfg = LaunchConfig(quantization=precision.quantization, kv_cache_dtype=precision.kv_cache_dtype)
    argvs = _services_argv(cfg)
    assert {name: Precision.from_argv(argv) for name, argv in argvs.items()} == dict.fromkeys(
        SERVICES, precision
    )
    line = check_services(precision, argvs)
    assert line.startswith("prefill and decode ran ")
    assert f"`--quantization {precision.quantization}`" in line
    assert f"`--kv-cache-dtype {precision.kv_cache_dtype}`" in line


def test_a_service_that_runs_another_precision_is_refused() -> None:
    argvs = _services_argv(LaunchConfig(quantization=FP8))  # KV pages left in bf16
    with pytest.raises(RuntimeError, match="prefill ran .*; decode ran .*--kv-cache-dtype auto"):
        check_services(FP8_BOTH, argvs)


def test_the_flags_are_the_non_default_settings_as_up_takes_them() -> None:
    assert Precision().flags() == [] and Precision().is_default
    assert FP8_BOTH.flags() == ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]
    assert Precision.from_argv(FP8_BOTH.flags()) == FP8_BOTH
    assert Precision.from_argv(["--quant", "fp8", "--kv", "fp8_e4m3"]) == Precision()  # no prefixes
