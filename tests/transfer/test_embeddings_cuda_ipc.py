"""The CUDA IPC embedding backend: wire format, refusals and mappings on CPU.

Two processes on GPUs run under the gpu marker.

On the GPU, prefill (a zeroed buffer on the last visible GPU, and a host buffer over shm)
hands an encoder process (rows on cuda:0) one window of each; the encoder writes the same runs
into both: the GPU buffer then holds exactly the shm buffer's values and nothing outside the
runs changed. A destination whose layout disagrees with the export, a window outside it, a
handle that maps nothing and a passed deadline are refused; once prefill exited, a send to its
buffer (mapped already, or not) is ``UnavailableError``.
"""

from __future__ import annotations

import faulthandler
import os
import time
import traceback

import msgspec
import pytest
import torch
import torch.multiprocessing as mp

from services.common.destinations import EmbeddingDestination
from services.common.errors import DeadlineExceededError, InvalidRequestError, UnavailableError
from services.transfer import (
    create_embedding_receiver,
    create_embedding_sender,
    embeddings_cuda_ipc,
)
from services.transfer.cuda_ipc_backend import IpcPool
from services.transfer.cuda_ipc_backend import encode_session_id as encode_kv_session_id
from services.transfer.cuda_ipc_memory import IpcBuffer, OwnerProcess
from services.transfer.embeddings import EmbeddingBuffer
from services.transfer.embeddings_cuda_ipc import (
    CudaIpcEmbeddingReceiver,
    CudaIpcEmbeddingSender,
    IpcRows,
    decode_session_id,
    encode_session_id,
)

HIDDEN, NUM_ROWS, WINDOW = 16, 64, (8, 32)  # window: rows [8, 40) of the buffer
RUNS = [(0, 0, 5), (5, 5, 3), (10, 12, 6)]  # the first two coalesce
BUF = IpcBuffer(b"\x00\x01" * 32, NUM_ROWS * HIDDEN * 2, 512, b"/torch_123_4", 7, None)


def _exported(**changes) -> IpcRows:
    rows = IpcRows(
        "GPU-abc", NUM_ROWS, HIDDEN, "bfloat16", 0x7F0000, OwnerProcess.this_process(), BUF
    )
    return msgspec.structs.replace(rows, **changes)


def _destination(
    exported: IpcRows, start: int = WINDOW[0], num_rows: int = WINDOW[1]
) -> EmbeddingDestination:
    return EmbeddingDestination(
        "cuda_ipc",
        "",
        encode_session_id(exported),
        0,
        exported.base_address + start * HIDDEN * 2,
        num_rows,
        HIDDEN * 2,
        HIDDEN,
        "bfloat16",
    )


def test_session_id_round_trips_and_rejects_what_it_did_not_make():
    assert decode_session_id(encode_session_id(_exported())) == _exported()
    kv = encode_kv_session_id(IpcPool("GPU-abc", (1, 2, 3, 4, 5), "bfloat16", BUF, BUF))
    for bad in (
        "shm:stageserve-emb-1@0",
        "cuda-ipc-rows:not base64!",
        "cuda-ipc-rows:QUJD",
        kv,
        "cuda-ipc-rows:" + kv.removeprefix("cuda-ipc:"),
    ):
        with pytest.raises(InvalidRequestError, match="CUDA IPC embedding destination"):
            decode_session_id(bad)
    for changes, problem in [
        ({"num_rows": 0}, "shape"),
        ({"hidden_size": -1}, "shape"),
        ({"dtype": "int64"}, "dtype 'int64'"),
        ({"base_address": -4}, "negative address"),
        (
            {"buffer": msgspec.structs.replace(BUF, storage_size_bytes=100)},
            "100 bytes exported for 64 rows",
        ),
    ]:
        with pytest.raises(
            InvalidRequestError, match=f"malformed CUDA IPC embedding destination: .*{problem}"
        ):
            decode_session_id(encode_session_id(_exported(**changes)))


def test_registry_builds_both_ends_and_a_host_buffer_is_refused():
    assert isinstance(create_embedding_sender("cuda_ipc"), CudaIpcEmbeddingSender)
    receiver = create_embedding_receiver("cuda_ipc", cp_rank=1)
    assert isinstance(receiver, CudaIpcEmbeddingReceiver) and receiver.cp_rank == 1
    with pytest.raises(
        ValueError, match="needs a CUDA buffer \\(prefill on a GPU\\), got one on cpu"
    ):
        receiver.register(EmbeddingBuffer(NUM_ROWS, HIDDEN, torch.bfloat16))


def test_sender_refuses_before_touching_cuda():
    sender, rows = CudaIpcEmbeddingSender(), torch.zeros(20, HIDDEN, dtype=torch.bfloat16)
    dst = _destination(_exported())
    deadline_mono = time.monotonic() + 5
    with pytest.raises(InvalidRequestError, match="a shm destination for the cuda_ipc sender"):
        sender.send_runs(
            "r", rows, RUNS, msgspec.structs.replace(dst, backend="shm"), deadline_mono
        )
    with pytest.raises(InvalidRequestError, match="malformed CUDA IPC embedding destination"):
        sender.send_runs(
            "r",
            rows,
            RUNS,
            msgspec.structs.replace(dst, session_id="cuda-ipc-rows:QUJD"),
            deadline_mono,
        )
    with pytest.raises(InvalidRequestError, match="sends rows from a GPU, got rows on cpu"):
        sender.send_runs("r", rows, RUNS, dst, deadline_mono)
    with pytest.raises(InvalidRequestError, match="outside the 32 rows allocated"):
        sender.send_runs("r", rows, [(0, 30, 5)], dst, deadline_mono)


def test_an_owner_is_gone_once_its_process_exited():
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=os.getpid)
    child.start()
    child.join(60)
    me = OwnerProcess.this_process()
    assert not me.has_exited()
    assert msgspec.structs.replace(me, pid=child.pid).has_exited()  # or a new process under its pid
    assert msgspec.structs.replace(me, start_time=me.start_time + 1).has_exited()  # the pid reused
    assert not msgspec.structs.replace(
        me, pid=child.pid, pid_namespace=me.pid_namespace + 1
    ).has_exited()


def test_sender_maps_each_buffer_once_and_checks_each_window(monkeypatch):
    opened: list[str] = []

    def fake_open(exported, device):  # CPU stand-in for mapping prefill's buffer over CUDA IPC
        opened.append(exported.device_uuid)
        return (
            torch.arange(exported.num_rows).repeat_interleave(exported.hidden_size).view(-1, HIDDEN)
        )

    monkeypatch.setattr(embeddings_cuda_ipc, "_open", fake_open)
    sender, cpu = CudaIpcEmbeddingSender(max_peers=2), torch.device("cpu")
    buffers = {name: _exported(device_uuid=name) for name in ("gpu-a", "gpu-b", "gpu-c")}
    for name in ("gpu-a", "gpu-b", "gpu-a", "gpu-c", "gpu-a", "gpu-b"):
        window = sender._window("r", _destination(buffers[name]), buffers[name], cpu)
        assert window.shape == (WINDOW[1], HIDDEN) and window[0, 0] == WINDOW[0]  # rows [8, 40)
    assert opened == [
        "gpu-a",
        "gpu-b",
        "gpu-c",
        "gpu-b",
    ]  # c evicted b (least recently used), b evicted c
    exported = buffers["gpu-a"]
    with pytest.raises(InvalidRequestError, match="do not match the exported buffer"):
        sender._window(
            "r", msgspec.structs.replace(_destination(exported), hidden_size=8), exported, cpu
        )
    for start, num_rows in ((NUM_ROWS - 4, 8), (-1, 4)):
        with pytest.raises(InvalidRequestError, match="is not inside the exported 64-row buffer"):
            sender._window("r", _destination(exported, start, num_rows), exported, cpu)
    gone = _exported(
        device_uuid="gpu-d", owner=msgspec.structs.replace(exported.owner, start_time=-1)
    )
    sender._window("r", _destination(gone), gone, cpu)
    sender._window(
        "r", _destination(buffers["gpu-c"]), buffers["gpu-c"], cpu
    )  # a new buffer drops gpu-d's
    assert [key[0] for key in sender._peers] == [
        _destination(b).session_id for b in (buffers["gpu-b"], buffers["gpu-c"])
    ]


# --- two processes on GPUs --------------------------------------------------------------


def _source_rows() -> torch.Tensor:
    return torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)


def _prefill(
    device_index: int, to_encoder: mp.Queue, from_encoder: mp.Queue, out: mp.Queue
) -> None:
    faulthandler.dump_traceback_later(100, exit=True)
    gpu = EmbeddingBuffer(NUM_ROWS, HIDDEN, torch.bfloat16, torch.device("cuda", device_index))
    host = EmbeddingBuffer(NUM_ROWS, HIDDEN, torch.bfloat16)
    receivers = [create_embedding_receiver("cuda_ipc"), create_embedding_receiver("shm")]
    for receiver, buffer in zip(receivers, (gpu, host), strict=True):
        receiver.register(buffer)
    to_encoder.put([msgspec.msgpack.encode(r.destination("r", *WINDOW)) for r in receivers])
    written = from_encoder.get(timeout=90)
    rows = gpu.tensor.cpu()
    touched = torch.zeros(NUM_ROWS, dtype=torch.bool)
    for _, dst_row, num_rows in RUNS:
        touched[WINDOW[0] + dst_row : WINDOW[0] + dst_row + num_rows] = True
    out.put(
        (
            written,
            torch.equal(rows, host.tensor),
            bool(rows[touched].ne(0).any()),
            bool(rows[~touched].eq(0).all()),
        )
    )
    for receiver in receivers:
        receiver.close()


def _encoder_sends(
    dsts: list[EmbeddingDestination], go_on: mp.Queue, from_encoder: mp.Queue
) -> list[str]:
    rows = _source_rows().to("cuda:0")
    sender, seen = CudaIpcEmbeddingSender(), []
    ipc, shm = dsts
    cases = [
        (msgspec.structs.replace(ipc, hidden_size=8), InvalidRequestError, "layout"),
        (msgspec.structs.replace(ipc, num_rows=NUM_ROWS), InvalidRequestError, "window"),
    ]
    exported = decode_session_id(ipc.session_id)
    bogus = msgspec.structs.replace(exported.buffer, handle=bytes(len(exported.buffer.handle)))
    bogus_id = encode_session_id(msgspec.structs.replace(exported, buffer=bogus))
    cases.append(
        (msgspec.structs.replace(ipc, session_id=bogus_id), UnavailableError, "unmappable")
    )
    for dst, error, name in cases:
        try:
            sender.send_runs("r", rows, RUNS, dst, time.monotonic() + 30)
        except error:
            seen.append(name)
    try:
        sender.send_runs("r", rows, RUNS, ipc, time.monotonic() - 1)
    except DeadlineExceededError:
        seen.append("deadline")
    ipc_result = sender.send_runs("r", rows, RUNS, ipc, time.monotonic() + 30)
    shm_result = create_embedding_sender("shm").send_runs(
        "r", rows, RUNS, shm, time.monotonic() + 30
    )
    from_encoder.put((ipc_result.num_bytes, ipc_result.num_descriptors, shm_result.num_bytes))
    go_on.get(timeout=90)  # prefill exited
    for fresh in (False, True):
        try:
            (CudaIpcEmbeddingSender() if fresh else sender).send_runs(
                "r", rows, RUNS, ipc, time.monotonic() + 30
            )
        except UnavailableError as exc:
            seen.append(f"gone: {exc}")
    return seen


def _encoder(to_encoder: mp.Queue, from_encoder: mp.Queue, go_on: mp.Queue, out: mp.Queue) -> None:
    faulthandler.dump_traceback_later(100, exit=True)
    dsts = [
        msgspec.msgpack.decode(raw, type=EmbeddingDestination) for raw in to_encoder.get(timeout=90)
    ]
    try:
        out.put(_encoder_sends(dsts, go_on, from_encoder))
    except BaseException:  # report it at once: prefill must not wait for rows that never come
        from_encoder.put(None)
        out.put(["crashed: " + traceback.format_exc()])
        raise


@pytest.mark.gpu
def test_encoder_process_writes_the_shm_paths_rows_into_a_prefill_gpu_buffer():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ctx = mp.get_context("spawn")
    to_encoder, from_encoder, go_on, prefill_out, encoder_out = (ctx.Queue() for _ in range(5))
    prefill = ctx.Process(
        target=_prefill, args=(torch.cuda.device_count() - 1, to_encoder, from_encoder, prefill_out)
    )
    encoder = ctx.Process(target=_encoder, args=(to_encoder, from_encoder, go_on, encoder_out))
    prefill.start()
    encoder.start()
    try:
        written, same_as_shm, runs_written, rest_untouched = prefill_out.get(timeout=110)
        prefill.join(60)
        go_on.put("prefill exited")
        seen = encoder_out.get(timeout=110)
    finally:
        for process in (prefill, encoder):
            process.join(30)
            if process.is_alive():
                process.kill()
    num_bytes = sum(n for _, _, n in RUNS) * HIDDEN * 2
    assert written == (num_bytes, 2, num_bytes)  # two copies: the first two runs coalesce
    assert same_as_shm and runs_written and rest_untouched
    assert seen[:4] == ["layout", "window", "unmappable", "deadline"], seen
    assert len(seen) == 6 and all("exited" in s for s in seen[4:]), seen
    assert prefill.exitcode == 0 and encoder.exitcode == 0
