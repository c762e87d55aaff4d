"""``benchmarks.sglang_client``: the command SGLang's bench_serving runs with, its result file,
its failures, the ShareGPT-format file it samples prompts from, and the table."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.gpu_monitor import GpuSummary
from benchmarks.serve_tokens import WORDS
from benchmarks.sglang_client import (
    SglangResult,
    run_sglang,
    sglang_table_lines,
    write_sharegpt_words,
)
from benchmarks.system import _parse
from tests.benchmarks.fake_monitor import RecordingMonitor

# Stands for bench_serving.py: records its arguments, appends a result line as SGLang does.
FAKE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    args = sys.argv[1:]
    value = lambda flag: args[args.index(flag) + 1]
    json.dump(args, open(value("--output-file") + ".args", "w"))
    if value("--max-concurrency") == "13":
        print("boom: no server"); sys.exit(3)
    with open(value("--output-file"), "a") as f:
        f.write(json.dumps({"completed": int(value("--num-prompts")) - 1,
                            "output_throughput": 1234.5, "mean_ttft_ms": 10.25,
                            "mean_tpot_ms": 4.5, "mean_itl_ms": 4.25,
                            "duration": 0.5}) + "\\n")
    import time; time.sleep(0.5)  # its exit after the result: not in the window
    """
)


MONITORED = GpuSummary(3, 0.9, 1980.0, 650.0, 0.0)


def fake_run(
    tmp_path: Path, concurrency: int, monitor: RecordingMonitor | None = None
) -> SglangResult:
    script = tmp_path / "bench_serving.py"
    script.write_text(FAKE_SCRIPT)
    dataset = write_sharegpt_words(tmp_path / "words.json", 2 * concurrency)
    return run_sglang(
        script,
        "http://127.0.0.1:8000/v1",
        "m",
        tmp_path / "model",
        dataset,
        concurrency,
        2 * concurrency,
        1000,
        900,
        tmp_path,
        monitor,
    )


def test_runs_the_completions_backend_on_fixed_lengths_and_reads_its_result(tmp_path):
    monitor = RecordingMonitor(MONITORED)
    before = time.monotonic()
    result = fake_run(tmp_path, 4, monitor)
    after = time.monotonic()
    assert result.client_cpu > 0.0  # the script's CPU seconds over its 0.5 s
    assert result == SglangResult(
        4, 8, 7, 1234.5, 10.25, 4.5, 4.25, 0.5, result.client_cpu, MONITORED
    )
    [(start, end)] = monitor.windows  # its own duration, ending when it wrote its result
    assert end - start == pytest.approx(0.5) and before - 0.05 < end <= after - 0.45
    args = json.loads((tmp_path / "sglang-c4.jsonl.args").read_text())
    assert args == [
        *("--backend", "sglang-oai"),
        *("--base-url", "http://127.0.0.1:8000"),  # bench_serving adds /v1/completions
        *("--model", "m", "--tokenizer", str(tmp_path / "model")),
        *("--dataset-name", "random", "--dataset-path", str(tmp_path / "words.json")),
        *("--random-input-len", "1000", "--random-output-len", "900"),
        *("--random-range-ratio", "1.0", "--num-prompts", "8", "--max-concurrency", "4"),
        *("--seed", "4", "--disable-tqdm", "--output-file", str(tmp_path / "sglang-c4.jsonl")),
    ]


def test_a_second_run_reads_its_own_result_not_an_earlier_one(tmp_path):
    fake_run(tmp_path, 4)
    assert fake_run(tmp_path, 4).completed == 7  # the file was started afresh


def test_a_failed_run_raises_with_its_output(tmp_path):
    with pytest.raises(RuntimeError, match="exited 3:\n.*boom: no server"):
        fake_run(tmp_path, 13)


def test_the_dataset_is_sharegpt_conversations_of_our_words(tmp_path):
    data = json.loads(write_sharegpt_words(tmp_path / "w.json", 1024).read_text())
    assert len(data) == 1024  # one per prompt: bench_serving sends at most one per conversation
    for item in data[:5]:
        human, gpt = item["conversations"]
        assert human["from"] == "human" and gpt["from"] == "gpt"
        assert set(human["value"].split()) <= set(WORDS)
    assert data[0] != data[1]


def test_table_puts_sglang_beside_our_client_and_the_bound():
    gpu = GpuSummary(5, 0.97, 1755.4, 689.6, 0.4)
    runs = [
        SglangResult(4, 8, 8, 900.0, 12.0, 4.0, 4.1, 10.0, 0.85, gpu, 1000.4),
        SglangResult(9, 18, 18, 50.0, 1, 2, 3, 2.0, 0.5),
    ]
    lines = sglang_table_lines(runs, {4: 800.0, 9: 40.0}, {4: 1000.0}, {4: 947.4, 9: None})
    assert lines[0].startswith("| concurrency | sglang bench_serving tok/s | our client tok/s |")
    assert lines[0].endswith("| client CPU (cores) | GPU busy | SM MHz | GPU W | clocks slowed |")
    cells = "| 4 | 900 | 800 | 1000 | 0.90 | 0.95 | 8/8 | 1000 | 12.0 | 4.00 | 4.10 | 0.85 | 0.97 |"
    assert lines[2] == cells + " 1755 | 690 | 0.40 |"
    cells = "| 9 | 50 | 40 | - | - | - | 18/18 | - | 1.0 | 2.00 | 3.00 | 0.50 | - | - | - | - |"
    assert lines[3] == cells


def test_the_flag_names_an_existing_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _parse(["--sglang-bench-serving", str(tmp_path / "missing.py")])
    assert "no such file" in capsys.readouterr().err
    script = tmp_path / "bench_serving.py"
    script.write_text("")
    assert _parse(["--sglang-bench-serving", str(script)]).sglang_bench_serving == script
