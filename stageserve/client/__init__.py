"""Typed Python client of the router's gRPC API (``stageserve.v1.Router/Generate``).

    from stageserve.client import Client, Image, Message, Sampling

    with Client("127.0.0.1:50051", api_key="...") as client:
        done = client.generate("Once upon a time", sampling=Sampling(max_new_tokens=16))
        print(done.text, done.finish_reason, done.usage)
        chat = [Message("user", [Image.from_file("cat.png"), "What is shown here?"])]
        for chunk in client.stream(messages=chat):
            print(chunk.text, end="", flush=True)

``Sampling(grammar=Grammar(GrammarKind.JSON_SCHEMA, schema_json))`` constrains the output;
``num_choices`` asks for several samples (``generate_choices``); ``tools`` with ``messages``
lists functions the model may call, and ``Completion.tool_calls`` holds the calls it made; the
history may hold them (``Message("assistant", tool_calls=done.tool_calls)``) and their results
(``Message("tool", "rain", tool_call_id=call.id)``). ``chat_template_kwargs`` (extra chat template
variables), ``continue_final_message`` (with ``add_generation_prompt=False``: the model continues
the last, assistant, message) and ``skip_special_tokens=False`` (special tokens kept in the text)
are the HTTP API's (vLLM's) fields.
``AsyncClient`` is the same for asyncio. A failed call raises the ``StageServeError`` subclass
of its gRPC status (the router's own class and ``param`` when it sent them), carrying the
call's ``request_id``; ``CapacityError`` (``OverloadedError``) and ``UnavailableError`` are
the ones worth retrying.
"""

from services.common.errors import (
    AbortedError,
    CapacityError,
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    StageServeError,
    UnauthenticatedError,
    UnavailableError,
)
from services.common.types import FinishReason, Grammar, GrammarKind, Usage
from stageserve.client.aio import AsyncClient, AsyncStream
from stageserve.client.sync import Client, Stream
from stageserve.client.types import (
    Chunk,
    Completion,
    Image,
    Message,
    Sampling,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
)

__all__ = [
    "AbortedError",
    "AsyncClient",
    "AsyncStream",
    "CapacityError",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "FinishReason",
    "Grammar",
    "GrammarKind",
    "Image",
    "InvalidRequestError",
    "Message",
    "NotFoundError",
    "OverloadedError",
    "Sampling",
    "StageServeError",
    "Stream",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "UnauthenticatedError",
    "UnavailableError",
    "Usage",
]
