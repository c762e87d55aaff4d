"""The committed tiny tokenizer/processor files are exactly what the build script writes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL_DIR

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "tiny_tokenizer.py"
TINY_DIR = TINY_MODEL_DIR
FILES = ["tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"]


def load_script():
    spec = importlib.util.spec_from_file_location("tiny_tokenizer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", FILES)
def test_build_in_process_matches_committed(tmp_path, name):
    load_script().build_tokenizer_files(tmp_path)
    assert (tmp_path / name).read_bytes() == (TINY_DIR / name).read_bytes()


def test_build_as_script_with_many_threads_matches_committed(tmp_path):
    env = {"RAYON_NUM_THREADS": "4", "PATH": "/usr/bin:/bin"}
    subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], check=True, env=env, capture_output=True
    )
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (TINY_DIR / name).read_bytes(), name


def test_vocab_layout():
    from tokenizers import Tokenizer

    tiny = load_script()
    tokenizer = Tokenizer.from_file(str(TINY_DIR / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= 2048
    assert [tokenizer.token_to_id(token) for token in tiny.SPECIAL_TOKENS] == list(
        range(len(tiny.SPECIAL_TOKENS))
    )
