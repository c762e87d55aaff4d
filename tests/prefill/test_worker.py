"""The rank worker in this process (one rank): layer-streamed KV writes, writes started before
any is awaited, and a failed forward that cancels its writes, each against the offline engine.

The stand-in layer-streaming backend copies layer i of a request's pages into decode's pool
the moment the worker reports layer i done, so decode's KV is right only if each report
comes after that layer's KV was stored (and before the forward ends).
"""

from __future__ import annotations

import time

import pytest
import torch

from services.common.errors import UnavailableError
from services.common.gpu_share import GpuShare
from services.engine.kv_cache import KVPageManager, KVPool
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.prefill.messages import RankRequest
from services.prefill.worker import PrefillRankWorker
from services.transfer.base import CompletedSend, LayerwiseSend, PendingSend, TransferResult
from services.transfer.embeddings import EmbeddingBuffer
from services.transfer.inprocess_backend import (
    InProcessFabric,
    InProcessKVReceiver,
    InProcessKVSender,
)
from tests.prefill.conftest import KV_ATOL, PAGE_SIZE, reference, standard_cases
from tests.prefill.cp_ranks import plan_of


class CopyingLayerwise(LayerwiseSend):
    """Copies each reported layer's pages into decode's pool right away; records what it was
    told."""

    def __init__(
        self, events: list, request_id, src_pool, src_pages, dst, dst_pool, fail_at: int | None
    ) -> None:
        self.events, self.request_id, self.fail_at = (
            events,
            request_id,
            fail_at,
        )  # fail_at: raise at that layer
        self.src_pool, self.src_pages, self.dst_pool, self.dst_pages = (
            src_pool,
            list(src_pages),
            dst_pool,
            dst.page_ids,
        )

    def layer_done(self, layer: int) -> None:
        self.events.append(("layer", self.request_id, layer))
        if layer == self.fail_at:
            raise RuntimeError("device fault while queuing a copy")
        for src, dst in zip(self.src_pages, self.dst_pages, strict=True):
            self.dst_pool.k_buffer[layer, dst] = self.src_pool.k_buffer[layer, src]
            self.dst_pool.v_buffer[layer, dst] = self.src_pool.v_buffer[layer, src]

    def finish(self):
        self.events.append(("finish", self.request_id))
        pool = self.src_pool
        num_bytes = 2 * pool.num_layers * len(self.src_pages) * pool.page_nbytes
        return CompletedSend(TransferResult(self.request_id, num_bytes, pool.num_layers, 0.0))

    def cancel(self) -> None:
        self.events.append(("cancel", self.request_id))


class Setup:
    """One rank's worker over an in-process decode pool (pages shuffled)."""

    def __init__(self, language_model, prefill_graph_tokens: tuple[int, ...] = ()) -> None:
        text = language_model.config.text
        self.fabric = InProcessFabric()
        self.decode_pool = KVPool(
            text.num_hidden_layers,
            512,
            PAGE_SIZE,
            text.num_key_value_heads,
            text.head_dim,
            torch.float32,
            "cpu",
        )
        self.receiver = InProcessKVReceiver(self.fabric)
        self.receiver.register(self.decode_pool)
        self.pages = KVPageManager(512, PAGE_SIZE)
        runner = ModelRunner(
            language_model, KVCacheConfig(256, PAGE_SIZE), "torch", (), prefill_graph_tokens
        )
        self.sender = InProcessKVSender(self.fabric)
        self.buffer = EmbeddingBuffer(1024, text.hidden_size, torch.float32)
        self.worker = PrefillRankWorker(runner, self.sender, self.buffer)

    def request(self, pipeline, case, row_start: int) -> RankRequest:
        n = len(case.prompt.token_ids)
        pages = self.pages.allocate(-(-n // PAGE_SIZE))[::-1]
        if case.request.spans:
            rows = pipeline.engine.image_embeddings([case.request])[0]
            self.buffer.rows(row_start, rows.shape[0]).copy_(rows)
        return RankRequest(
            case.request.request_id,
            case.prompt.token_ids,
            case.prompt.spans,
            case.request.params,
            self.receiver.destination(case.request.request_id, pages),
            time.time() + 30,
            row_start if case.request.spans else -1,
        )

    def assert_kv(self, pipeline, case, request: RankRequest) -> None:
        ref, n = reference(pipeline, case), request.num_tokens
        positions = torch.arange(n)
        slots = (
            torch.tensor(request.kv_dst.page_ids)[positions // PAGE_SIZE] * PAGE_SIZE
            + positions % PAGE_SIZE
        )
        for layer in range(self.decode_pool.num_layers):
            k, v = self.decode_pool.k_slots(layer)[slots], self.decode_pool.v_slots(layer)[slots]
            assert torch.allclose(k, ref.k[layer], atol=KV_ATOL, rtol=0), request.request_id
            assert torch.allclose(v, ref.v[layer], atol=KV_ATOL, rtol=0), request.request_id

    def assert_all_free(self) -> None:
        runner = self.worker.runner
        held = int(runner.prefill_graphs is not None)  # the graphs' scratch page
        manager = runner.page_manager
        assert manager.num_free_pages == manager.num_pages - held and len(runner.page_table) == 0


def stream_layers(setup: Setup, faults: dict | None = None) -> list:
    sender, runner, events, faults = setup.sender, setup.worker.runner, [], faults or {}
    model = runner.model

    def logged_forward(*args, _forward=model.forward, **kwargs):
        events.append(("forward", None))
        try:
            return _forward(*args, **kwargs)
        finally:
            events.append(("forward done", None))

    def start_layerwise(request_id, src_pool, src_pages, dst, deadline_mono):
        events.append(("begin", request_id))
        return CopyingLayerwise(
            events, request_id, src_pool, src_pages, dst, setup.decode_pool, faults.get("fail_at")
        )

    def start(*args):
        raise AssertionError(
            "a layer-streaming backend's requests must not be started after the forward"
        )

    sender.streams_layers = True
    sender.start_layerwise, sender.start = start_layerwise, start
    model.forward = logged_forward
    return events


@pytest.fixture
def setup(language_model):
    s = Setup(language_model)
    yield s
    s.worker.runner.model.__dict__.pop("forward", None)  # the model is the session's


def test_each_layer_goes_out_during_the_forward_and_decode_gets_the_offline_kv(
    pipeline, setup
) -> None:
    events = stream_layers(setup)
    cases = standard_cases(pipeline)
    requests = [setup.request(pipeline, c, 100 * i) for i, c in enumerate(cases)]
    done = setup.worker.execute(plan_of(1, requests, solo_rank=0))
    batch = [r.request_id for r in requests]
    assert events[: len(batch) + 1] == [("begin", r) for r in batch] + [("forward", None)]
    layers = [e for e in events if e[0] == "layer"]
    assert layers == [("layer", r, i) for i in range(setup.decode_pool.num_layers) for r in batch]
    end = events.index(("forward done", None))
    assert all(events.index(e) < end for e in layers)
    assert events[end + 1 :] == [("finish", r) for r in batch]
    assert all(not o.error and o.first_token_id >= 0 for o in done.outcomes)
    for case, request in zip(cases, requests, strict=True):
        setup.assert_kv(pipeline, case, request)
    setup.assert_all_free()


def test_layers_stream_out_of_the_prefill_graph_pieces_with_the_offline_kv(
    pipeline, language_model
) -> None:
    """The same batch through the pieces (prefill_graph.py; eager on the CPU, padded to 1024):
    each layer is reported after its K/V store, and decode gets the offline engine's KV."""
    setup = Setup(language_model, prefill_graph_tokens=(64, 1024))
    events = stream_layers(setup)  # logs the model's forward, which the pieces never call
    try:
        cases = standard_cases(pipeline)
        requests = [setup.request(pipeline, c, 100 * i) for i, c in enumerate(cases)]
        num_tokens = sum(r.num_tokens for r in requests)
        assert setup.worker.runner.prefill_graphs.size_for(num_tokens) == 1024
        done = setup.worker.execute(plan_of(1, requests, solo_rank=0))
    finally:
        setup.worker.runner.model.__dict__.pop("forward", None)
    batch = [r.request_id for r in requests]
    assert ("forward", None) not in events
    layers = [e for e in events if e[0] == "layer"]
    assert layers == [("layer", r, i) for i in range(setup.decode_pool.num_layers) for r in batch]
    first = [reference(pipeline, c).first_token_id for c in cases]
    assert [o.first_token_id for o in done.outcomes] == first
    assert not any(o.error for o in done.outcomes)
    for case, request in zip(cases, requests, strict=True):
        setup.assert_kv(pipeline, case, request)
    setup.assert_all_free()


def test_a_forward_that_fails_mid_stream_cancels_every_write_and_frees_everything(
    pipeline, setup
) -> None:
    faults = {"fail_at": 1}
    events = stream_layers(setup, faults)
    case = standard_cases(pipeline)[0]
    request = setup.request(pipeline, case, 0)
    with pytest.raises(RuntimeError, match="device fault"):
        setup.worker.execute(plan_of(1, [request], solo_rank=0))
    rid = request.request_id
    assert [e for e in events if e[1] == rid] == [
        ("begin", rid),
        ("layer", rid, 0),
        ("layer", rid, 1),
        ("cancel", rid),
    ]
    setup.assert_all_free()
    faults.clear()  # the worker still serves: the next request streams and gets the offline KV
    case = standard_cases(pipeline)[1]
    request = setup.request(pipeline, case, 0)
    setup.worker.execute(plan_of(2, [request], solo_rank=0))
    setup.assert_kv(pipeline, case, request)
    setup.assert_all_free()


def test_a_batch_starts_every_kv_write_before_awaiting_one(pipeline, setup) -> None:
    """Each request's write is started, then each awaited; one failing write fails only its
    request."""
    sender, events = setup.sender, []

    class Deferred(PendingSend):  # what an asynchronous backend returns: the bytes move by wait()
        def __init__(self, request_id, args):
            self.request_id, self.args = request_id, args

        def wait(self):
            events.append(("wait", self.request_id))
            if self.request_id == "text":
                raise UnavailableError("the link went down")
            return sender.send(self.request_id, *self.args)

    def start(request_id, *args):
        events.append(("start", request_id))
        return Deferred(request_id, args)

    sender.start = start
    cases = standard_cases(pipeline)
    requests = [setup.request(pipeline, c, 100 * i) for i, c in enumerate(cases)]
    done = setup.worker.execute(plan_of(1, requests, solo_rank=0))
    batch = [r.request_id for r in requests]
    assert events == [("start", r) for r in batch] + [("wait", r) for r in batch]
    for case, request, outcome in zip(cases, requests, done.outcomes, strict=True):
        if request.request_id == "text":
            assert (
                outcome.error_type == "UnavailableError" and "the link went down" in outcome.error
            )
        else:
            assert not outcome.error
            setup.assert_kv(pipeline, case, request)
    setup.assert_all_free()


def test_a_forward_is_marked_in_the_gpu_share_file_while_it_runs(pipeline, setup, tmp_path):
    """What a decode on the same GPU sees (``--gpu-share-file``): marked during the forward,
    clear after it, and clear after a forward that failed."""
    setup.worker.gpu_share = GpuShare(tmp_path / "share")
    decode_view = GpuShare(tmp_path / "share")
    model, seen = setup.worker.runner.model, []

    def forward(*args, _forward=model.forward, **kwargs):
        seen.append(decode_view.is_prefill_running())
        return _forward(*args, **kwargs)

    model.forward = forward
    case = standard_cases(pipeline)[0]
    request = setup.request(pipeline, case, 0)
    done = setup.worker.execute(plan_of(1, [request], solo_rank=0))
    assert seen == [True] and not decode_view.is_prefill_running()
    assert done.outcomes[0].first_token_id == reference(pipeline, case).first_token_id

    def failing(*args, **kwargs):
        raise RuntimeError("device fault in the forward")

    model.forward = failing
    with pytest.raises(RuntimeError, match="device fault"):
        setup.worker.execute(plan_of(2, [setup.request(pipeline, case, 0)], solo_rank=0))
    assert not decode_view.is_prefill_running()
    setup.assert_all_free()
    decode_view.close()
    setup.worker.gpu_share.close()
