"""Call a running stageserve through its gRPC API with the asyncio client.

    stageserve up --grpc-port 50051 --api-key "$STAGESERVE_API_KEY"
    python examples/grpc_client_async.py --address 127.0.0.1:50051

Several prompts at once (``asyncio.gather``), then one streamed; a request the router refuses
shows the typed error it raises.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from stageserve.client import AsyncClient, InvalidRequestError, Sampling

PROMPTS = ("Once upon a time", "The quick brown fox", "In a galaxy far away")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="the router's gRPC port")
    parser.add_argument("--api-key", default=os.environ.get("STAGESERVE_API_KEY") or None)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    return parser.parse_args()


async def run(args: argparse.Namespace) -> None:
    sampling = Sampling(temperature=0, max_new_tokens=args.max_new_tokens)
    async with AsyncClient(args.address, api_key=args.api_key, timeout_s=120) as client:
        results = await asyncio.gather(
            *(client.generate(prompt, sampling=sampling) for prompt in PROMPTS)
        )
        for prompt, done in zip(PROMPTS, results, strict=True):
            print(f"{prompt!r} -> {done.text!r} ({done.usage.num_completion_tokens} tokens)")
        async with client.stream("Tell me a story", sampling=sampling) as stream:
            print("stream -> ", end="")
            async for chunk in stream:
                print(chunk.text, end="", flush=True)
            print()
        try:
            await client.generate("x", sampling=Sampling(temperature=-1))
        except InvalidRequestError as exc:
            print(f"refused as expected: {exc.param}: {exc.message}")


def main() -> int:
    asyncio.run(run(parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
