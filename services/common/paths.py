"""Files that ship inside the ``services`` package.

``BUNDLED_MODEL`` is the tiny Qwen2.5-VL checkpoint (seeded random weights, its own small
tokenizer) that every command defaults to. It is package data, found through
``importlib.resources``, so it is there in a wheel, an sdist build or an editable install
alike. Wheels always install as plain directories, so the resource is a real path that
the loaders (safetensors, tokenizers) can open.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

BUNDLED_MODEL = Path(str(files("services") / "assets" / "tiny-qwen2.5-vl"))
