"""Prefill on two CP rank processes against the real vision encoder on two rank processes, rows over
shared memory to both prefill ranks: outputs equal the offline engine with cache hits, and an
encoder rank killed mid-batch fails the request UNAVAILABLE without leaking one of prefill's
embedding
rows."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from prometheus_client import REGISTRY

from services.common.errors import UnavailableError
from services.common.types import SamplingParams
from services.engine.processing.image_file import content_hash
from services.vision_encoder.plan import owner_rank
from tests.conftest import image_bytes
from tests.prefill.conftest import make_case, prefill_config, reference, start_harness, stop_harness
from tests.prefill.test_service import assert_matches
from tests.vision_encoder.conftest import serve_encoder, wait_until
from tests.vision_encoder.rank_hooks import Announce, Delay, ranks_done

pytestmark = [pytest.mark.integration, pytest.mark.slow]
GREEDY = SamplingParams(temperature=0.0)


def rows_used() -> float:
    return REGISTRY.get_sample_value("stageserve_prefill_embedding_rows_used") or 0.0


async def test_real_encoder_rows_cache_hits_and_a_killed_rank(
    pipeline, language_model, tmp_path
) -> None:
    with serve_encoder(2) as encoder:
        harness = await start_harness(
            pipeline,
            language_model,
            prefill_config(devices=("cpu", "cpu")),
            encoder_address=encoder.address,
        )
        try:
            first, second = image_bytes(120, 80, seed=1), image_bytes(64, 200, seed=2)
            cases = [
                make_case(pipeline, "a", "What is in this picture?", [first], GREEDY),
                make_case(pipeline, "b", "And now?", [second, first], GREEDY),  # `first` is cached
            ]
            for case, num_cached in zip(cases, (0, cases[0].prompt.spans[0].length), strict=True):
                ref = reference(pipeline, case)
                result, dst = await harness.prefill(case)
                assert_matches(harness, case, result, dst, ref)
                assert result.num_cached_image_tokens == num_cached
            harness.assert_all_free()

            start_rows = rows_used()
            images = [image_bytes(90, 90, seed=s) for s in (3, 4, 7, 8)]
            assert {owner_rank(content_hash(data), 2) for data in images} == {0, 1}
            killed = make_case(pipeline, "killed", "Describe them.", images, GREEDY)
            pids = encoder.app.leader.rank_pids
            await encoder.hook(Delay(rank=1, seconds=30.0))
            await encoder.hook(Announce(str(tmp_path)))
            call = asyncio.ensure_future(harness.prefill(killed))
            await wait_until(
                lambda: encoder.app.leader.num_pending == 1 and rows_used() > start_rows
            )
            # rank 0 wrote its rows into prefill's buffer; rank 1 sleeps
            await wait_until(lambda: ranks_done(tmp_path) == {0})
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(UnavailableError, match="rank 1"):
                await call
            await wait_until(lambda: rows_used() == start_rows, 10.0)  # freed at once, none leaked
            harness.assert_all_free()

            await wait_until(lambda: encoder.app.groups[1].is_ready, 300.0)  # rank 1 re-formed
            again = make_case(pipeline, "again", "Describe them.", images, GREEDY)
            result, dst = await harness.prefill(again)
            assert_matches(harness, again, result, dst, reference(pipeline, again))
            kept = [s for s in again.prompt.spans if owner_rank(s.content_hash, 2) == 0]
            # rank 0 kept what it cached for the killed call; rank 1 came back empty
            assert result.num_cached_image_tokens == sum(s.length for s in kept)
            harness.assert_all_free()
            assert rows_used() == start_rows
        finally:
            await stop_harness(harness)
