"""One chat or text completion against any OpenAI-compatible server, timed.

What is measured, per request (all clocks are ``time.perf_counter`` on the client):

- start: just before the POST is sent (after any wait for a concurrency slot).
- TTFT: start → the first SSE chunk with text: a chat chunk whose ``delta`` has
  non-empty ``content`` (or ``reasoning_content``, which reasoning parsers stream before
  the answer), a completion chunk with non-empty ``text``.
- E2E: start → the end of the stream (``[DONE]`` or the connection closing), so it
  includes the final usage chunk.
- prompt/completion tokens: the server's ``usage`` (``stream_options.include_usage``);
  when a server sends no usage, completion tokens fall back to the number of content chunks.
- ITL, per token: the gaps between consecutive content chunks. A chunk may carry
  several tokens (servers batch detokenized text, or emit several tokens per step), so
  the first content chunk is taken to carry one token and the other ``completion_tokens - 1``
  tokens are split as evenly as integers allow over the later chunks; a gap followed by
  ``k`` tokens gives ``k`` ITL values of ``gap / k``. The ITL list then has
  ``completion_tokens - 1`` entries summing to first→last content chunk. If a server
  sends more content chunks than tokens (text split inside a token), the raw chunk
  gaps are used.
- TPOT: ``(E2E - TTFT) / (completion_tokens - 1)``, the usual definition (vLLM's and
  SGLang's benchmarks use it), for requests with at least two completion tokens.

Without streaming (``--no-stream``) the reply is one JSON body: TTFT and E2E are both
start → the body read, there is no ITL and no TPOT, and the tokens are the reply's ``usage``.

A request succeeds when the server answers 200, sends no ``error`` event and streams (or
returns) some content; anything else is a failure carrying the error text. The generated text
is kept (vLLM's result JSON has it).
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.serve_workload import RequestSpec

ERROR_TEXT_LEN = 300


class Outcome(enum.StrEnum):
    OK = "ok"
    FAILED = "failed"  # HTTP error, error event, timeout, transport error, no content
    ABORTED = "aborted"  # in flight when --max-duration-s ran out


@dataclass
class RequestRecord:
    index: int
    input_len: int  # prompt text tokens (counted with the model's tokenizer)
    output_len: int  # requested (max_tokens)
    num_images: int
    outcome: Outcome = Outcome.FAILED
    error: str = ""
    start_s: float = 0.0  # from the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int | None = None  # server-reported
    completion_tokens: int | None = None  # server-reported
    num_chunks: int = 0  # content chunks received
    itl_s: list[float] = field(default_factory=list)  # per token
    generated_text: str = ""


def new_record(spec: RequestSpec) -> RequestRecord:
    return RequestRecord(spec.index, spec.input_len, spec.output_len, spec.num_images)


def per_token_itl(chunk_times: list[float], completion_tokens: int | None) -> list[float]:
    """Per-token inter-token latencies from content-chunk arrival times (method: the module doc)."""
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    num_later_tokens = (
        completion_tokens if completion_tokens is not None else len(chunk_times)
    ) - 1
    if not gaps or num_later_tokens < len(gaps):
        return gaps
    base, extra = divmod(num_later_tokens, len(gaps))
    itl: list[float] = []
    for i, gap in enumerate(gaps):
        num_tokens = base + (1 if i < extra else 0)
        itl.extend([gap / num_tokens] * num_tokens)
    return itl


class _Stream:
    """What one SSE stream said, as it arrives."""

    def __init__(self) -> None:
        self.chunk_times: list[float] = []
        self.texts: list[str] = []
        self.usage: dict | None = None
        self.error = ""

    def feed(self, line: str, now: float) -> bool:
        """Take one SSE line; returns False once the stream is over (``[DONE]`` or an error)."""
        if not line.startswith("data:"):
            return True  # blank separators, comments, event: lines
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return False
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"SSE data is not a JSON object: {data[:80]!r}")
        if event.get("error"):
            self.error = "error event: " + json.dumps(event["error"])[:ERROR_TEXT_LEN]
            return False
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content") or delta.get("reasoning_content") or choice.get("text")
            if text:
                self.chunk_times.append(now)
                self.texts.append(text)
                break
        return True

    def take_reply(self, reply: object, now: float) -> None:
        """Take a whole (non-streamed) completion: its text arrives at once, at ``now``."""
        if not isinstance(reply, dict):
            raise ValueError("the reply is not a JSON object")
        self.usage = reply.get("usage")
        for choice in reply.get("choices") or ():
            message = choice.get("message") or {}
            text = message.get("content") or message.get("reasoning_content") or choice.get("text")
            if text:
                self.chunk_times.append(now)
                self.texts.append(text)
                break


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    spec: RequestSpec,
    timeout_s: float,
    t0: float,
) -> RequestRecord:
    """POST one completion (streamed unless ``spec.is_streamed`` is off) and time it; never
    raises except on cancellation."""
    record = new_record(spec)
    stream = _Stream()
    start = time.perf_counter()
    record.start_s = start - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, content=spec.body, headers=headers) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace")
                    record.error = f"HTTP {response.status_code}: {text[:ERROR_TEXT_LEN]}"
                elif not spec.is_streamed:
                    reply = json.loads(await response.aread())
                    stream.take_reply(reply, time.perf_counter())
                else:
                    async for line in response.aiter_lines():
                        if not stream.feed(line, time.perf_counter()):
                            break
    except TimeoutError:
        record.error = f"timeout after {timeout_s:g} s (--request-timeout-s)"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_LEN]
    except ValueError as exc:  # not JSON, or JSON that is not an event object
        record.error = f"malformed stream: {exc}"[:ERROR_TEXT_LEN]
    finish(record, stream, start, time.perf_counter(), spec.is_streamed)
    return record


def finish(
    record: RequestRecord, stream: _Stream, start: float, end: float, is_streamed: bool = True
) -> None:
    record.error = record.error or stream.error
    record.num_chunks = len(stream.chunk_times)
    record.generated_text = "".join(stream.texts)
    usage = stream.usage or {}
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens", record.num_chunks or None)
    if record.error:
        return
    if not stream.chunk_times:
        record.error = "the stream ended without any content"
        return
    record.outcome = Outcome.OK
    record.ttft_s = stream.chunk_times[0] - start
    record.e2e_s = end - start
    if not is_streamed:
        record.ttft_s = record.e2e_s  # the whole reply is the first token's arrival
        return
    record.itl_s = per_token_itl(stream.chunk_times, record.completion_tokens)
    if record.completion_tokens and record.completion_tokens > 1:
        record.tpot_s = (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)
