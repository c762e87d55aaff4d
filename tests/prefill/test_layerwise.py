"""Prefill with a backend that streams KV layer by layer (``streams_layers``, as cuda_ipc does).

The stand-in backend copies layer i of the request's pages into decode's pool at the moment
the worker reports layer i done, so the KV decode ends up with is right only if each report
comes after that layer's KV was stored (and before the forward ends).
"""

from __future__ import annotations

import pytest

from services.common.errors import StageServeError
from services.transfer.base import CompletedSend, LayerwiseSend, TransferResult
from tests.prefill.conftest import (
    Harness,
    prefill_abandoned_while_held,
    prefill_as_one_batch,
    reference,
    standard_cases,
)
from tests.prefill.test_service import assert_matches


class CopyingLayerwise(LayerwiseSend):
    """Copies each reported layer's pages into decode's pool right away; records what it was told."""

    def __init__(self, events: list, request_id, src_pool, src_pages, dst, dst_pool, fail_at: int | None) -> None:
        self.events, self.request_id, self.fail_at = events, request_id, fail_at  # fail_at: raise at that layer
        self.src_pool, self.src_pages, self.dst_pool, self.dst_pages = src_pool, list(src_pages), dst_pool, dst.page_ids

    def layer_done(self, layer: int) -> None:
        self.events.append(("layer", self.request_id, layer))
        if layer == self.fail_at:
            raise RuntimeError("device fault while queuing a copy")
        for src, dst in zip(self.src_pages, self.dst_pages, strict=False):
            self.dst_pool.k_buffer[layer, dst] = self.src_pool.k_buffer[layer, src]
            self.dst_pool.v_buffer[layer, dst] = self.src_pool.v_buffer[layer, src]

    def finish(self):
        self.events.append(("finish", self.request_id))
        pool = self.src_pool
        num_bytes = 2 * pool.num_layers * len(self.src_pages) * pool.page_nbytes
        return CompletedSend(TransferResult(self.request_id, num_bytes, pool.num_layers, 0.0))

    def cancel(self) -> None:
        self.events.append(("cancel", self.request_id))


def stream_layers(harness: Harness, faults: dict | None = None) -> list:
    """Make the worker's sender a layer-streaming one; returns the event log. ``faults["fail_at"]``: see above."""
    sender, runner, events, faults = harness.app.leader.worker.kv_sender, harness.runner, [], faults or {}
    forward = runner.forward

    def logged_forward(*args, **kwargs):
        events.append(("forward", None))
        try:
            return forward(*args, **kwargs)
        finally:
            events.append(("forward done", None))

    def start_layerwise(request_id, src_pool, src_pages, dst, deadline):
        events.append(("begin", request_id))
        return CopyingLayerwise(events, request_id, src_pool, src_pages, dst, harness.decode.pool,
                                faults.get("fail_at"))

    def start(*args):
        raise AssertionError("a layer-streaming backend's requests must not be started after the forward")

    sender.streams_layers = True
    sender.start_layerwise, sender.start = start_layerwise, start
    runner.forward = logged_forward
    return events


async def test_each_layer_goes_out_during_the_forward_and_decode_gets_the_offline_kv(pipeline, harness):
    events = stream_layers(harness)
    cases = standard_cases(pipeline)
    results, batch = await prefill_as_one_batch(harness, pipeline, cases)
    num_layers = harness.runner.kv_pool.num_layers
    assert len(batch) == len(cases) >= 2
    log = events[events.index(("begin", batch[0])):]  # the batch's plan
    assert log[:len(batch) + 1] == [("begin", r) for r in batch] + [("forward", None)]
    layers = [e for e in log if e[0] == "layer"]
    assert layers == [("layer", r, i) for i in range(num_layers) for r in batch]
    done = log.index(("forward done", None))
    assert all(log.index(e) < done for e in layers)
    assert log[done + 1:] == [("finish", r) for r in batch]
    for case, result in zip(cases, results, strict=True):
        assert not isinstance(result, BaseException), result
        assert_matches(harness, case, *result, reference(pipeline, case))
    harness.assert_all_free()


async def test_a_request_aborted_before_its_forward_begins_no_write(pipeline, harness):
    events = stream_layers(harness)
    await prefill_abandoned_while_held(harness, standard_cases(pipeline)[0])
    assert [e for e in events if e[0] in ("begin", "layer", "finish")] == []
    harness.assert_all_free()


async def test_a_forward_that_fails_mid_stream_cancels_every_write_and_frees_everything(pipeline, harness):
    faults = {"fail_at": 1}
    events = stream_layers(harness, faults)
    case = standard_cases(pipeline)[0]
    with pytest.raises(StageServeError, match="device fault"):
        await harness.prefill(case)
    rid = case.request.request_id
    assert [e for e in events if e[1] == rid] == [("begin", rid), ("layer", rid, 0), ("layer", rid, 1), ("cancel", rid)]
    harness.assert_all_free()
    faults.clear()  # the worker still serves: the next request streams and gets the offline KV
    case = standard_cases(pipeline)[1]
    assert_matches(harness, case, *await harness.prefill(case), reference(pipeline, case))
    harness.assert_all_free()
