"""Runs tokenize jobs off the event loop, so one big image or prompt stalls no other request.

``num_workers`` > 0: that many worker processes, forked from a fork server, each with
its own pipeline (the ``tokenizers`` BPE holds the GIL while it encodes, so threads
would not run in parallel). Each job goes to the next idle worker, so a slow job (a big
image) holds one worker and the others keep serving. A worker exits by itself soon
after the server process is gone, even one killed without a chance to stop its pool.
``num_workers`` == 0: one thread in this process (tests, debugging).
Jobs and results cross the process boundary as msgpack-encoded ``msgspec`` structs. A
chat's image bytes do not: this process reads each image's hash and size
(``ImageHeader``) and keeps the bytes, which would cost a copy through the pool's pipe.

When every worker is busy, jobs wait in a queue bounded by their encoded size
(``max_queued_bytes``, counting the running ones): a job that would pass it is refused
with ``OverloadedError`` (retry later), so a burst of big requests cannot grow the
server's memory without bound. A lone job is always admitted.

A worker that dies (killed, out of memory) fails the jobs it held with
``UnavailableError`` (retryable) and the pool is rebuilt for the next job.

Liveness: each worker claims a slot of a shared array (``WorkerBeat``: its pid and a
``CLOCK_MONOTONIC`` time, system-wide on Linux) and a thread of it rewrites the time every
``liveness_timeout_s / 4`` (at most 1 s), the same thread that watches for the server's
death. A watchdog thread in the server reads the slots: a worker whose time is older than
``liveness_timeout_s`` is frozen as a whole (SIGSTOP, swapped out, stuck in the kernel), not
just busy with a long job (the beat thread runs beside the job). It is killed (SIGKILL),
which breaks its pool: the jobs the pool held fail with ``UnavailableError`` (the router
retries or answers 503), and the watchdog rebuilds the pool at once and warms its new workers
(with ``PingJob``s), so new jobs go to live workers. A job submitted to a pool found broken
before the job ran goes to the new pool instead of failing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import msgspec

from services.common import offload
from services.common.errors import InvalidRequestError, OverloadedError, UnavailableError
from services.common.types import ChatMessage, ContentPart, ImagePart, TextPart, TokenizedPrompt
from services.tokenizer.config import MAX_QUEUED_BYTES, WORKER_LIVENESS_TIMEOUT_S, Limits
from services.tokenizer.pipeline import TokenizePipeline, image_header

logger = logging.getLogger(__name__)

MAX_BEAT_INTERVAL_S = 1.0  # also how often a worker checks that the server is alive


class ChatJob(msgspec.Struct, frozen=True, tag="chat"):
    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # extra template variables (checked: ``chat.template_kwargs_from_json``)
    template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


class PromptJob(msgspec.Struct, frozen=True, tag="prompt"):
    prompt: str


class PingJob(msgspec.Struct, frozen=True, tag="ping"):
    """Answered once the worker has loaded its pipeline (warm-up)."""


Job = ChatJob | PromptJob | PingJob


class JobDone(msgspec.Struct, frozen=True, tag="done"):
    prompt: TokenizedPrompt


class JobRejected(msgspec.Struct, frozen=True, tag="rejected"):
    """The job's input was invalid: becomes ``InvalidRequestError(message, param=param)``."""

    message: str
    param: str | None = None


JobResult = JobDone | JobRejected


def _text_bytes(job: Job) -> int:
    """The characters of a job's text (what its encoding copies; a chat's images are headers by
    then)."""
    if isinstance(job, PromptJob):
        return len(job.prompt)
    if isinstance(job, ChatJob):
        return sum(len(p.text) for m in job.messages for p in m.content if isinstance(p, TextPart))
    return 0


# Caller side and worker side each use their own codec objects (the worker may be a thread).
_job_encoder = msgspec.msgpack.Encoder()
_result_decoder = msgspec.msgpack.Decoder(JobResult)
_job_decoder = msgspec.msgpack.Decoder(Job)
_result_encoder = msgspec.msgpack.Encoder()


def run_job(pipeline: TokenizePipeline, job_bytes: bytes) -> bytes:
    """Decode a job, run it, encode its result; invalid input is a result, not a raise."""
    job = _job_decoder.decode(job_bytes)
    try:
        if isinstance(job, ChatJob):
            prompt = pipeline.tokenize_chat(
                job.messages,
                job.add_generation_prompt,
                continue_final_message=job.continue_final_message,
                template_kwargs=job.template_kwargs,
            )
        elif isinstance(job, PromptJob):
            prompt = pipeline.tokenize_prompt(job.prompt)
        else:
            prompt = TokenizedPrompt(token_ids=())
    except InvalidRequestError as exc:
        return _result_encoder.encode(JobRejected(exc.message, exc.param))
    return _result_encoder.encode(JobDone(prompt))


class WorkerBeat(ctypes.Structure):
    """One worker's slot: its pid (0: free), when it last beat (``time.monotonic()``) and
    whether its pipeline has loaded."""

    _fields_ = [("pid", ctypes.c_int64), ("beat_at", ctypes.c_double), ("is_loaded", ctypes.c_int)]


_worker_pipeline: TokenizePipeline | None = None  # one per worker process, set by _init_worker
START_TIMEOUT_S = 300.0  # a worker spawned by start() that has not loaded its pipeline by then


def _beat_until_gone(server_pid: int, beat: WorkerBeat, interval_s: float) -> None:
    while True:
        beat.beat_at = time.monotonic()
        time.sleep(interval_s)
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            os._exit(0)  # the server died without stopping us: nobody will send a job again
        except PermissionError:
            pass  # alive, owned by someone else (pid reuse): keep waiting


def _claim_slot(beats) -> WorkerBeat:
    with beats.get_lock():
        slot = next(slot for slot in beats if slot.pid == 0)  # a pool starts len(beats) workers
        slot.pid, slot.beat_at, slot.is_loaded = os.getpid(), time.monotonic(), 0
    return slot


def _headers_only(job: ChatJob, limits: Limits) -> tuple[ChatJob, dict[str, bytes]]:
    """``job`` with each image part replaced by its ``ImageHeader``, and the bytes by hash."""
    images: dict[str, bytes] = {}
    messages = []
    for message in job.messages:
        parts: list[ContentPart] = []
        for part in message.content:
            header = image_header(part.data, limits) if isinstance(part, ImagePart) else None
            if header is not None:  # else its size needs a full decode: the worker's work
                images.setdefault(header.content_hash, part.data)
                part = header
            parts.append(part)
        messages.append(msgspec.structs.replace(message, content=tuple(parts)))
    return msgspec.structs.replace(job, messages=tuple(messages)), images


def _init_worker(
    server_pid: int,
    beats,
    beat_interval_s: float,
    model_dir: str,
    max_model_len: int,
    max_image_bytes: int,
    max_image_pixels: int,
) -> None:
    global _worker_pipeline
    slot = _claim_slot(beats)
    threading.Thread(
        target=_beat_until_gone, args=(server_pid, slot, beat_interval_s), name="beat", daemon=True
    ).start()
    _worker_pipeline = TokenizePipeline.from_dir(
        model_dir, Limits(max_model_len, max_image_bytes, max_image_pixels)
    )
    slot.is_loaded = 1


def _run_in_worker(job_bytes: bytes) -> bytes:
    assert _worker_pipeline is not None, "worker initializer did not run"
    return run_job(_worker_pipeline, job_bytes)


def _worker_context() -> multiprocessing.context.BaseContext:
    # Workers fork from a fresh server process that has imported this module (and tokenizers)
    # once: no fork of a process running gRPC threads, no multi-second import per worker.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


class WorkerPool:
    """Tokenize jobs on ``num_workers`` processes (0: one thread); ``start`` before ``run``,
    ``close`` at the end. A worker frozen for ``liveness_timeout_s`` is killed and the pool
    rebuilt (the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        limits: Limits,
        num_workers: int,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        liveness_timeout_s: float = WORKER_LIVENESS_TIMEOUT_S,
    ) -> None:
        assert num_workers >= 0 and max_queued_bytes > 0, (num_workers, max_queued_bytes)
        assert liveness_timeout_s > 0, liveness_timeout_s
        self.model_dir = str(model_dir)
        self.limits = limits
        self.num_workers = num_workers
        self.max_queued_bytes = max_queued_bytes
        self.liveness_timeout_s = liveness_timeout_s
        self.beat_interval_s = min(MAX_BEAT_INTERVAL_S, liveness_timeout_s / 4)
        self._executor: concurrent.futures.Executor | None = None
        self._beats = None  # the current executor's WorkerBeat slots (processes only)
        self._replace_lock = threading.Lock()  # the event loop and the watchdog replace pools
        self._closed = threading.Event()
        self._run = _run_in_worker
        # Encoded bytes of the jobs admitted and not finished; released by the executor's
        # thread when a job ends, so guarded by a lock.
        self._queued_bytes = 0
        self._queued_lock = threading.Lock()

    @property
    def queued_bytes(self) -> int:
        with self._queued_lock:
            return self._queued_bytes

    async def start(self) -> None:
        """Create the workers and wait until each has loaded its tokenizer (a worker that
        finished loading first may answer every warm-up ping, so each one's slot says it)."""
        self._executor = self._new_executor()
        await asyncio.gather(*(self.run(PingJob()) for _ in range(max(self.num_workers, 1))))
        started_by = time.monotonic() + START_TIMEOUT_S
        while self._beats is not None and sum(b.is_loaded for b in self._beats) < self.num_workers:
            if time.monotonic() > started_by:
                raise UnavailableError(f"tokenizer workers not loaded after {START_TIMEOUT_S} s")
            await asyncio.sleep(0.05)
        if self.num_workers:
            threading.Thread(target=self._watch, name="tokenizer-watchdog", daemon=True).start()

    def _new_executor(self) -> concurrent.futures.Executor:
        if self.num_workers == 0:
            pipeline = TokenizePipeline.from_dir(self.model_dir, self.limits)
            self._run = functools.partial(run_job, pipeline)
            return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        limits = self.limits
        context = _worker_context()
        self._beats = context.Array(WorkerBeat, self.num_workers)
        return concurrent.futures.ProcessPoolExecutor(
            self.num_workers,
            mp_context=context,
            initializer=_init_worker,
            initargs=(
                os.getpid(),
                self._beats,
                self.beat_interval_s,
                self.model_dir,
                limits.max_model_len,
                limits.max_image_bytes,
                limits.max_image_pixels,
            ),
        )

    async def run(self, job: Job) -> TokenizedPrompt:
        """The job's prompt; ``InvalidRequestError`` for bad input, ``OverloadedError`` when the
        queue is full, ``UnavailableError`` if its worker died.

        A chat's images stay in this process: their hashes and sizes are read here (off the
        event loop) and only those cross to the worker; the prompt gets the bytes back here.
        The queue bound still counts them, since they are held until the job ends.
        """
        executor = self._executor
        assert executor is not None, "WorkerPool.start() first"
        images: dict[str, bytes] = {}
        if isinstance(job, ChatJob):
            num_image_bytes = sum(
                len(p.data) for m in job.messages for p in m.content if isinstance(p, ImagePart)
            )
            if num_image_bytes:  # hashing a large image would hold the loop: on a thread
                job, images = await offload.sized(num_image_bytes, _headers_only, job, self.limits)
        held = sum(len(data) for data in images.values())
        job_bytes = await offload.sized(_text_bytes(job), _job_encoder.encode, job)
        try:
            submitted = self._submit(executor, job_bytes, held)
        except (BrokenProcessPool, RuntimeError):  # RuntimeError: shut down by its replacement
            self._replace_broken(executor)  # the job never ran: it goes to the new pool
            executor = self._executor
            assert executor is not None, "WorkerPool.close() while a job was submitted"
            submitted = self._submit(executor, job_bytes, held)
        try:
            result_bytes = await submitted
        except BrokenProcessPool as exc:
            self._replace_broken(executor)
            raise UnavailableError(
                "a tokenizer worker process died while handling the request"
            ) from exc
        result = _result_decoder.decode(result_bytes)
        if isinstance(result, JobRejected):
            raise InvalidRequestError(result.message, param=result.param)
        prompt = result.prompt
        if images:  # the worker left the bytes of the images it got as headers empty
            prompt = msgspec.structs.replace(
                prompt, images={key: images.get(key) or data for key, data in prompt.images.items()}
            )
        return prompt

    def _submit(
        self, executor: concurrent.futures.Executor, job_bytes: bytes, held_bytes: int = 0
    ) -> asyncio.Future[bytes]:
        num_bytes = len(job_bytes) + held_bytes
        self._admit(num_bytes)
        try:
            future = executor.submit(self._run, job_bytes)
        except BaseException:
            self._release(num_bytes)
            raise
        future.add_done_callback(lambda _: self._release(num_bytes))  # done, failed or cancelled
        return asyncio.wrap_future(future)

    def _admit(self, num_bytes: int) -> None:
        with self._queued_lock:
            queued = self._queued_bytes
            if queued and queued + num_bytes > self.max_queued_bytes:
                raise OverloadedError(
                    f"the tokenizer is busy: {queued} bytes of requests wait for its "
                    f"{max(self.num_workers, 1)} workers (limit {self.max_queued_bytes}); retry "
                    "later"
                )
            self._queued_bytes = queued + num_bytes

    def _release(self, num_bytes: int) -> None:
        with self._queued_lock:
            self._queued_bytes -= num_bytes

    def _replace_broken(self, broken: concurrent.futures.Executor) -> None:
        with self._replace_lock:
            if self._executor is not broken or self._closed.is_set():
                return  # another failed job (or the watchdog) already replaced it
            logger.error(
                "a tokenizer worker died; restarting %d worker processes", self.num_workers
            )
            # Its jobs fail with BrokenProcessPool once its manager sees the dead worker.
            broken.shutdown(wait=False, cancel_futures=False)
            self._executor = self._new_executor()
            for _ in range(self.num_workers):  # start the workers now, not on the next jobs
                self._executor.submit(self._run, _job_encoder.encode(PingJob()))

    def _watch(self) -> None:
        while not self._closed.wait(self.beat_interval_s):
            with self._replace_lock:
                executor, beats = self._executor, self._beats
            if executor is None or beats is None:
                continue
            now = time.monotonic()
            frozen = [(slot.pid, now - slot.beat_at) for slot in beats if slot.pid]
            frozen = [
                (pid, silent_s) for pid, silent_s in frozen if silent_s > self.liveness_timeout_s
            ]
            for pid, silent_s in frozen:
                logger.error(
                    "tokenizer worker %d did not beat for %.1f s (stopped or hung): killing it",
                    pid,
                    silent_s,
                )
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it died by itself meanwhile
            if frozen:
                self._replace_broken(executor)

    def close(self) -> None:
        """Stop the workers (waits for running jobs; queued ones are cancelled)."""
        self._closed.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
