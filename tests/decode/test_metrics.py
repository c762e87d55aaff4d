"""services/decode/metrics.py: the saturation an autoscaler scales decode on."""

from __future__ import annotations

import pytest

from services.decode.messages import RankLoad
from services.decode.metrics import saturation


def load(
    num_free_pages: int,
    num_running: int = 0,
    num_reserved: int = 0,
    num_quarantined_pages: int = 0,
    num_total_pages: int = 100,
    max_running_requests: int = 8,
) -> RankLoad:
    return RankLoad(
        page_size=16,
        max_model_len=1024,
        num_total_pages=num_total_pages,
        num_free_pages=num_free_pages,
        num_used_pages=num_total_pages - num_free_pages - num_quarantined_pages,
        num_quarantined_pages=num_quarantined_pages,
        num_running_requests=num_running,
        num_reserved_requests=num_reserved,
        max_running_requests=max_running_requests,
    )


def test_the_fuller_of_pages_and_slots_counts() -> None:
    assert saturation([load(num_free_pages=100)]) == 0.0
    assert saturation([load(num_free_pages=25, num_running=1)]) == pytest.approx(0.75)  # pages
    assert saturation([load(num_free_pages=90, num_running=4, num_reserved=2)]) == pytest.approx(
        0.75
    )  # slots: reserved requests will need one too


def test_quarantined_pages_are_not_free() -> None:
    assert saturation([load(num_free_pages=50, num_quarantined_pages=50)]) == pytest.approx(0.5)


def test_ranks_add_up_and_a_queue_beyond_the_slots_reads_full() -> None:
    ranks = [load(num_free_pages=100), load(num_free_pages=0, num_running=8)]
    assert saturation(ranks) == pytest.approx(0.5)
    assert saturation([load(num_free_pages=80, num_running=20)]) == 1.0


def test_no_serving_rank_reads_empty() -> None:
    assert saturation([]) == 0.0
