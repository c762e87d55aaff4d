"""GPU parity (bf16) of tensor and expert parallelism: TP = 2 on the tiny Qwen2.5-VL
checkpoint and TP = EP = 2 on the tiny Qwen3-VL-MoE one (its experts have no TP split), and
DP attention with EP = 2 on the MoE one (attention whole, experts split), against size 1,
every rank a process on ``cuda:0`` with gloo for the collectives (NCCL needs a GPU per rank;
device tool only).

bf16 rounds differently with the weights split (partial sums are reduced in another order),
so each layout is compared with the fp32 CPU reference: its error must be of the size of the
TP = 1 bf16 engine's own (at most twice it, plus a small floor) and its argmax must agree with
fp32 as often, less a small margin for the near-ties of random tiny weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import TINY_MODEL_DIR
from tests.engine.test_tensor_parallel import reference_run
from tests.engine.tp_ranks import run_tp_groups

pytestmark = pytest.mark.gpu

LAYOUTS = {  # name: (checkpoint, experts split over the group, DP attention)
    "TP": (TINY_MODEL_DIR, False, False),
    "EP": (TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe", True, False),
    "DP-attention EP": (TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe", True, True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per layout: the fp32 CPU reference, and every rank's bf16 CUDA results at size 1 and
    2."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = {}
    for name, (model_dir, experts, dp_attention) in LAYOUTS.items():
        reference, requests = reference_run(model_dir)
        results = run_tp_groups(
            2,
            (1, 2),
            [(model_dir, requests)],
            tmp_path_factory.mktemp(name.replace(" ", "-")),
            expert_parallel=experts,
            dp_attention=dp_attention,
            device="cuda",
            dtype="bfloat16",
        )
        out[name] = reference, results
    return out


def errors(logits: list[np.ndarray], reference) -> tuple[float, float]:
    """Max abs error against the fp32 logits and the share of positions whose argmax agrees."""
    err, agree = 0.0, []
    for ours, want in zip(logits, reference.prompt_logits, strict=True):
        ours = torch.from_numpy(ours)
        err = max(err, (ours - want).abs().max().item())
        agree.append((ours.argmax(-1) == want.argmax(-1)).float())
    return err, torch.cat(agree).mean().item()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_split_matches_one_rank(runs, layout: str) -> None:
    reference, results = runs[layout]
    one = results[(0, 1, 0)]
    one_err, one_agree = errors(one.prompt_logits, reference)
    for rank in range(2):
        result = results[(0, 2, rank)]
        err, agree = errors(result.prompt_logits, reference)
        same = sum(
            a == b
            for got, want in zip(result.token_ids, one.token_ids, strict=True)
            for a, b in zip(got, want, strict=True)
        )
        print(
            f"{layout}=2 rank {rank}: max err vs fp32 {err:.4f} (size 1 bf16 {one_err:.4f}); "
            f"argmax agreement {agree:.3f} (size 1 {one_agree:.3f}); greedy tokens equal to "
            f"size 1 bf16: {same} of {sum(map(len, one.token_ids))}"
        )
        assert err <= 2 * one_err + 0.02
        assert agree >= one_agree - 0.05
