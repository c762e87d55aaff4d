"""Stop strings over streamed text.

Text is fed as it is detokenized. A stop string may span several deltas, so the tail
of the text that could still become the start of a stop string is held back until the
next delta settles it. When a stop string appears, the text before it is released and
the rest (the stop string included) is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        assert all(stop), "stop strings are non-empty"
        self._stop = tuple(stop)
        self._held = ""  # received text not released yet
        self.is_stopped = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the text that is now safe to release (possibly empty)."""
        assert not self.is_stopped, "feed after a stop string matched"
        if not self._stop:
            return delta
        text = self._held + delta
        match_at = min((i for s in self._stop if (i := text.find(s)) >= 0), default=-1)
        if match_at >= 0:
            self.is_stopped = True
            self._held = ""
            return text[:match_at]
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """End of text: release what was held back (no stop string can complete now)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
