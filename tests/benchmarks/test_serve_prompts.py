"""What the serving benchmark sends the fake server: images of each kind and format, length
ranges, the completions backend, the ShareGPT dataset and shared prefixes."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks.serve import main
from tests.benchmarks.conftest import IMAGE_TOKENS, TEMPLATE_TOKENS, run


def _image_urls(body: dict) -> list[str]:
    return [
        p["image_url"]["url"] for p in body["messages"][0]["content"] if p["type"] == "image_url"
    ]


def _decode_data_url(url: str) -> Image.Image:
    header, _, data = url.partition(",")
    return Image.open(io.BytesIO(base64.b64decode(data)))


def test_images_and_length_ranges(base_url, tmp_path, state):
    args = [
        "--num-requests",
        "6",
        "--images-per-request",
        "1:2",
        "--image-size",
        "32x16",
        "--max-concurrency",
        "1",
    ]  # bodies arrive in request order
    rc, report = run(
        base_url, tmp_path, *args, "--input-len-range", "3:9", "--output-len-range", "2:4"
    )
    assert rc == 0 and report["summary"]["num_ok"] == 6
    urls = []
    for body, record in zip(
        state.bodies, sorted(report["requests"], key=lambda r: r["index"]), strict=True
    ):
        images = _image_urls(body)
        assert len(images) == record["num_images"] and 1 <= len(images) <= 2
        assert 3 <= record["input_len"] <= 9 and record["completion_tokens"] == record["output_len"]
        assert (
            record["prompt_tokens"]
            == record["input_len"] + IMAGE_TOKENS * len(images) + TEMPLATE_TOKENS
        )
        urls += images
    assert len(set(urls)) == len(urls)  # every image differs: no cache can hit
    assert all(url.startswith("data:image/jpeg;base64,") for url in urls)
    image = _decode_data_url(urls[0])
    assert image.format == "JPEG" and image.size == (32, 16)


def _neighbour_difference(image: Image.Image) -> float:
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    return float(np.abs(np.diff(pixels, axis=1)).mean())


def test_the_default_image_is_a_noise_jpeg_of_the_requested_size(base_url, tmp_path, state):
    rc, _ = run(
        base_url, tmp_path, *"--num-requests 1 --images-per-request 1 --image-size 320x200".split()
    )
    assert rc == 0
    [url] = _image_urls(state.bodies[0])
    image = _decode_data_url(url)
    assert url.startswith("data:image/jpeg;base64,")
    assert (image.format, image.size) == ("JPEG", (320, 200))
    assert _neighbour_difference(image) > 50  # uniform noise: ~85 between neighbours; gradient ~1
    # Noise barely compresses: ~0.9 byte/pixel at quality 90 (a gradient JPEG: ~0.1).
    assert len(base64.b64decode(url.partition(",")[2])) > 0.5 * 320 * 200


@pytest.mark.parametrize(
    ("kind", "fmt", "max_difference"),
    [("gradient", "png", 10), ("blank", "png", 1), ("gradient", "jpeg", 10), ("noise", "png", 256)],
)
def test_other_image_kinds_and_formats(base_url, tmp_path, state, kind, fmt, max_difference):
    args = "--num-requests 1 --images-per-request 1 --image-size 360p".split()
    rc, _ = run(base_url, tmp_path, *args, "--image-kind", kind, "--image-format", fmt)
    assert rc == 0
    [url] = _image_urls(state.bodies[0])
    image = _decode_data_url(url)
    assert image.format == fmt.upper() and image.size == (640, 360)
    assert _neighbour_difference(image) < max_difference


def test_completions_backend_streams_text(base_url, tmp_path, state):
    rc, report = run(
        base_url,
        tmp_path,
        *"--backend openai --num-requests 3 --input-len 12 --output-len 4".split(),
    )
    assert rc == 0 and report["summary"]["num_ok"] == 3
    for body, record in zip(state.bodies, report["requests"], strict=True):
        assert "messages" not in body and len(body["prompt"].split()) == 12
        assert body["stream_options"] == {"include_usage": True}
        assert record["prompt_tokens"] == 12 and record["num_chunks"] == 4 and record["ttft_s"] > 0
    with pytest.raises(SystemExit) as info:
        main(["--base-url", base_url, "--backend", "openai", "--images-per-request", "1"])
    assert info.value.code == 2  # no images on text completions


SHAREGPT = Path(__file__).parent / "sharegpt_small.json"


def test_sharegpt_dataset_gives_its_prompts_and_reply_lengths(base_url, tmp_path, state):
    rc, report = run(
        base_url,
        tmp_path,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(SHAREGPT),
        "--num-requests",
        "3",
    )
    assert rc == 0 and report["summary"]["num_ok"] == 3
    conversations = [c for c in json.loads(SHAREGPT.read_text()) if isinstance(c, dict)]
    usable = {}  # one-turn, short-reply ("Yes": 1 token) and no-value are skipped
    for c in conversations:
        if c["id"] in {"a", "b", "c", "d"}:
            turns = c.get("conversations") or c["conversation"]
            usable[turns[0]["value"]] = len(turns[1]["value"].split())
    assert len(usable) == 4
    prompts = [body["messages"][0]["content"] for body in state.bodies]
    assert len(set(prompts)) == 3 and set(prompts) <= set(usable)
    for body, record in zip(state.bodies, report["requests"], strict=True):
        prompt = body["messages"][0]["content"]
        assert body["max_tokens"] == usable[prompt] == record["output_len"]
        assert record["input_len"] == len(prompt.split())
    rc, report = run(
        base_url,
        tmp_path,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(SHAREGPT),
        "--num-requests",
        "2",
        "--sharegpt-output-len",
        "5",
        "--seed",
        "1",
    )
    assert rc == 0 and all(r["output_len"] == 5 for r in report["requests"])


def test_sharegpt_with_too_few_conversations_or_a_bad_file_fails_clearly(
    base_url, tmp_path, state, capsys
):
    args = ["--base-url", base_url, "--dataset-name", "sharegpt", "--tokenizer", "server"]
    assert main([*args, "--dataset-path", str(SHAREGPT), "--num-requests", "5"]) == 2
    assert "4 usable conversations, fewer than --num-requests 5" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    assert main([*args, "--dataset-path", str(bad)]) == 2
    assert "JSON list of conversations" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--base-url", base_url, "--dataset-name", "sharegpt"])  # no --dataset-path
    assert not state.bodies


def test_prefix_repetition_shares_each_prefix_and_varies_the_suffix(base_url, tmp_path, state):
    flags = ["--prefix-repetition-prefix-len", "20", "--prefix-repetition-suffix-len", "7"]
    flags += ["--prefix-repetition-num-prefixes", "3", "--prefix-repetition-output-len", "4"]
    rc, report = run(
        base_url, tmp_path, "--dataset-name", "prefix_repetition", *flags, "--num-requests", "12"
    )
    assert rc == 0 and report["summary"]["num_ok"] == 12
    prompts = [body["messages"][0]["content"].split() for body in state.bodies]
    prefixes = [" ".join(words[:20]) for words in prompts]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert len({" ".join(words[20:]) for words in prompts}) == 12
    assert prefixes != sorted(prefixes)  # shuffled, not grouped by prefix
    for body, record in zip(state.bodies, report["requests"], strict=True):
        assert body["max_tokens"] == record["output_len"] == 4
        assert record["input_len"] == len(body["messages"][0]["content"].split()) == 27


def test_dataset_flags_of_another_dataset_are_refused(base_url, tmp_path, state, capsys):
    args = ["--base-url", base_url, "--tokenizer", "server"]
    for argv in (
        ["--prefix-repetition-prefix-len", "5"],  # random dataset
        ["--dataset-name", "sharegpt", "--dataset-path", str(SHAREGPT)]
        + ["--prefix-repetition-num-prefixes", "2"],
        ["--dataset-name", "prefix_repetition", "--dataset-path", str(SHAREGPT)],
        ["--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "0"],
    ):
        with pytest.raises(SystemExit) as exited:
            main([*args, *argv])
        assert exited.value.code == 2
    assert "need --dataset-name prefix_repetition" in capsys.readouterr().err
    assert not state.bodies


def _user_texts(body: dict) -> list[str]:
    texts = []
    for message in body["messages"]:
        if message["role"] == "user":
            content = message["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            texts += [p["text"] for p in parts if p["type"] == "text"]
    return texts


def test_multi_turn_sends_each_turn_with_its_history(base_url, tmp_path, state):
    flags = ["--multi-turn-num-turns", "3", "--multi-turn-turn-len", "6"]
    flags += ["--multi-turn-output-len", "4", "--images-per-request", "1", "--image-size", "8x8"]
    rc, report = run(
        base_url, tmp_path, "--dataset-name", "multi_turn", *flags, "--num-requests", "6"
    )
    assert rc == 0 and report["summary"]["num_ok"] == 6
    records = sorted(report["requests"], key=lambda r: r["index"])
    assert [r["num_images"] for r in records] == [1, 0, 0, 1, 0, 0]
    assert all(r["input_len"] == 6 and r["output_len"] == 4 for r in records)
    bodies = {tuple(_user_texts(body)): body for body in state.bodies}
    assert len(bodies) == 6
    conversations = [key for key in bodies if len(key) == 3]
    assert len(conversations) == 2
    for turns in conversations:
        last = bodies[turns]["messages"]
        assert [m["role"] for m in last] == ["user", "assistant"] * 2 + ["user"]
        assert [m["content"] for m in last[1::2]] == [" tok" * 4] * 2  # the replies, as sent
        assert _image_urls({"messages": last[:1]})  # the first turn's image stays in history
        assert tuple(turns[:1]) in bodies and tuple(turns[:2]) in bodies  # earlier turns sent


def test_a_failed_turn_ends_its_conversation_unsent(base_url, tmp_path, state):
    flags = ["--multi-turn-num-turns", "2", "--multi-turn-turn-len", "3"]
    rc, report = run(
        base_url,
        tmp_path,
        "--dataset-name",
        "multi_turn",
        *flags,
        "--num-requests",
        "4",
        "--model",
        "error-event",
    )
    assert rc == 1 and report["summary"]["num_ok"] == 0
    assert len(state.bodies) == 2  # each conversation's first turn
    unsent = [r for r in report["requests"] if "turn 0 of its conversation failed" in r["error"]]
    assert sorted(r["index"] for r in unsent) == [1, 3]


def test_multi_turn_needs_whole_conversations_and_the_chat_backend(base_url, state, capsys):
    args = ["--base-url", base_url, "--tokenizer", "server", "--dataset-name", "multi_turn"]
    for argv in (
        ["--multi-turn-num-turns", "3", "--num-requests", "4"],
        ["--backend", "openai", "--num-requests", "3"],
        ["--multi-turn-turn-len", "0", "--num-requests", "3"],
    ):
        with pytest.raises(SystemExit) as exited:
            main([*args, *argv])
        assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "a multiple of --multi-turn-num-turns" in err and "use --backend openai-chat" in err
    assert "--multi-turn-turn-len must be >= 1" in err
    assert not state.bodies


TRACE = [  # (timestamp ms, input_length, output_length, hash_ids); block size 10 below
    (1000, 30, 3, [1, 2, 3]),
    (1100, 25, 2, [1, 2, 4]),
    (1050, 12, 4, [1, 9]),
    (1200, 7, 2, [5]),
]


def _write_trace(path: Path, rows=TRACE) -> Path:
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": m, "hash_ids": h})
        for t, n, m, h in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mooncake_trace_shares_blocks_by_hash_id_and_sends_at_its_timestamps(
    base_url, tmp_path, state
):
    trace = _write_trace(tmp_path / "trace.jsonl")
    flags = ["--dataset-path", str(trace), "--mooncake-block-size", "10"]
    flags += ["--mooncake-slowdown-factor", "2", "--num-requests", "4"]
    rc, report = run(base_url, tmp_path, "--dataset-name", "mooncake", *flags)
    assert rc == 0 and report["summary"]["num_ok"] == 4
    records = sorted(report["requests"], key=lambda r: r["index"])
    assert [r["input_len"] for r in records] == [30, 25, 12, 7]
    assert [r["output_len"] for r in records] == [3, 2, 4, 2]
    words = {}
    for body in state.bodies:
        text = body["messages"][0]["content"].split()
        words[len(text)] = text
    assert words[30][:20] == words[25][:20] and words[30][20:] != words[25][20:25]
    assert words[12][:10] == words[30][:10] and words[12][10:] != words[30][10:12]
    assert words[7] != words[30][:7]  # hash 5's block is not hash 1's
    # sent in timestamp order, none before its slowed-down offset from the first timestamp
    assert [r["index"] for r in sorted(records, key=lambda r: r["start_s"])] == [0, 2, 1, 3]
    for record, offset_s in zip(records, [0.0, 0.2, 0.1, 0.4], strict=True):
        assert record["start_s"] >= offset_s


def test_a_bad_mooncake_trace_or_a_request_rate_is_refused(base_url, tmp_path, state, capsys):
    args = ["--base-url", base_url, "--tokenizer", "server", "--dataset-name", "mooncake"]
    trace = _write_trace(tmp_path / "trace.jsonl")
    assert main([*args, "--dataset-path", str(trace), "--num-requests", "5"]) == 2
    assert "4 entries, fewer than --num-requests 5" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": [1]}\n{}\n')
    assert main([*args, "--dataset-path", str(bad), "--num-requests", "2"]) == 2
    assert "line 2: not a Mooncake trace entry" in capsys.readouterr().err
    for argv in (
        ["--dataset-path", str(trace), "--request-rate", "4"],
        ["--dataset-path", str(trace), "--mooncake-slowdown-factor", "0"],
        ["--mooncake-block-size", "8"],  # no --dataset-path
    ):
        with pytest.raises(SystemExit):
            main([*args, *argv])
    with pytest.raises(SystemExit):
        main(["--base-url", base_url, "--mooncake-block-size", "8"])  # random dataset
    err = capsys.readouterr().err
    assert "sends at the trace's timestamps" in err and "need --dataset-name mooncake" in err
    assert not state.bodies
