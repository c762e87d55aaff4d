"""Build the tokenizer and processor files of the bundled tiny Qwen2.5-VL checkpoint.

Writes into a directory (default ``services/assets/tiny-qwen2.5-vl``, the package data):

- ``tokenizer.json``: a byte-level BPE trained on ``scripts/tiny_corpus.txt``, with the
  Qwen-style special tokens at fixed ids 0..6;
- ``tokenizer_config.json``: eos/pad tokens and the chat template, loadable by
  ``transformers.AutoTokenizer`` with the same ids as ``tokenizers.Tokenizer``;
- ``preprocessor_config.json``: the Qwen2-VL image processor (PIL backend) with small
  pixel limits, so images of the tiny model stay at 4..64 merged tokens.

The build is deterministic: training runs single-threaded on the corpus lines in file
order, and every JSON file is written with sorted keys (``tokenizer.json`` in the
library's own stable order). ``tests/test_tiny_tokenizer_reproducible.py`` rebuilds and
compares bytes with the committed files.

Usage: ``python scripts/tiny_tokenizer.py [OUT_DIR]``
"""

from __future__ import annotations

import os

# Rayon reads this when its pool starts, i.e. at the first parallel call after import.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS_PATH = REPO_ROOT / "scripts" / "tiny_corpus.txt"
DEFAULT_OUT_DIR = REPO_ROOT / "services" / "assets" / "tiny-qwen2.5-vl"  # the source tree's copy

# Fixed order: the position is the token id.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VOCAB_SIZE = 2048  # trained + special; the trainer stops earlier if it runs out of pairs
MIN_PAIR_FREQUENCY = 2
MODEL_MAX_LENGTH = 32768

# Patch and pixel geometry of the tiny model: one merged token covers 28x28 pixels.
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 64
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PIL_BICUBIC = 3

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen-style chat markup. Content is a string or a list of parts; every image part
# becomes one <|image_pad|> between vision markers (the tokenizer service expands it
# to the image's token count), every video part likewise with <|video_pad|>.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}\n"
    "{%- if content is string -%}\n"
    "{{- content -}}\n"
    "{%- elif content is iterable and content is not mapping -%}\n"
    "{%- for part in content -%}\n"
    "{%- if part.type == 'text' -%}\n"
    "{{- part.text -}}\n"
    "{%- elif part.type in ['image', 'image_url'] -%}\n"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}\n"
    "{%- elif part.type in ['video', 'video_url'] -%}\n"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}\n"
    "{%- else -%}\n"
    "{{- raise_exception('unsupported content part type: ' ~ part.type) -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- elif content is not none -%}\n"
    "{{- raise_exception('message content must be a string or a list of parts') -}}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if loop.first and message.role != 'system' -%}\n"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- '<|im_start|>' ~ message.role ~ '\\n' -}}\n"
    "{{- render_content(message.content) -}}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)


def train_tokenizer(corpus_lines: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_PAIR_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines, trainer=trainer, length=len(corpus_lines))
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= VOCAB_SIZE
    return tokenizer


def tokenizer_config() -> dict:
    added_tokens_decoder = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }


def preprocessor_config() -> dict:
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": list(CLIP_MEAN),
        "image_processor_type": "Qwen2VLImageProcessorPil",
        "image_std": list(CLIP_STD),
        "max_pixels": MAX_PIXELS,
        "merge_size": MERGE_SIZE,
        "min_pixels": MIN_PIXELS,
        "patch_size": PATCH_SIZE,
        "resample": PIL_BICUBIC,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    }


def write_json(path: Path, obj: dict) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def read_corpus(path: Path = CORPUS_PATH) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def build_tokenizer_files(out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and preprocessor_config.json into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(read_corpus())
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    write_json(out_dir / "preprocessor_config.json", preprocessor_config())


def main(argv: list[str]) -> int:
    out_dir = Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT_DIR
    build_tokenizer_files(out_dir)
    vocab_size = Tokenizer.from_file(str(out_dir / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True
    )
    print(f"wrote tokenizer and processor files to {out_dir} (vocab size {vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
