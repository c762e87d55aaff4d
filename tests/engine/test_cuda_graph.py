"""CUDA-graph decode against eager decode (flashinfer, bf16, random weights made on the GPU).

Teacher-forced: both runners get the same tokens each step (eager's greedy choice), so
one near-tie cannot make the comparison drift. A small config (head dim 128, which
flashinfer supports; the bundled tiny checkpoint's head dim of 16 is not) and the 7B
config are checked; batch 3 runs padded in the graph of size 4. Padding rows must write
only the scratch page.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.random_model import CONFIG_7B, build_random_model
from services.engine.attention import ForwardMode
from services.engine.cuda_graph import DEFAULT_BATCH_SIZES, graph_batch_sizes
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.step_inputs import StepInput

pytestmark = pytest.mark.gpu

PROMPT_LENS = [5, 40, 77]
NUM_STEPS = 6


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")


def _prefill(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    steps = []
    for i, ids in enumerate(prompts):
        runner.page_table.reserve(f"r{i}", len(ids) + NUM_STEPS + 1)
        steps.append(StepInput(f"r{i}", ids, torch.arange(len(ids)).expand(3, -1), 0))
    return runner.forward(ForwardMode.EXTEND, steps)


def _decode(runner: ModelRunner, tokens: list[int], seq_lens: list[int]) -> torch.Tensor:
    steps = [
        StepInput(f"r{i}", [t], torch.full((3, 1), n, dtype=torch.long), n)
        for i, (t, n) in enumerate(zip(tokens, seq_lens, strict=True))
    ]
    return runner.forward(ForwardMode.DECODE, steps).clone()


def _compare(
    model, prompt_lens=PROMPT_LENS, graph_sizes=DEFAULT_BATCH_SIZES, padded_to=4, kv_dtype="auto"
) -> ModelRunner:
    """Teacher-forced decode steps replayed in graphs against eager ones; the graph's runner."""
    vocab = model.config.text.vocab_size
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in prompt_lens]
    kv = KVCacheConfig(256 + 2 * len(prompts), 16, dtype=kv_dtype)
    graph = ModelRunner(model, kv, "flashinfer", cuda_graph_batch_sizes=graph_sizes)
    eager = ModelRunner(model, kv, "flashinfer", cuda_graph_batch_sizes=())
    assert graph.cuda_graph is not None and eager.cuda_graph is None
    assert graph.cuda_graph.graph_size(len(prompts)) == padded_to
    tokens = _prefill(eager, prompts).argmax(-1).tolist()
    _prefill(graph, prompts)
    seq_lens = list(prompt_lens)
    for step in range(NUM_STEPS):
        expected = _decode(eager, tokens, seq_lens)
        got = _decode(graph, tokens, seq_lens)
        diff = (got - expected).abs().max().item()
        top2 = expected.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 2 * diff + 1e-3
        agree = got.argmax(-1) == expected.argmax(-1)
        print(
            f"step {step}: max |graph - eager| {diff:.4f} "
            f"(logit scale {expected.abs().max().item():.2f}); "
            f"argmax agree {agree.tolist()}"
        )
        assert diff <= 0.02 * expected.abs().max().item() + 0.05
        assert bool(agree[decided].all())
        tokens = expected.argmax(-1).tolist()
        seq_lens = [n + 1 for n in seq_lens]
    return graph


def test_graph_decode_matches_eager_small(small_config_dir):
    torch.manual_seed(0)
    _compare(build_random_model(small_config_dir, seed=1))


def test_a_batch_past_256_replays_its_large_graph_and_matches_eager(small_config_dir):
    """300 requests (a decode rank of --max-running-requests 300) run in the graph of 320."""
    torch.manual_seed(0)
    lens = [5 + i % 9 for i in range(300)]
    _compare(build_random_model(small_config_dir, seed=3), lens, graph_batch_sizes(300), 320)


def test_graph_decode_matches_eager_7b():
    torch.manual_seed(0)
    model = build_random_model(CONFIG_7B, seed=2)
    _compare(model)
    del model
    torch.cuda.empty_cache()


def test_padding_rows_write_only_the_scratch_page(small_config_dir):
    torch.manual_seed(0)
    model = build_random_model(small_config_dir, seed=3)
    runner = ModelRunner(model, KVCacheConfig(64, 16), "flashinfer")
    scratch = runner.cuda_graph.scratch_page
    prompts = [torch.randint(0, 1000, (n,)).tolist() for n in PROMPT_LENS]
    _prefill(runner, prompts)
    held = {p for i in range(len(prompts)) for p in runner.page_table.pages(f"r{i}")}
    assert scratch not in held
    before_k, before_v = runner.kv_pool.k_buffer.clone(), runner.kv_pool.v_buffer.clone()
    _decode(runner, [1, 2, 3], list(PROMPT_LENS))  # 3 requests in the graph of 4
    torch.cuda.synchronize()
    changed = {
        p
        for p in range(64)
        if not (
            torch.equal(runner.kv_pool.k_buffer[:, p], before_k[:, p])
            and torch.equal(runner.kv_pool.v_buffer[:, p], before_v[:, p])
        )
    }
    written = {runner.page_table.pages(f"r{i}")[n // 16] for i, n in enumerate(PROMPT_LENS)}
    print(f"pages changed {sorted(changed)}, written {sorted(written)}, scratch {scratch}")
    assert changed <= written | {scratch}
    assert written <= changed


def test_pipelined_device_fed_loop_matches_synchronous_loop(small_config_dir):
    """Greedy decode with the argmax kept on the device and step N+1 enqueued before step N's
    tokens are read (benchmarks' decode loop) = the one-step-at-a-time loop with host tokens."""
    torch.manual_seed(0)
    model = build_random_model(small_config_dir, seed=4)
    vocab = model.config.text.vocab_size
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in PROMPT_LENS]
    num_steps = 12
    results = []
    for pipelined in (False, True):
        runner = ModelRunner(model, KVCacheConfig(256, 16), "flashinfer")
        steps = []
        for i, ids in enumerate(prompts):
            runner.page_table.reserve(f"r{i}", len(ids) + num_steps + 1)
            steps.append(StepInput(f"r{i}", ids, torch.arange(len(ids)).expand(3, -1), 0))
        tokens = runner.forward(ForwardMode.EXTEND, steps).argmax(-1)
        seq_lens, history = list(PROMPT_LENS), []
        for _ in range(num_steps):
            decode = [
                StepInput(f"r{i}", [0], torch.full((3, 1), n, dtype=torch.long), n)
                for i, n in enumerate(seq_lens)
            ]
            if pipelined:
                tokens = runner.forward(ForwardMode.DECODE, decode, input_ids=tokens).argmax(-1)
                history.append(tokens)  # read at the end: nothing waits on the host in between
            else:
                for step, token in zip(decode, tokens.tolist(), strict=True):
                    step.input_ids = [token]
                tokens = runner.forward(ForwardMode.DECODE, decode).argmax(-1)
                history.append(tokens.clone())
            seq_lens = [n + 1 for n in seq_lens]
        results.append(torch.stack(history).tolist())
    print(f"synchronous {results[0][:3]}..., pipelined {results[1][:3]}...")
    assert results[0] == results[1]
