"""GPU (run through the device tool, never in CI): W = 2 with both ranks on cuda:0 gives the
rows of W = 1 within bf16 tolerance, and the leader (this process) never touches CUDA; a rank
on cuda:0 writes over CUDA IPC into a GPU buffer exactly the rows it writes over shm."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import image_bytes
from tests.vision_encoder.conftest import serve_encoder, spans_for

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-2


async def test_two_ranks_on_one_gpu_write_one_ranks_rows(image_processor) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    was_initialized = torch.cuda.is_initialized()  # by an earlier test of this process
    sizes = [(640, 480), (200, 150), (56, 56), (300, 97), (640, 480), (1000, 40)]
    images = [image_bytes(w, h, seed=900 + i) for i, (w, h) in enumerate(sizes)]
    images.append(images[0])  # a repeat in the call
    spans = spans_for(image_processor, images)
    num_rows = sum(s.span.length for s in spans)
    rows = {}
    for devices in (("cuda:0",), ("cuda:0", "cuda:0")):
        with serve_encoder(len(devices), devices=devices, dtype="bfloat16") as enc:
            prefill = enc.prefill(dtype=torch.bfloat16)
            results = await enc.encode("gpu", spans, prefill.destination("gpu", 0, num_rows))
            assert [r.is_cache_hit for r in results] == [False] * 6 + [True]
            rows[len(devices)] = prefill.buffer.rows(0, num_rows).float().clone()
            assert not torch.isnan(rows[len(devices)]).any()
    torch.testing.assert_close(rows[2], rows[1], rtol=BF16_RTOL, atol=BF16_ATOL)
    if not was_initialized:
        assert not torch.cuda.is_initialized()  # the leader ran in this process and used no GPU


async def test_cuda_ipc_rows_equal_the_shm_rows(image_processor) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    images = [
        image_bytes(w, h, seed=950 + i)
        for i, (w, h) in enumerate([(640, 480), (56, 56), (300, 97)])
    ]
    spans = spans_for(image_processor, images)
    num_rows = sum(s.span.length for s in spans)
    rows = {}
    for backend, device in (("shm", "cpu"), ("cuda_ipc", "cuda:0")):
        with serve_encoder(devices=("cuda:0",), dtype="bfloat16", transfer_backend=backend) as enc:
            prefill = enc.prefill(dtype=torch.bfloat16, backend=backend, device=device)
            results = await enc.encode("gpu", spans, prefill.destination("gpu", 1, num_rows))
            assert [r.is_cache_hit for r in results] == [False] * 3
            assert prefill.buffer.tensor.device.type == device.split(":")[0]
            rows[backend] = (
                prefill.buffer.tensor.cpu()
            )  # row 0 and the rows after the window: unwritten
    assert torch.equal(rows["cuda_ipc"][1 : 1 + num_rows], rows["shm"][1 : 1 + num_rows])
    assert not torch.isnan(rows["cuda_ipc"][1 : 1 + num_rows]).any()
    assert (
        torch.isnan(rows["cuda_ipc"][0]).all()
        and torch.isnan(rows["cuda_ipc"][1 + num_rows :]).all()
    )
