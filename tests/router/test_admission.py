"""Admission in-process: slots, the FIFO queue, 429 on a full queue or a long wait, the KV gate."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry

from services.common.errors import CapacityError, OverloadedError
from services.router.admission import RETRY_AFTER_S, AdmissionManager, Ticket, TicketState
from services.router.metrics import RouterMetrics
from tests.router.conftest import BOUND_S, wait_until


def manager(
    max_running: int, max_queued: int, queue_timeout_s: float = BOUND_S
) -> AdmissionManager:
    return AdmissionManager(
        max_running, max_queued, queue_timeout_s, RouterMetrics(CollectorRegistry())
    )


def metric(admission: AdmissionManager, name: str, **labels: str) -> float:
    value = admission._metrics.registry.get_sample_value(f"stageserve_router_{name}", labels)
    return 0.0 if value is None else value


class Requests:
    """Tickets taken in order, each first admitted by its own task; ``close`` ends a request."""

    def __init__(self, admission: AdmissionManager) -> None:
        self.admission = admission
        self.blocks: list[contextlib.AbstractContextManager[Ticket]] = []
        self.tickets: list[Ticket] = []
        self.tasks: list[asyncio.Task] = []
        self.is_closed: list[bool] = []

    async def arrive(self, num: int = 1) -> list[asyncio.Task]:
        new = []
        for _ in range(num):
            block = self.admission.ticket(f"r{len(self.tickets)}")
            ticket = block.__enter__()
            self.blocks.append(block)
            self.tickets.append(ticket)
            self.is_closed.append(False)
            new.append(asyncio.create_task(self.admission.wait_turn(ticket)))
            await asyncio.sleep(0)  # arrive in order
        self.tasks += new
        return new

    def running(self) -> list[int]:
        return [i for i, t in enumerate(self.tickets) if t.state is TicketState.RUNNING]

    def close(self, index: int) -> None:
        """The request's ``with ticket`` block ends."""
        assert not self.is_closed[index]
        self.is_closed[index] = True
        self.blocks[index].__exit__(None, None, None)

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for index, is_closed in enumerate(self.is_closed):
            if not is_closed:
                self.close(index)


@pytest.fixture
async def requests_of():
    made: list[Requests] = []

    def make(admission: AdmissionManager) -> Requests:
        made.append(Requests(admission))
        return made[-1]

    yield make
    for requests in made:
        await requests.aclose()


async def test_slots_then_queue_then_429_at_once(requests_of):
    admission = manager(max_running=2, max_queued=2)
    requests = requests_of(admission)
    await requests.arrive(4)
    await wait_until(lambda: requests.running() == [0, 1])
    assert admission.snapshot().num_queued == 2
    [extra] = await requests.arrive()
    with pytest.raises(OverloadedError, match="at capacity") as info:
        await extra
    assert info.value.retry_after_s == RETRY_AFTER_S and info.value.http_status == 429
    assert metric(admission, "admission_rejected_total", reason="queue_full") == 1
    assert (
        metric(admission, "admission_running") == 2 and metric(admission, "admission_queued") == 2
    )


async def test_can_admit_now_only_with_a_free_slot_and_no_one_waiting(requests_of):
    """What decides the image prefetch before tokenization: a request arriving now would run."""
    admission = manager(max_running=1, max_queued=2)
    requests = requests_of(admission)
    assert admission.can_admit_now()
    await requests.arrive(2)
    await wait_until(lambda: requests.running() == [0])
    assert not admission.can_admit_now()  # the slot is taken and one waits
    requests.close(0)
    await wait_until(lambda: requests.running() == [1])
    assert not admission.can_admit_now()  # the waiter took the slot
    requests.close(1)
    assert admission.can_admit_now()


async def test_a_freed_slot_goes_to_the_oldest_waiter(requests_of):
    admission = manager(max_running=1, max_queued=8)
    requests = requests_of(admission)
    await requests.arrive(4)
    order = []
    for _ in range(4):
        await wait_until(lambda: len(requests.running()) == 1)
        [index] = requests.running()
        order.append(index)
        requests.close(index)
    assert order == [0, 1, 2, 3]
    snapshot = admission.snapshot()
    assert snapshot.num_running == 0 and snapshot.num_queued == 0


async def test_no_queue_means_429_as_soon_as_the_slots_are_taken(requests_of):
    admission = manager(max_running=1, max_queued=0)
    requests = requests_of(admission)
    first, second = await requests.arrive(2)
    await first
    with pytest.raises(OverloadedError):
        await second


async def test_waiting_past_the_limit_is_a_429_and_leaves_the_queue(requests_of):
    admission = manager(max_running=1, max_queued=4, queue_timeout_s=0.2)
    requests = requests_of(admission)
    first, second = await requests.arrive(2)
    await first
    with pytest.raises(OverloadedError, match="waited .* for one of 1 request slots") as info:
        await second
    assert info.value.retry_after_s == RETRY_AFTER_S
    assert admission.snapshot().num_queued == 0
    assert metric(admission, "admission_rejected_total", reason="queue_timeout") == 1
    assert metric(admission, "admission_wait_seconds_count") == 1
    assert metric(admission, "admission_wait_seconds_sum") >= 0.19


async def test_a_cancelled_waiter_gives_its_place_to_the_next(requests_of):
    admission = manager(max_running=1, max_queued=4)
    requests = requests_of(admission)
    _, second, _ = await requests.arrive(3)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    requests.close(1)
    assert admission.snapshot().num_queued == 1
    requests.close(0)
    await wait_until(lambda: requests.running() == [2])


def refuse(admission: AdmissionManager, ticket: Ticket) -> None:
    admission.refused(ticket, CapacityError("no free KV pages"))


async def test_a_refused_request_waits_ahead_of_later_ones_and_probes_alone(requests_of):
    admission = manager(max_running=4, max_queued=8)
    requests = requests_of(admission)
    await requests.arrive(2)
    await wait_until(lambda: requests.running() == [0, 1])
    admission.reserved(requests.tickets[0])  # request 0 holds pages
    refuse(admission, requests.tickets[1])  # decode has no pages for request 1
    await requests.arrive(2)  # later arrivals queue behind it although slots are free
    assert requests.running() == [0] and admission.snapshot().is_kv_limited
    requests.close(0)  # pages freed: the oldest waiter alone tries again
    await wait_until(lambda: requests.running() == [1])
    await asyncio.sleep(0.2)  # longer than the backoff: still alone while it tries
    assert requests.running() == [1]
    admission.reserved(requests.tickets[1])  # it got pages: two may try now
    await wait_until(lambda: requests.running() == [1, 2, 3])
    admission.reserved(requests.tickets[2])
    admission.reserved(requests.tickets[3])
    assert not admission.snapshot().is_kv_limited


async def test_after_a_refusal_the_backoff_lets_the_head_try_again(requests_of):
    admission = manager(max_running=2, max_queued=8)
    requests = requests_of(admission)
    await requests.arrive(1)
    await wait_until(lambda: requests.running() == [0])
    refuse(admission, requests.tickets[0])
    assert requests.running() == []
    await wait_until(lambda: requests.running() == [0])  # nothing ended: the backoff passed
    refuse(admission, requests.tickets[0])
    await wait_until(lambda: requests.running() == [0])
    admission.reserved(requests.tickets[0])
    assert requests.running() == [0] and not admission.snapshot().is_kv_limited


async def test_waiting_for_kv_pages_past_the_limit_is_a_429(requests_of):
    admission = manager(max_running=2, max_queued=8, queue_timeout_s=0.3)
    requests = requests_of(admission)
    await requests.arrive(1)
    await wait_until(lambda: requests.running() == [0])
    ticket = requests.tickets[0]
    with pytest.raises(OverloadedError, match="for KV pages on decode: no free KV pages"):
        while True:  # what the placer does: wait, try, get refused
            await admission.wait_turn(ticket)
            refuse(admission, ticket)
    assert metric(admission, "admission_rejected_total", reason="kv_capacity") == 1
    assert admission.snapshot().num_queued == 0 and admission.snapshot().num_running == 0


async def test_a_wait_behind_the_kv_gate_past_the_limit_is_a_kv_capacity_429(requests_of):
    admission = manager(max_running=4, max_queued=8, queue_timeout_s=0.3)
    requests = requests_of(admission)
    await requests.arrive(1)
    await wait_until(lambda: requests.running() == [0])
    refuse(admission, requests.tickets[0])
    [later] = await requests.arrive()  # free slots, but the gate holds it behind request 0
    await wait_until(
        lambda: requests.running() == [0]
    )  # request 0 tries again and never hears back
    with pytest.raises(OverloadedError, match="for KV pages on decode: no free KV pages"):
        await later
    assert metric(admission, "admission_rejected_total", reason="kv_capacity") == 1
    assert metric(admission, "admission_rejected_total", reason="queue_timeout") == 0
