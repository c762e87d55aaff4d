"""Last in each layout (modules run in name order): no KV page was lost over the package's
tests."""

from __future__ import annotations

import pytest

from tests.e2e.openai_api.helpers import settled_stats

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_zz_no_kv_page_is_lost(system, initial_free_pages):
    # An aborted stream's pages come back asynchronously; those of a reservation that failed
    # before its KV was ready (a prefill error) only after decode's quarantine (35 s).
    stats = settled_stats(
        system,
        lambda s: not s.num_quarantined_pages and s.num_free_pages == initial_free_pages,
        90,
    )
    assert stats.num_quarantined_pages == 0
    assert stats.num_free_pages == initial_free_pages
