"""The router's input-surface flags reach its config (no process is started)."""

from __future__ import annotations

import pytest

from services.router.__main__ import build_parser, config_from_args
from services.router.config import LimitsConfig, default_max_request_bytes
from tests.conftest import TINY_MODEL_DIR

BASE = ["--model", str(TINY_MODEL_DIR)]


def limits(*argv: str) -> LimitsConfig:
    return config_from_args(build_parser().parse_args([*BASE, *argv])).limits


def test_defaults():
    got = limits()
    assert got.max_request_bytes == default_max_request_bytes(20 * 1024 * 1024) == 32_156_332
    assert got == LimitsConfig()  # the flags' defaults are the config's
    assert not got.allow_private_image_urls and got.max_image_redirects == 3
    assert got.image_fetch_timeout_s == 10.0


def test_the_default_body_limit_follows_max_image_bytes():
    assert limits("--max-image-bytes", "3000000").max_request_bytes == 4_000_000 + 4 * 1024 * 1024


def test_explicit_values():
    got = limits(
        "--max-request-bytes",
        "1234",
        "--allow-private-image-urls",
        "--max-image-redirects",
        "0",
        "--image-fetch-timeout-s",
        "2.5",
    )
    assert (got.max_request_bytes, got.allow_private_image_urls, got.max_image_redirects) == (
        1234,
        True,
        0,
    )
    assert got.image_fetch_timeout_s == 2.5


@pytest.mark.parametrize("argv", [["--max-request-bytes", "0"], ["--max-image-redirects", "-1"]])
def test_out_of_range_values_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*BASE, *argv])
    assert "must be" in capsys.readouterr().err


def test_http_reuse_port_lets_router_processes_share_the_port():
    from services.router.__main__ import bind_http_socket

    assert not config_from_args(build_parser().parse_args(BASE)).http_reuse_port
    assert config_from_args(build_parser().parse_args([*BASE, "--http-reuse-port"])).http_reuse_port
    first = bind_http_socket("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    second = bind_http_socket("127.0.0.1", port, reuse_port=True)
    try:
        for sock in (first, second):
            sock.listen()
        with pytest.raises(OSError):  # without the flag the port stays exclusive
            bind_http_socket("127.0.0.1", port).listen()
    finally:
        first.close()
        second.close()
