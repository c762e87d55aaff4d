"""CUDA graphs under DP attention on one GPU (bf16, flashinfer, random weights; device tool,
never in CI).

Under DP attention a decode graph replays the size the group's agreed rows pick
(``ModelRunner.set_dp_rows``), not the size of the rank's own requests: its requests are
padded to it, and a rank without requests replays it all padding (``idle_decode``). Checked on
the small dense config and the small MoE one, each as a DP-attention group of one process over
a one-process NCCL group, in two layouts:

- ``alone``: ``TensorParallel(0, 1, nccl, dp_attention=True)``; ``mlp_rows`` runs the MLP
  alone (a group of one runs no collective);
- ``collectives``: ``OneRankCollectives``, whose ``mlp_rows`` pads to the step's rows,
  all-gathers and reduce-scatters over the NCCL group as a group of D ranks does, so the
  captured graphs hold NCCL collectives (captured once per size at start, replayed each step).

Checked: a padded replay (3 requests in the graph of 4 or 8, agreed rows 3 or 5) gives the
eager step's logits within bf16 tolerance (teacher-forced) and writes K/V only into the
requests' pages and the scratch page; agreed rows past the largest graph run eagerly; an
all-padding replay writes no page but the scratch page (the requests' K/V unchanged).

Not tested here: two ranks replaying together. NCCL needs a GPU per rank (two processes of
one NCCL group cannot share a GPU), so a replay whose collectives span two ranks, each with
its own rows and padding, needs two GPUs and two rank processes (``decode --ranks 2
--dp-attention`` on CUDA, e.g. the decode DP-attention tests on a 2-GPU host).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from benchmarks.random_model import build_random_model
from services.engine.cuda_graph import dp_graph_size
from services.engine.model.moe import moe_syncs_host
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.parallel import TensorParallel
from tests.engine import test_moe_graphs
from tests.engine.test_cuda_graph import NUM_STEPS, _decode, _prefill

pytestmark = pytest.mark.gpu

moe_config_dir = test_moe_graphs.moe_config_dir  # the MoE config with head dim 128 (a fixture)
SIZES = (1, 2, 4, 8)
PROMPT_LENS = [5, 40, 77]  # 3 requests, in pages of 16
AGREED = [5, 3, 9, 8, 4, 3]  # per step: graph of 8, 4, eager (past 8), 8, 4, 4
assert len(AGREED) <= NUM_STEPS  # _prefill reserves NUM_STEPS decode tokens a request


class OneRankCollectives(TensorParallel):
    """DP attention over a group of one whose MLPs still pad, all-gather and reduce-scatter
    (``TensorParallel.mlp_rows`` skips all three at size 1, as a group of one needs none): each
    captured graph holds NCCL collectives of ``step_rows`` x hidden, as a group of D ranks'
    do; over one rank they return their input."""

    def mlp_rows(self, mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor):
        rows, padded = x.shape[0], self.step_rows[0] or x.shape[0]
        assert rows <= padded, f"{rows} rows in a step agreed at {padded}"
        if rows < padded:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return self.reduce_scatter(mlp(torch.cat(parts)))[:rows]


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    """A one-process NCCL group on ``cuda:0`` (the default group of this process)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    pytest.importorskip("flashinfer")
    assert not dist.is_initialized(), "a default process group is left from another test"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def random_model(config_dir, tp: TensorParallel, seed: int) -> Qwen2_5_VLModel:
    """The engine's model for ``config_dir`` over ``tp`` with seeded random bf16 weights."""
    return build_random_model(config_dir, torch.device("cuda", 0), torch.bfloat16, seed, tp)


@pytest.fixture(
    scope="module", params=["dense-alone", "dense-collectives", "moe-alone", "moe-collectives"]
)
def dp_model(request, nccl_group, small_config_dir, moe_config_dir):
    kind, layout = request.param.split("-")
    split = TensorParallel if layout == "alone" else OneRankCollectives
    tp = split(0, 1, nccl_group, 1, True)
    config_dir = small_config_dir if kind == "dense" else moe_config_dir
    model = random_model(config_dir, tp, seed=7)
    if moe_syncs_host(model):
        pytest.skip("torch's grouped GEMM reads the offsets on the host on this GPU: no graphs")
    return model


def graph_runner(model: Qwen2_5_VLModel, num_pages: int) -> ModelRunner:
    model.tp.step_rows[0] = 0  # unagreed, whatever a failed test left
    runner = ModelRunner(model, KVCacheConfig(num_pages, 16), "flashinfer", SIZES)
    assert runner.cuda_graph is not None and runner.cuda_graph.batch_sizes == SIZES
    assert model.tp.step_rows[0] == 0  # capture restored it
    return runner


def record_replays(runner: ModelRunner) -> list[tuple[int, int]]:
    """``(real rows, graph size)`` of each replay of ``runner``'s graphs from now on."""
    graphs, replays = runner.cuda_graph, []
    assert graphs is not None
    run, run_idle = graphs.run, graphs.run_idle

    def recorded_run(batch, input_ids, positions, before_replay=None, size=None):
        replays.append((len(batch.seq_lens), size))  # the runner names the size under DP
        return run(batch, input_ids, positions, before_replay, size)

    def recorded_idle(size):
        replays.append((0, size))
        return run_idle(size)

    graphs.run, graphs.run_idle = recorded_run, recorded_idle
    return replays


def kv_pages(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    return runner.kv_pool.k_buffer.clone(), runner.kv_pool.v_buffer.clone()


def changed_pages(runner: ModelRunner, before: tuple[torch.Tensor, torch.Tensor]) -> set[int]:
    torch.cuda.synchronize()
    k, v = runner.kv_pool.k_buffer, runner.kv_pool.v_buffer
    return {
        page
        for page in range(k.shape[1])
        if not (
            torch.equal(k[:, page], before[0][:, page])
            and torch.equal(v[:, page], before[1][:, page])
        )
    }


def test_a_padded_replay_of_the_agreed_size_equals_the_eager_step(dp_model) -> None:
    torch.manual_seed(0)
    model, vocab = dp_model, dp_model.config.text.vocab_size
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in PROMPT_LENS]
    num_pages = 256
    graph = graph_runner(model, num_pages)
    eager = ModelRunner(model, KVCacheConfig(num_pages, 16), "flashinfer", ())
    assert eager.cuda_graph is None
    graph.set_dp_rows(0)  # prefill: every rank's passes as they are (a group of one here)
    tokens = _prefill(eager, prompts).argmax(-1).tolist()
    _prefill(graph, prompts)
    replays = record_replays(graph)
    scratch = graph.cuda_graph.scratch_page
    seq_lens = list(PROMPT_LENS)
    for step, agreed in enumerate(AGREED):
        size = dp_graph_size(agreed, SIZES)
        eager.set_dp_rows(agreed)  # no graphs: the MLPs pad the 3 rows to the agreed rows
        assert model.tp.step_rows[0] == agreed
        expected = _decode(eager, tokens, seq_lens)
        graph.set_dp_rows(agreed)
        assert model.tp.step_rows[0] == (agreed if size is None else size)
        before = kv_pages(graph)
        del replays[:]
        got = _decode(graph, tokens, seq_lens)
        assert replays == ([] if size is None else [(len(prompts), size)])
        written = {
            graph.page_table.pages(f"r{i}")[n // 16] for i, n in enumerate(seq_lens)
        }  # the page of each request's new token
        changed = changed_pages(graph, before)
        diff = (got - expected).abs().max().item()
        top2 = expected.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 2 * diff + 1e-3
        agree = got.argmax(-1) == expected.argmax(-1)
        print(
            f"step {step}: agreed {agreed}, graph {size}: max |graph - eager| {diff:.4f} "
            f"(logit scale {expected.abs().max().item():.2f}); argmax agree {agree.tolist()}; "
            f"pages changed {sorted(changed)}, written {sorted(written)}, scratch {scratch}"
        )
        assert diff <= 0.02 * expected.abs().max().item() + 0.05
        assert bool(agree[decided].all())
        assert written <= changed <= written | {scratch}
        tokens = expected.argmax(-1).tolist()
        seq_lens = [n + 1 for n in seq_lens]
    graph.set_dp_rows(0)


def test_an_all_padding_replay_writes_only_the_scratch_page(dp_model) -> None:
    torch.manual_seed(1)
    model, vocab = dp_model, dp_model.config.text.vocab_size
    runner = graph_runner(model, 64)
    scratch = runner.cuda_graph.scratch_page
    runner.set_dp_rows(0)
    _prefill(runner, [torch.randint(0, vocab, (n,)).tolist() for n in PROMPT_LENS])
    held = {p for i in range(len(PROMPT_LENS)) for p in runner.page_table.pages(f"r{i}")}
    assert scratch not in held
    replays = record_replays(runner)
    for agreed, size in ((3, 4), (8, 8), (1, 1)):
        before = kv_pages(runner)
        runner.set_dp_rows(agreed)  # the peers' rows; this rank has none
        assert model.tp.step_rows[0] == size
        runner.idle_decode()
        assert replays[-1] == (0, size)
        changed = changed_pages(runner, before)
        print(f"idle replay of {size}: pages changed {sorted(changed)}, scratch {scratch}")
        assert changed <= {scratch}  # every request's K/V as it was
    logits = runner.cuda_graph.run_idle(4)
    assert bool(torch.isfinite(logits).all())
    before = kv_pages(runner)
    runner.set_dp_rows(9)  # past the largest graph: the MLPs join eagerly with no rows
    runner.idle_decode()
    assert len(replays) == 4 and not changed_pages(runner, before)
    runner.set_dp_rows(0)
