"""A rank's check that its leader is gone (both rank loops): the parent changed, or the
leader was silent past ``leader_timeout_s`` (an injected clock)."""

from __future__ import annotations

import logging
import os

from services.common.ranks.rank_loop import LeaderWatch


def test_the_leader_is_gone_once_its_silence_passes_the_timeout(caplog) -> None:
    watch = LeaderWatch(0, 10.0, now_mono=100.0)
    assert not watch.is_gone(110.0)
    watch.heard(105.0)
    assert not watch.is_gone(115.0)
    with caplog.at_level(logging.ERROR, logger="services.common.ranks.rank_loop"):
        assert watch.is_gone(115.5)
    assert "no word from the leader for 10.5 s" in caplog.text


def test_the_leader_is_gone_once_this_process_has_another_parent(caplog) -> None:
    assert not LeaderWatch(os.getppid(), 10.0, now_mono=0.0).is_gone(0.0)
    other = os.getppid() + 1
    with caplog.at_level(logging.ERROR, logger="services.common.ranks.rank_loop"):
        assert LeaderWatch(other, 10.0, now_mono=0.0).is_gone(0.0)
    assert f"the leader (pid {other}) is gone" in caplog.text
