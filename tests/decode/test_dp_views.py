"""The leader's views of a DP-attention group's DP ranks (``dp_views.py``), over a fake group:
posts tagged with their DP rank, each report split to its rank, readiness and losses sent to
every view, the group built, started and closed once."""

from __future__ import annotations

import asyncio

import msgspec

from services.common.errors import UnavailableError
from services.common.ranks.free_supervisor import Reported
from services.decode.dp_views import SharedGroup
from services.decode.messages import AbortCommand, DpReports, RankCommands, RankLoad, RankReport


class FakeGroup:
    def __init__(self, on_ready, on_report) -> None:
        self.on_ready, self.on_report = on_ready, on_report
        self.is_ready = False
        self.posts: list[msgspec.Struct] = []
        self.num_starts = self.num_closes = 0

    async def start(self) -> None:
        self.num_starts += 1
        await asyncio.sleep(0.01)
        self.is_ready = True

    def post(self, payload: msgspec.Struct) -> int:
        self.posts.append(payload)
        return len(self.posts)

    async def aclose(self) -> None:
        self.num_closes += 1
        await asyncio.sleep(0.01)


def report(num_running: int) -> RankReport:
    load = RankLoad(16, 4096, 64, 64, 0, 0, num_running, 0, 8)
    return RankReport((), (), (), (), (), load, 0, 0.0)


async def test_views_share_one_group() -> None:
    made: list[FakeGroup] = []

    def make(on_ready, on_report) -> FakeGroup:
        made.append(FakeGroup(on_ready, on_report))
        return made[-1]

    shared = SharedGroup(2, make)
    ready: list[tuple[int, bool]] = []
    reported: list[tuple[int, Reported]] = []
    views = [
        shared.view(
            r,
            lambda is_ready, r=r: ready.append((r, is_ready)),
            lambda rep, r=r: reported.append((r, rep)),
        )
        for r in range(2)
    ]
    await asyncio.gather(*(v.start() for v in views))
    [group] = made
    assert group.num_starts == 1 and all(v.is_ready for v in views)

    command = AbortCommand("req", is_kv_written=False)
    assert views[1].post(RankCommands((command,))) == 1
    assert views[0].post(RankCommands()) == 2
    assert [p.dp_rank for p in group.posts] == [1, 0]
    assert group.posts[0].commands == (command,)

    group.on_report(Reported(2, result=DpReports((report(3), report(5)))))
    assert [(r, rep.through_seq, rep.result.load.num_running_requests) for r, rep in reported] == [
        (0, 2, 3),
        (1, 2, 5),
    ]
    reported.clear()
    lost = Reported(2, error=UnavailableError("gone"), is_down=True)
    group.on_report(lost)
    assert reported == [(0, lost), (1, lost)]
    group.on_ready(False)
    assert ready == [(0, False), (1, False)]

    await asyncio.gather(*(v.aclose() for v in views))
    assert group.num_closes == 1
