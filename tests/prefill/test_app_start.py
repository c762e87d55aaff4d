"""``PrefillApp.start(peers_ready)``: the rank group forms while the vision encoder comes up; the
leader serves only once both are done, and the first failure of either ends the start with the
ranks stopped."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from services.common.errors import UnavailableError
from services.common.ranks.errors import RankStartError
from services.prefill.app import PrefillApp
from tests.conftest import rank_children
from tests.prefill.conftest import prefill_config
from tests.prefill.cp_ranks import TARGET, RecordingResult, group_config

pytestmark = pytest.mark.slow


def build(step_target: str = TARGET) -> PrefillApp:
    config = prefill_config()
    group = dataclasses.replace(group_config(1), name="prefill", devices=config.devices)
    return PrefillApp.build(
        config,
        internal_token=os.environ["STAGESERVE_INTERNAL_TOKEN"],
        group=group,
        step_target=step_target,
        result_type=RecordingResult,
    )


async def test_the_leader_serves_once_the_ranks_and_the_peer_are_ready() -> None:
    app, served, peer_ready = build(), [], asyncio.Event()
    app.leader.on_serving = served.append

    async def peer() -> None:
        while not app.ranks.is_ready:  # the group forms while the peer is still coming up
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert served == []  # formed, not serving: the peer is not ready
        peer_ready.set()

    try:
        await app.start(peer())
        assert peer_ready.is_set() and served == [True]
    finally:
        await app.close()
    assert rank_children() == []


async def test_a_peer_that_never_gets_ready_stops_the_forming_ranks() -> None:
    app = build()

    async def peer() -> None:
        await asyncio.sleep(0.5)  # the ranks are still importing torch
        raise UnavailableError("the vision encoder did not become SERVING")

    with pytest.raises(UnavailableError, match="did not become SERVING"):
        await app.start(peer())
    assert not app.ranks.is_ready
    assert rank_children() == []


async def test_ranks_that_cannot_start_fail_the_start_without_waiting_for_the_peer() -> None:
    app, cancelled = build(step_target="tests.prefill.no_such_module:Step"), []

    async def peer() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with pytest.raises(RankStartError, match="no_such_module"):
        await asyncio.wait_for(app.start(peer()), timeout=120)
    assert cancelled == [True]
    assert rank_children() == []
