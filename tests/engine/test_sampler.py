import msgspec
import pytest
import torch

from services.common.errors import InvalidRequestError
from services.common.types import FinishReason, SamplingParams, finish_reason
from services.engine.sampler import Sampler, make_generator

VOCAB_SIZE = 50


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]
) -> torch.Tensor:
    batch_size = logits.shape[0]
    generators = [make_generator(seed, "cpu") for seed in seeds]
    return Sampler().sample(logits, params, [[]] * batch_size, [[]] * batch_size, generators)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, VOCAB_SIZE, generator=torch.Generator().manual_seed(1))
    tokens = sample_rows(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
    assert tokens.dtype == torch.long
    assert torch.equal(tokens, logits.argmax(dim=1))


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6)])
def test_narrow_filters_equal_greedy(params: SamplingParams) -> None:
    logits = torch.randn(8, VOCAB_SIZE, generator=torch.Generator().manual_seed(2))
    tokens = sample_rows(logits, [params] * 8, list(range(8)))
    assert torch.equal(tokens, logits.argmax(dim=1))


def test_top_k_and_top_p_keep_expected_tokens() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2, 1)
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.75)]
    processed = Sampler().process_logits(logits, params, [[], []], [[], []])
    assert torch.isfinite(processed).tolist() == [
        [True, True, True, False],
        [True, True, False, False],
    ]


def test_min_p_filters() -> None:
    probs = torch.tensor([0.4, 0.3, 0.19, 0.11])
    logits = probs.log().unsqueeze(0)
    params = [SamplingParams(min_p=0.5)]  # threshold 0.2
    processed = Sampler().process_logits(logits, params, [[]], [[]])
    assert torch.isfinite(processed[0]).tolist() == [True, True, False, False]
    tokens = sample_rows(logits.repeat(200, 1), params * 200, list(range(200)))
    assert set(tokens.tolist()) == {0, 1}


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    processed = Sampler().process_logits(logits, [SamplingParams(temperature=2.0)], [[]], [[]])
    torch.testing.assert_close(processed, logits / 2.0)


def test_repetition_penalty_hf_style() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0)]
    processed = Sampler().apply_penalties(logits, params, [[0, 0]], [[1]])
    torch.testing.assert_close(processed, torch.tensor([[1.0, -4.0, 1.0, 0.5]]))


def test_frequency_and_presence_penalties_over_output_only() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    processed = Sampler().apply_penalties(logits, params, [[0, 1]], [[2, 2, 3]])
    expected = torch.tensor([[2.0, -2.0, 1.0 - 2 * 0.5 - 0.25, 0.5 - 0.5 - 0.25]])
    torch.testing.assert_close(processed, expected)


def test_penalties_are_per_row_and_do_not_mutate_input() -> None:
    logits = torch.ones(2, 4)
    params = [SamplingParams(repetition_penalty=4.0), SamplingParams()]
    processed = Sampler().apply_penalties(logits, params, [[3], [3]], [[], []])
    assert processed.tolist() == [[1.0, 1.0, 1.0, 0.25], [1.0, 1.0, 1.0, 1.0]]
    assert torch.equal(logits, torch.ones(2, 4))


def test_greedy_uses_penalized_logits() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    tokens = Sampler().sample(logits, params, [[0]], [[]], [None])
    assert tokens.tolist() == [1]


def draw_sequence(seed: int, position: int, batch_size: int, num_steps: int = 16) -> list[int]:
    data = torch.Generator().manual_seed(123)
    generators = [
        make_generator(seed if i == position else 1000 + i, "cpu") for i in range(batch_size)
    ]
    params = [SamplingParams(temperature=0.0 if i % 3 == 2 else 1.0) for i in range(batch_size)]
    params[position] = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=seed)
    row_logits = torch.randn(num_steps, VOCAB_SIZE, generator=data)
    tokens = []
    for step in range(num_steps):
        logits = torch.randn(batch_size, VOCAB_SIZE, generator=data)
        logits[position] = row_logits[step]
        out = Sampler().sample(logits, params, [[]] * batch_size, [[]] * batch_size, generators)
        tokens.append(int(out[position]))
    return tokens


def test_same_seed_same_tokens_in_any_batch() -> None:
    alone = draw_sequence(seed=7, position=0, batch_size=1)
    assert draw_sequence(seed=7, position=0, batch_size=1) == alone
    assert draw_sequence(seed=7, position=3, batch_size=5) == alone
    assert draw_sequence(seed=7, position=1, batch_size=8) == alone


def test_different_seeds_differ() -> None:
    assert draw_sequence(seed=7, position=0, batch_size=1) != draw_sequence(
        seed=8, position=0, batch_size=1
    )


def test_unseeded_generators_differ() -> None:
    logits = torch.zeros(1, 10_000)
    draws = {int(sample_rows(logits, [SamplingParams()], [None])[0]) for _ in range(5)}
    assert len(draws) > 1


def test_sampling_follows_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num_rows = 4000
    generator = make_generator(5, "cpu")
    logits = probs.log().repeat(num_rows, 1)
    empty: list[list[int]] = [[]] * num_rows
    tokens = Sampler().sample(
        logits, [SamplingParams()] * num_rows, empty, empty, [generator] * num_rows
    )
    freqs = torch.bincount(tokens, minlength=4).float() / num_rows
    sigma = (probs * (1 - probs) / num_rows).sqrt()
    assert ((freqs - probs).abs() < 5 * sigma).all(), freqs


def test_skip_advances_past_one_random_row() -> None:
    logits = torch.randn(8, VOCAB_SIZE, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(temperature=1.5, seed=5)]
    sampler = Sampler()
    continuous = make_generator(5, "cpu")
    expected = [
        sampler.sample(row[None], params, [[]], [[]], [continuous]).item() for row in logits
    ]
    resumed = make_generator(5, "cpu")
    sampler.skip(resumed, VOCAB_SIZE)
    assert [
        sampler.sample(row[None], params, [[]], [[]], [resumed]).item() for row in logits[1:]
    ] == expected[1:]


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    forced = SamplingParams(temperature=0.0, logit_bias=((2, 100.0),))
    banned = SamplingParams(temperature=0.0, logit_bias=((1, -100.0),))
    sampler = Sampler()
    assert sampler.sample(logits, [forced], [[]], [[]], [None]).tolist() == [2]
    assert sampler.sample(logits, [banned], [[]], [[]], [None]).tolist() == [3]
    assert logits.tolist() == [[0.0, 5.0, 1.0, 2.0]]  # the input is not changed


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 3)  # 1 is EOS, 2 a stop token, 3 the best other
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    sampler = Sampler(eos_token_ids=(1,))
    outputs = [[], [7], [7, 7]]  # 0, 1, 2 tokens generated so far
    assert sampler.sample(logits, [params] * 3, [[]] * 3, outputs, [None] * 3).tolist() == [3, 3, 1]
    ignoring = msgspec.structs.replace(
        params, ignore_eos=True
    )  # EOS is no stop then: only 2 is masked
    assert sampler.sample(logits[:1], [ignoring], [[]], [[]], [None]).tolist() == [1]


def test_finish_reason_and_the_min_tokens_mask_agree() -> None:
    """The token drawn at output position k stops the request iff k > min_tokens."""
    sampler = Sampler(eos_token_ids=(1,))
    for params, logits in (  # 1 is EOS, 2 a stop token, 3 the best token that ends nothing
        (SamplingParams(temperature=0.0, min_tokens=2), [0.0, 9.0, 1.0, 5.0]),
        (SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,)), [0.0, 1.0, 9.0, 5.0]),
    ):
        for num_before in range(4):
            (token,) = sampler.sample(
                torch.tensor([logits]), [params], [[]], [[7] * num_before], [None]
            ).tolist()
            reason = finish_reason(params, token, 5, num_before + 1, (1,), 100)
            assert (reason is FinishReason.STOP) == (num_before >= 2) == (token != 3)


def test_logprobs_only_for_rows_that_ask() -> None:
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(7))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, return_logprobs=True, num_top_logprobs=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, return_logprobs=True),
    ]
    sampler = Sampler()
    tokens = sample_rows(logits, params, [None, None, None, 3])
    assert sampler.logprobs(logits, tokens, []) is None
    asks = [(i, p.num_top_logprobs) for i, p in enumerate(params) if p.return_logprobs]
    rows = sampler.logprobs(logits, tokens, asks)
    assert rows is not None and rows.rows == (1, 3)
    greedy, sampled = rows.to_list()
    reference = logits.log_softmax(dim=1)
    assert greedy.token_id == int(logits[1].argmax())
    assert greedy.logprob == pytest.approx(reference[1].max().item(), abs=1e-6)
    assert list(greedy.top_token_ids) == reference[1].argsort(descending=True)[:5].tolist()
    assert list(greedy.top_logprobs) == sorted(greedy.top_logprobs, reverse=True)
    assert (greedy.top_token_ids[0], greedy.top_logprobs[0]) == (greedy.token_id, greedy.logprob)
    # raw logprobs: the temperature does not change them
    assert sampled.token_id == int(tokens[3])
    assert sampled.logprob == pytest.approx(reference[3, sampled.token_id].item(), abs=1e-6)
    assert sampled.top_token_ids == () and sampled.top_logprobs == ()


def test_logprobs_are_raw_before_penalties() -> None:
    logits = torch.randn(1, VOCAB_SIZE, generator=torch.Generator().manual_seed(8))
    banned = int(logits[0].argmax())
    params = SamplingParams(
        temperature=0.0, logit_bias=((banned, -100.0),), return_logprobs=True, num_top_logprobs=1
    )
    tokens = Sampler().sample(logits, [params], [[]], [[]], [None])
    assert int(tokens[0]) != banned
    (entry,) = Sampler().logprobs(logits, tokens, [(0, 1)]).to_list()
    assert entry.top_token_ids == (banned,)
    assert entry.logprob == pytest.approx(logits.log_softmax(dim=1)[0, int(tokens[0])].item())


def test_logprob_params_are_validated() -> None:
    with pytest.raises(InvalidRequestError, match="num_top_logprobs must be in"):
        SamplingParams(return_logprobs=True, num_top_logprobs=21).validate()
    with pytest.raises(InvalidRequestError, match="needs return_logprobs"):
        SamplingParams(num_top_logprobs=2).validate()
    SamplingParams(return_logprobs=True, num_top_logprobs=20).validate()
