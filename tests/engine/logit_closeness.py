"""How close one run's logits are to a reference run's, for the quantization tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Closeness:
    cosine_min: float  # per position, the lowest cosine similarity of the two logit rows
    cosine_mean: float
    max_diff: float  # max |ours - ref| over every logit
    scale: float  # max |ref|: the logit range the differences are read against
    agreement: float  # the share of positions whose argmax is the same
    flipped_leads: torch.Tensor  # the reference's top-1 lead at each position whose argmax moved

    @property
    def max_flipped_lead(self) -> float:
        return self.flipped_leads.max().item() if len(self.flipped_leads) else 0.0

    def summary(self, what: str) -> str:
        return (
            f"cosine min {self.cosine_min:.5f} mean {self.cosine_mean:.5f}; max |{what}| "
            f"{self.max_diff:.4f} of logits up to {self.scale:.2f}; argmax agreement "
            f"{self.agreement:.3f}; the reference's lead where flipped <= "
            f"{self.max_flipped_lead:.4f}"
        )


def closeness(ours: torch.Tensor, ref: torch.Tensor) -> Closeness:
    """``ours`` against ``ref``, both [positions, vocab]."""
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    agree = ours.argmax(-1) == ref.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    return Closeness(
        cosine.min().item(),
        cosine.mean().item(),
        (ours - ref).abs().max().item(),
        ref.abs().max().item(),
        agree.float().mean().item(),
        (top2[:, 0] - top2[:, 1])[~agree],
    )
