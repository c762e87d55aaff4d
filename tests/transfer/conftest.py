"""Fixtures shared by the transfer backend tests."""

from __future__ import annotations

import pytest

from services.transfer.shm_backend import ShmKVReceiver, ShmKVSender


@pytest.fixture
def kv_pair():
    receiver, sender = ShmKVReceiver(), ShmKVSender()
    yield receiver, sender
    sender.close()
    receiver.close()
