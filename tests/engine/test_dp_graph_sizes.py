"""Which decode graph a DP-attention step replays (CPU): ``dp_graph_size``, and the runner's use
of it (``ModelRunner.set_dp_rows``, ``forward_decode``, ``idle_decode``).

Every rank of a DP-attention group must replay a graph of the same size in a step (its MLP
collectives are that size): the size comes from the group's agreed rows and the captured sizes
alone, never from a rank's own requests. There are no graphs on the CPU, so the runner here
gets ``EagerGraphs``, a stand-in for ``CudaGraphDecodeRunner`` that records what would replay
and computes it eagerly; the replays themselves are tested on a GPU
(``test_dp_graphs_gpu.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from services.engine.attention import AttentionBatch, ForwardMode
from services.engine.cuda_graph import DEFAULT_BATCH_SIZES, dp_graph_size, graph_batch_sizes
from services.engine.loader import load_model
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.parallel import TensorParallel
from services.engine.step_inputs import StepInput
from tests.conftest import TINY_MODEL_DIR

SIZES = (1, 2, 4, 8)


class EagerGraphs:
    """``CudaGraphDecodeRunner``'s interface over ``runner`` on the CPU: each call is recorded
    as ``(real rows, graph size)`` (``run_idle``: 0 real rows), and ``run`` returns the step's
    eager logits, so a loop over it streams the tokens it would without graphs."""

    def __init__(self, runner: ModelRunner, batch_sizes: tuple[int, ...] = SIZES) -> None:
        self.runner = runner
        self.batch_sizes = batch_sizes
        self.max_batch_size = batch_sizes[-1]
        self.replays: list[tuple[int, int]] = []

    def can_run(self, num_requests: int) -> bool:
        return 0 < num_requests <= self.max_batch_size

    def graph_size(self, num_requests: int) -> int:
        return next(size for size in self.batch_sizes if size >= num_requests)

    def run(
        self,
        batch: AttentionBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        before_replay: Callable[[], None] | None = None,
        size: int | None = None,
    ) -> torch.Tensor:
        n = len(batch.seq_lens)
        size = self.graph_size(n) if size is None else size
        assert 0 < n <= size and size in self.batch_sizes, (n, size)
        self.replays.append((n, size))
        runner = self.runner
        runner.attention.plan(batch)
        if before_replay is not None:
            before_replay()
        return runner.model(runner.model.embed(input_ids), positions, runner.attention)

    def run_idle(self, size: int) -> torch.Tensor:
        assert size in self.batch_sizes, size
        self.replays.append((0, size))
        return torch.zeros(size, self.runner.model.config.text.vocab_size)


def test_the_size_is_the_smallest_captured_one_that_holds_the_agreed_rows() -> None:
    assert dp_graph_size(0, SIZES) is None  # no rank has rows: no forward at all
    assert [dp_graph_size(rows, SIZES) for rows in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    assert dp_graph_size(3, (8, 2, 4)) == 4  # the captured sizes in any order
    assert dp_graph_size(1, ()) is None  # no graphs (CPU, or an MoE whose routing syncs)
    for max_batch in (1, 5, 256, 300, 1024, 5000):
        sizes = graph_batch_sizes(max_batch)
        for rows in range(1, 2 * max_batch):
            size = dp_graph_size(rows, sizes)
            if rows > sizes[-1]:
                assert size is None  # every rank eager
            else:
                assert size in sizes and size >= rows
                assert not [s for s in sizes if rows <= s < size]


@pytest.fixture(scope="module")
def dp_model():
    """The tiny checkpoint as a DP-attention group of one (the single-device model)."""
    tp = TensorParallel(0, 1, dp_attention=True)
    return load_model(TINY_MODEL_DIR, components=("language",), tp=tp)


@pytest.fixture
def runner(dp_model):
    runner = ModelRunner(dp_model, KVCacheConfig(64, 4))
    yield runner
    runner.set_dp_rows(0)  # the model is shared: the next test starts unagreed


def test_on_the_cpu_nothing_is_captured_and_the_agreed_rows_stay(runner) -> None:
    assert runner.cuda_graph is None  # even with the default sizes asked
    for rows in (0, 1, 3, 300):
        runner.set_dp_rows(rows)
        assert runner.model.tp.step_rows[0] == rows  # eager: mlp_rows pads to them


def test_the_agreed_rows_pick_the_replayed_size_for_every_step(runner) -> None:
    graphs = runner.cuda_graph = EagerGraphs(runner)
    runner.page_table.reserve("a", 8)
    runner.page_table.reserve("b", 8)
    prompts = {"a": [5, 6, 7], "b": [8, 9]}
    for request_id, ids in prompts.items():
        step = StepInput(request_id, ids, torch.arange(len(ids)).expand(3, -1), 0)
        runner.forward(ForwardMode.EXTEND, [step])

    def decode(request_ids: list[str]) -> torch.Tensor:
        steps = [  # the same token at the same position every time: the same logits
            StepInput(
                r, [1], torch.full((3, 1), len(prompts[r]), dtype=torch.long), len(prompts[r])
            )
            for r in request_ids
        ]
        return runner.forward(ForwardMode.DECODE, steps)

    eager = decode(["a", "b"])  # unagreed (step_rows 0): the size from the requests
    assert graphs.replays == [(2, 2)]
    for agreed, size in ((2, 2), (3, 4), (5, 8), (8, 8)):
        graphs.replays.clear()
        runner.set_dp_rows(agreed)
        assert runner.model.tp.step_rows[0] == size  # the graph's rows, mlp_rows pads nothing
        torch.testing.assert_close(decode(["a", "b"]), eager, rtol=0.0, atol=0.0)
        runner.idle_decode()
        assert graphs.replays == [(2, size), (0, size)]  # a rank without requests: all padding
    graphs.replays.clear()
    runner.set_dp_rows(9)  # past the largest graph: every rank eager, padded to the rows
    assert runner.model.tp.step_rows[0] == 9
    torch.testing.assert_close(decode(["a", "b"]), eager, rtol=0.0, atol=0.0)
    assert graphs.replays == []


def test_past_the_largest_graph_the_idle_step_runs_the_mlps_eagerly(runner, monkeypatch) -> None:
    graphs = runner.cuda_graph = EagerGraphs(runner)
    idles: list[int] = []
    language = runner.model.model
    original = language.idle

    def idle(dtype, device) -> None:
        idles.append(runner.model.tp.step_rows[0])
        original(dtype, device)

    monkeypatch.setattr(language, "idle", idle)
    runner.set_dp_rows(5)
    runner.idle_decode()
    runner.set_dp_rows(20)
    runner.idle_decode()
    assert graphs.replays == [(0, 8)] and idles == [20]


def test_without_dp_attention_the_size_comes_from_the_requests() -> None:
    model = load_model(TINY_MODEL_DIR, components=("language",))
    runner = ModelRunner(model, KVCacheConfig(64, 4))
    graphs = runner.cuda_graph = EagerGraphs(runner, DEFAULT_BATCH_SIZES)
    steps = [StepInput(f"r{i}", [1], torch.zeros(3, 1, dtype=torch.long), 0) for i in range(6)]
    for s in steps:
        runner.page_table.reserve(s.request_id, 4)
    runner.forward(ForwardMode.DECODE, steps[:3])
    runner.forward(ForwardMode.DECODE, steps)
    assert graphs.replays == [(3, 4), (6, 8)]
