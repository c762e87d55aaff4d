"""The decode graph sizes a runner captures for its largest batch (``graph_batch_sizes``)."""

from __future__ import annotations

from services.engine.cuda_graph import (
    DEFAULT_BATCH_SIZES,
    LARGE_BATCH_STEP,
    MAX_GRAPH_BATCH,
    graph_batch_sizes,
)


def test_every_batch_up_to_the_largest_has_a_graph_and_none_is_wasted() -> None:
    assert graph_batch_sizes(256) == DEFAULT_BATCH_SIZES  # decode's default batch
    assert graph_batch_sizes(5) == (1, 2, 4, 8)
    assert graph_batch_sizes(512)[-4:] == (320, 384, 448, 512)
    assert graph_batch_sizes(300)[-2:] == (256, 320)
    for max_batch in (1, 3, 100, 257, 511, 512, 700, MAX_GRAPH_BATCH):
        sizes = graph_batch_sizes(max_batch)
        assert sizes == tuple(sorted(set(sizes)))
        assert sizes[-1] >= max_batch  # the largest batch replays a graph
        assert len([s for s in sizes if s >= max_batch]) == 1  # and no larger one is captured
        above = [s for s in sizes if s > DEFAULT_BATCH_SIZES[-1]]
        assert all(s % LARGE_BATCH_STEP == 0 for s in above)
    assert graph_batch_sizes(4 * MAX_GRAPH_BATCH)[-1] == MAX_GRAPH_BATCH  # past it: eager
