"""Prefill graphs (services/engine/prefill_graph.py): a pass through the pieces, padded to a token
size, equals the eager pass: the same logits, the same K/V in every request page, the padding's
K/V only in the scratch page. On the CPU the pieces run eagerly over the same buffers and
padding (the bundled tiny model, fp32, torch attention); on a GPU (device tool, never in CI)
the pieces are CUDA graphs and attention is flashinfer's, compared in bf16."""

from __future__ import annotations

import pytest
import torch

from services.engine.attention import ForwardMode
from services.engine.loader import load_model
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.prefill_graph import token_sizes_up_to
from services.engine.step_inputs import StepInput
from tests.conftest import TINY_MODEL_DIR

NUM_PAGES = 32


def test_token_sizes_and_the_flag() -> None:
    from services.prefill.__main__ import parse_args
    from services.prefill.app import rank_init

    assert token_sizes_up_to(0) == ()
    assert token_sizes_up_to(100) == (16, 32, 64, 100)
    assert token_sizes_up_to(640)[-1] == 640 and len(set(token_sizes_up_to(640))) == 12
    assert token_sizes_up_to(2048)[-2:] == (640, 2048)
    assert rank_init(parse_args([])).cuda_graph_max_tokens == 640
    assert rank_init(parse_args(["--cuda-graph-max-tokens", "0"])).cuda_graph_max_tokens == 0
    with pytest.raises(SystemExit):
        parse_args(["--cuda-graph-max-tokens", "-1"])


def _runner(model, backend: str, graph_tokens: tuple[int, ...]) -> ModelRunner:
    runner = ModelRunner(model, KVCacheConfig(NUM_PAGES, 16), backend, (), graph_tokens)
    runner.kv_pool.k_buffer.normal_(generator=torch.Generator(runner.device).manual_seed(0))
    runner.kv_pool.v_buffer.normal_(generator=torch.Generator(runner.device).manual_seed(1))
    return runner


def _passes(runner: ModelRunner, vocab: int) -> list[list[StepInput]]:
    """Two passes: two fresh prompts; then the second one's next chunk over its 21-token prefix
    (with a third prompt): 26, then 21 tokens."""
    gen = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 33, 9)]
    for i, prompt in enumerate(ids):
        runner.page_table.reserve(f"r{i}", len(prompt))

    def step(i: int, start: int, end: int) -> StepInput:
        return StepInput(f"r{i}", ids[i][start:end], torch.arange(start, end).expand(3, -1), start)

    return [[step(0, 0, 5), step(1, 0, 21)], [step(1, 21, 33), step(2, 0, 9)]]


def _compare(model, backend: str, graph_tokens: tuple[int, ...], rtol: float, atol: float) -> None:
    """``|pieces - eager| <= rtol * max|eager| + atol`` for the logits and the K/V; the greedy
    token agrees wherever eager's top two are further apart than twice the difference."""
    vocab = model.config.text.vocab_size
    eager, pieces = _runner(model, backend, ()), _runner(model, backend, graph_tokens)
    assert eager.prefill_graphs is None and pieces.prefill_graphs is not None
    for e_step, p_step in zip(_passes(eager, vocab), _passes(pieces, vocab), strict=True):
        expected = eager.forward(ForwardMode.EXTEND, e_step)
        got = pieces.forward(ForwardMode.EXTEND, p_step)
        diff, scale = (got - expected).abs().max().item(), expected.abs().max().item()
        num_tokens = sum(len(s.input_ids) for s in p_step)
        print(f"{num_tokens} tokens: max |pieces - eager| {diff:.2e} (logit scale {scale:.2f})")
        assert diff <= rtol * scale + atol
        top2 = expected.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 2 * diff
        assert bool((got.argmax(-1) == expected.argmax(-1))[decided].all())
    assert pieces.prefill_graphs.num_replays == (2 if pieces.device.type == "cuda" else 0)
    scratch_page = pieces.prefill_graphs._scratch_slot // pieces.page_size
    untouched = _runner(model, backend, ())  # the pools' start values
    lens = (5, 33, 9)

    def written(runner: ModelRunner) -> torch.Tensor:  # flat slots of every prompt position
        return torch.cat([runner.page_table.slots(f"r{i}", 0, n) for i, n in enumerate(lens)])

    def flat(buffer: torch.Tensor) -> torch.Tensor:  # [L, P, S, H, D] -> [L, P * S, H, D]
        return buffer.flatten(1, 2)

    ours, theirs = written(pieces), written(eager)
    rest = torch.ones(NUM_PAGES * pieces.page_size, dtype=torch.bool)
    rest[ours] = False
    rest[scratch_page * pieces.page_size : (scratch_page + 1) * pieces.page_size] = False
    assert not bool(torch.isin(ours // pieces.page_size, torch.tensor([scratch_page])).any())
    for name in ("k_buffer", "v_buffer"):
        got = flat(getattr(pieces.kv_pool, name)).cpu()
        expected = flat(getattr(eager.kv_pool, name)).cpu()
        start = flat(getattr(untouched.kv_pool, name)).cpu()
        # the same K/V at every prompt position; padding wrote nothing but the scratch page
        diff = (got[:, ours] - expected[:, theirs]).abs().max().item()
        print(f"{name}: max |pieces - eager| {diff:.2e} (scale {expected.abs().max().item():.2f})")
        assert diff <= rtol * expected[:, theirs].abs().max().item() + atol
        assert torch.equal(got[:, rest], start[:, rest])


def test_the_pieces_equal_the_eager_pass_on_the_cpu() -> None:
    model = load_model(TINY_MODEL_DIR, "cpu", "float32", components=("language",))
    _compare(model, "torch", (8, 32), rtol=0.0, atol=1e-5)  # 26 and 21 tokens: both padded to 32


def test_a_pass_above_the_largest_size_runs_eagerly() -> None:
    model = load_model(TINY_MODEL_DIR, "cpu", "float32", components=("language",))
    runner = _runner(model, "torch", (8,))
    assert runner.prefill_graphs is not None and not runner.prefill_graphs.can_run(26)
    calls = []
    runner.prefill_graphs.forward = lambda *a, **k: calls.append(a)
    logits = runner.forward(ForwardMode.EXTEND, _passes(runner, model.config.text.vocab_size)[0])
    assert logits.shape == (2, model.config.text.vocab_size) and calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["small", "7b"])
def test_the_graphs_equal_the_eager_pass_on_a_gpu(config, small_config_dir) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("flashinfer")
    from benchmarks.random_model import CONFIG_7B, build_random_model

    model = build_random_model(small_config_dir if config == "small" else CONFIG_7B, seed=5)
    # bf16: a GEMM over the padded 32 rows may round differently from one over the 21 real ones
    _compare(model, "flashinfer", (16, 32), rtol=0.05, atol=0.05)
