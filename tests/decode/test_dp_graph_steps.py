"""A DP-attention decode rank's steps pick their graph from the group's agreed rows (CPU).

One ``DecodeRank`` of a DP-attention group of one, whose agreement (``StepRows``) answers with
its own rows or more, as peers with more rows would, and whose runner has ``EagerGraphs``
(``tests/engine/test_dp_graph_sizes.py``: graphs of 1, 2, 4 and 8 rows, recorded and computed
eagerly; the CPU captures none). Each step replays the size the agreed rows pick, its requests
padded to it, or, without requests, all padding; past the largest size it runs eagerly (an
idle rank's MLPs join with no rows); the tokens streamed are the offline engine's all along.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.types import SamplingParams
from services.decode.app import rank_init
from services.decode.rank import build_rank
from services.engine.loader import load_model
from services.engine.parallel import TensorParallel
from services.transfer import create_kv_receiver
from services.transfer.inprocess_backend import InProcessFabric, InProcessKVSender
from tests.conftest import TINY_MODEL_DIR
from tests.decode.conftest import BASE_CONFIG, FakePrefill, prompt_of
from tests.decode.test_step_loop import Driver, Outcome, offline_run
from tests.engine.test_dp_graph_sizes import EagerGraphs

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


class PeerRows:
    """The group's agreement as seen by one rank: the most of its rows and its peers'."""

    def __init__(self) -> None:
        self.peers = 0  # the most rows any other rank plans this step
        self.agreed: list[int] = []

    def rows(self, mine: int) -> int:
        self.agreed.append(max(mine, self.peers))
        return self.agreed[-1]


@pytest.fixture
def dp_rank(language_model):
    """A DP-attention rank with stand-in graphs, its agreement, its prefill and the idle steps
    its model ran eagerly (the agreed rows of each)."""
    model = load_model(
        TINY_MODEL_DIR, components=("language",), tp=TensorParallel(0, 1, dp_attention=True)
    )
    fabric = InProcessFabric()
    receiver = create_kv_receiver("inprocess", fabric=fabric)
    config = replace(BASE_CONFIG, dp_attention=True, max_running_requests=8)
    rank = build_rank(rank_init(config), "cpu", model, receiver)
    runner = rank.loop.batch.runner
    assert runner.cuda_graph is None  # the CPU captures nothing
    runner.cuda_graph = EagerGraphs(runner)
    rank.dp = agreement = PeerRows()
    eager_idles: list[int] = []
    language, idle = model.model, model.model.idle

    def recorded_idle(dtype, device) -> None:
        eager_idles.append(model.tp.step_rows[0])
        idle(dtype, device)

    language.idle = recorded_idle
    yield rank, agreement, FakePrefill(language_model, InProcessKVSender(fabric)), eager_idles
    receiver.close()


def test_steps_replay_the_size_the_agreed_rows_pick(dp_rank, offline) -> None:
    rank, agreement, prefill, eager_idles = dp_rank
    graphs = rank.loop.batch.runner.cuda_graph
    prompt = prompt_of(6, seed=31)
    expected, reason = offline_run(offline, prompt, PARAMS)
    driver = Driver(rank, prefill)

    agreement.peers = 3  # a peer with 3 rows while this rank has none: an all-padding replay
    driver.step()
    assert graphs.replays == [(0, 4)] and not eager_idles
    agreement.peers = 20  # past the largest graph: this rank's MLPs join eagerly, no rows
    driver.step()
    assert graphs.replays == [(0, 4)] and eager_idles == [20]
    agreement.peers = 0  # nobody has rows: no forward
    driver.step()
    assert graphs.replays == [(0, 4)] and eager_idles == [20]

    driver.start("alone", prompt, PARAMS)  # its first DECODE step launches at its start
    picked = []
    for peers in (0, 2, 5, 8, 9, 3):
        agreement.peers = peers
        graphs.replays.clear()
        driver.step()
        picked.append(graphs.replays[:])
    # 1 row of its own, replayed in the graph of the agreed rows, or eagerly past 8
    assert picked == [[(1, 1)], [(1, 2)], [(1, 8)], [(1, 8)], [], [(1, 4)]]
    assert eager_idles == [20]
    driver.drain()
    assert driver.outcomes["alone"] == Outcome(expected, reason)
