"""Benchmark rows, the printed table, and ``docs/benchmarks.md``."""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Row:
    section: str  # "decode", "prefill", "vit", "transfer"
    name: str
    ms: float | None  # ours
    floor_ms: float | None  # from bytes or FLOPs over the measured ceilings
    hf_ms: float | None = None  # transformers on the same config and weights
    note: str = ""

    @property
    def ratio(self) -> float | None:  # ours / floor (1.0 = at the hardware limit)
        return self.ms / self.floor_ms if self.ms and self.floor_ms else None

    @property
    def speedup(self) -> float | None:  # transformers / ours
        return self.hf_ms / self.ms if self.ms and self.hf_ms else None


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``; ``-`` when None."""
    return "-" if value is None else format(value, spec)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table's lines: ``header``, its rule, then one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


HEADER = (
    "row",
    "ours ms",
    "floor ms",
    "ours/floor",
    "floor/ours",
    "transformers ms",
    "transformers/ours",
    "note",
)


def table_lines(rows: list[Row]) -> list[str]:
    def cells(r: Row) -> tuple[str, ...]:
        efficiency = 1 / r.ratio if r.ratio else None
        return (
            f"{r.section}: {r.name}",
            fmt(r.ms, ".3f"),
            fmt(r.floor_ms, ".3f"),
            fmt(r.ratio, ".2f"),
            fmt(efficiency and 100 * efficiency, ".0f") + ("%" if efficiency else ""),
            fmt(r.hf_ms, ".3f"),
            fmt(r.speedup, ".1f") + ("x" if r.speedup else ""),
            r.note,
        )

    return markdown_table(HEADER, [cells(r) for r in rows])


def hardware() -> str:
    try:
        out = (
            subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            .stdout.strip()
            .splitlines()
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (nvidia-smi not available)"
    return f"{len(out)} x {out[0]}" + f"; {os.cpu_count()} CPU cores"


def git_commit() -> str:
    """HEAD's short hash, ``-dirty`` when tracked files differ from it (a copied working tree)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if changed else head


SECTION_TITLE = "## Engine (`python -m benchmarks.engine`)"


def write_section(path: Path, title: str, lines: list[str]) -> None:
    """Write (or replace) the section headed ``title`` in ``path``; the other sections are kept."""
    old = path.read_text() if path.is_file() else "# Benchmarks\n"
    before, found, rest = old.partition(title + "\n")
    if found:
        next_heading = rest.find("\n## ")
        after = rest[next_heading + 1 :] if next_heading >= 0 else ""
    else:
        before, after = old.rstrip("\n") + "\n\n", ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(before + "\n".join([title, "", *lines, ""]) + ("\n" + after if after else ""))


def provenance_lines(command: str) -> list[str]:
    """A section's first lines: hardware, the command that wrote it, commit and date."""
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"- hardware: {hardware()}",
        f"- command: `{command}`",
        f"- commit: {git_commit()}; date: {date}",
    ]


def command_line(module: str, argv: list[str] | None) -> str:
    """``python -m module`` with ``argv`` (None: this process's arguments), shell-quoted."""
    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


def write_run_section(
    out: str | Path, title: str, command: str, info: list[str], table: list[str], notes: list[str]
) -> None:
    """Write ``title``'s section of ``out``: provenance, ``info``, ``table`` and ``notes``;
    an empty ``out`` writes nothing."""
    if not str(out):
        return
    write_section(Path(out), title, [*provenance_lines(command), *info, "", *table, "", *notes])
    print(f"wrote {out}")


def write_markdown(path: Path, rows: list[Row], header_lines: list[str], notes: list[str]) -> None:
    """Write (or replace) the engine section of ``path``; other sections of the file are kept."""
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    write_section(
        path, SECTION_TITLE, [*header_lines, f"- date: {date}", "", *table_lines(rows), "", *notes]
    )
