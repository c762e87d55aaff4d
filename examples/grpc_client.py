"""Call a running stageserve through its gRPC API with the blocking client.

    stageserve up --grpc-port 50051 --api-key "$STAGESERVE_API_KEY"
    python examples/grpc_client.py --address 127.0.0.1:50051 --image cat.png

One whole completion from a raw prompt, then a chat with an image streamed as it is generated.
The key comes from --api-key or STAGESERVE_API_KEY; the image from a file (--image) or a URL
the router fetches (--image-url); without either the chat is text only.
"""

from __future__ import annotations

import argparse
import os
import sys

from stageserve.client import Client, Image, Message, Sampling, StageServeError


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="the router's gRPC port")
    parser.add_argument("--api-key", default=os.environ.get("STAGESERVE_API_KEY") or None)
    parser.add_argument("--image", default=None, help="an image file to ask about")
    parser.add_argument("--image-url", default=None, help="an image URL the router fetches")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    sampling = Sampling(temperature=0, max_new_tokens=args.max_new_tokens)
    parts: list[str | Image] = ["What is shown here?"]
    if args.image:
        parts.insert(0, Image.from_file(args.image))
    if args.image_url:
        parts.insert(0, Image(url=args.image_url))
    with Client(args.address, api_key=args.api_key, timeout_s=120) as client:
        try:
            done = client.generate("The capital of France is", sampling=sampling)
            print(f"prompt -> {done.text!r} ({done.finish_reason.value}, {done.usage})")
            with client.stream(messages=[Message("user", parts)], sampling=sampling) as stream:
                print(f"chat [{stream.request_id}] -> ", end="")
                for chunk in stream:
                    print(chunk.text, end="", flush=True)
                    if chunk.usage is not None:
                        print(f"\n({chunk.finish_reason.value}, {chunk.usage})")
        except StageServeError as exc:
            print(f"{type(exc).__name__} [{exc.request_id}]: {exc.message}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
