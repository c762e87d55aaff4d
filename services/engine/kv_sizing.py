"""How many KV pages a rank's pool holds: a share of its GPU's memory, or a count given.

A rank that owns a decode KV pool on CUDA sizes it once, at start: after its weights are
loaded, it builds a runner on a two-page pool, captures its CUDA graphs and runs one DECODE
step at its largest batch, so the peak of its own allocations holds weights, activations and
graphs. The pool takes the rest of its share::

    pages = (total * gpu_memory_utilization - (peak - profile pool)) // page_bytes

``total`` is the device's memory, ``page_bytes`` one page of every layer's K and V (one byte an
element with ``--kv-cache-dtype fp8_e4m3``, else the model dtype's size). The share is the
rank's own: ranks on one GPU split it (``services.cli_up_defaults``), and the CUDA context and
libraries' allocations outside PyTorch are not in it. Kept free of torch: the command line
reads the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.quantization import FP8_E4M3

CPU_NUM_PAGES = 16384  # a pool on the CPU, when no count is given (what `up` always had)
PROFILE_NUM_PAGES = 2  # the profile runner's pool: the graphs' scratch page and one for its rows
GB = 1e9


def kv_page_bytes(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, element_size: int
) -> int:
    """Bytes of one KV page: ``page_size`` positions of K and V in every layer."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * element_size


def kv_element_size(kv_cache_dtype: str, model_element_size: int) -> int:
    """Bytes of one stored K or V element under ``--kv-cache-dtype``."""
    return 1 if kv_cache_dtype == FP8_E4M3 else model_element_size


def pages_for_memory(total_bytes: int, utilization: float, used_bytes: int, page_bytes: int) -> int:
    """Pages that fit in ``utilization`` of ``total_bytes`` next to ``used_bytes`` already held;
    ``ValueError`` naming the numbers when not one does."""
    assert page_bytes > 0 and total_bytes > 0 and used_bytes >= 0
    budget = int(total_bytes * utilization)
    num_pages = (budget - used_bytes) // page_bytes
    if num_pages < 1:
        raise ValueError(
            f"--gpu-memory-utilization {utilization:g} of the {total_bytes / GB:.1f} GB device "
            f"is {budget / GB:.1f} GB, and weights, activations and CUDA graphs take "
            f"{used_bytes / GB:.1f} GB: no room for a KV page ({page_bytes / 1e6:.1f} MB); raise "
            "it, or give --num-pages"
        )
    return num_pages


@dataclass(frozen=True)
class KVPoolSize:
    """A pool's size and where it came from, for the start-up log line."""

    num_pages: int
    page_size: int
    page_bytes: int
    utilization: float | None = None  # None: a count (``source``), not a share
    total_bytes: int = 0  # the device's memory (with a utilization)
    used_bytes: int = 0  # weights, activations and graphs beside the pool (with a utilization)
    source: str = "--num-pages"  # where a count came from

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def describe(self) -> str:
        pool = (
            f"KV pool: {self.num_pages} pages, {self.num_tokens} tokens, {self.nbytes / GB:.2f} GB"
        )
        if self.utilization is None:
            return f"{pool} ({self.source})"
        return (
            f"{pool} (--gpu-memory-utilization {self.utilization:g} of "
            f"{self.total_bytes / GB:.1f} GB, less {self.used_bytes / GB:.2f} GB of weights, "
            "activations and CUDA graphs)"
        )
