"""Image URLs: http(s) fetch with a byte limit and a timeout, against a local HTTP server
(loopback, so these loaders allow private addresses; test_image_fetch.py covers refusing them)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.common.errors import InvalidRequestError
from services.router.config import LimitsConfig
from services.router.image_fetch import UNREACHABLE
from services.router.images import ImageLoader, check_image
from tests.conftest import image_bytes
from tests.router.hostile import png_bomb

PNG = image_bytes(40, 30, seed=1)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(3)
        body = {
            "/ok.png": PNG,
            "/slow.png": PNG,
            "/big.png": b"\x89PNG" + bytes(64 * 1024),
            "/text.png": b"hello",
        }.get(self.path)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def base_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def loader_for_loopback(fetch_timeout_s: float) -> ImageLoader:
    limits = LimitsConfig(
        max_image_bytes=32 * 1024,
        image_fetch_timeout_s=fetch_timeout_s,
        allow_private_image_urls=True,
    )
    return ImageLoader.from_limits(limits)


async def test_fetches_an_image(base_url):
    loader = loader_for_loopback(2.0)
    try:
        assert await loader.load(f"{base_url}/ok.png", "p") == PNG
    finally:
        await loader.close()


async def test_loopback_is_refused_by_default(base_url):
    loader = ImageLoader.from_limits(LimitsConfig(max_image_bytes=32 * 1024))
    try:
        with pytest.raises(InvalidRequestError, match="non-public address"):
            await loader.load(f"{base_url}/ok.png", "p")
    finally:
        await loader.close()


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/missing.png", "HTTP 404"),
        ("/big.png", "larger than the limit"),
        ("/text.png", "not an image"),
        ("/slow.png", UNREACHABLE),
    ],
)
async def test_bad_urls_are_invalid_requests(base_url, path, message):
    loader = loader_for_loopback(0.5)
    try:
        with pytest.raises(InvalidRequestError, match=message) as info:
            await loader.load(f"{base_url}{path}", "messages[0].content[0].image_url")
        assert info.value.param == "messages[0].content[0].image_url"
    finally:
        await loader.close()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (png_bomb(), "too many pixels"),
        (b"valid base64, but not an image", "not an image in a format this server reads"),
        (png_bomb()[:20], "truncated or corrupt"),
        (b"", "empty"),
    ],
)
def test_check_image_refuses_without_quoting_pil(data, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        check_image(data, 1024, "image")
    assert "0x" not in info.value.message and "BytesIO" not in info.value.message
    assert info.value.param == "image"
