"""The router's grammar check: every grammar compiles here before its request is admitted.

Every kind of grammar (JSON schema, regex, EBNF, structural tag) compiles this way.
Compilation runs in one child process (``forkserver``), never in the router: xgrammar loads
torch and transformers, which the router does not import, and a compilation that takes longer
than ``compile_timeout_s`` is ended by killing that process, so a pathological schema costs
its own request a 400 and never holds up the next one. The child starts at the first grammar
and loads xgrammar before the clock of any compilation starts. Workers compile the same
grammar again (each keeps its own ``GrammarCache``) and so only ever see grammars that
compiled here within the bound.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequestError, UnavailableError
from services.common.types import Grammar, GrammarKind

_CACHE: Any = None  # the child's services.engine.grammar.GrammarCache
_NOUNS = {
    GrammarKind.JSON_OBJECT: "schema",
    GrammarKind.JSON_SCHEMA: "schema",
    GrammarKind.REGEX: "regex",
    GrammarKind.EBNF: "grammar",
    GrammarKind.STRUCTURAL_TAG: "structural tag",
}


def _load(model_dir: str) -> None:
    """In the child: build its cache and load xgrammar (seconds, once per child)."""
    global _CACHE
    from services.engine.grammar import GrammarCache

    _CACHE = GrammarCache(model_dir)
    _CACHE.prepare()


def _compile(grammar: Grammar) -> str | None:
    """In the child: None when ``grammar`` compiles, else why not (an exception with keyword
    arguments would not cross the process boundary intact)."""
    try:
        _CACHE.compile(grammar)
    except InvalidRequestError as exc:
        return str(exc).removeprefix("grammar: ")
    return None


class GrammarChecker:
    """Compiles grammars in a child process, one at a time, each within a time bound."""

    def __init__(self, model_dir: str | Path, compile_timeout_s: float) -> None:
        self.model_dir = str(model_dir)
        self.compile_timeout_s = compile_timeout_s
        self._pool: ProcessPoolExecutor | None = None
        self._lock = asyncio.Lock()

    async def check(self, grammar: Grammar | None, param: str) -> None:
        """``InvalidRequestError`` naming ``param`` when ``grammar`` does not compile in time."""
        if grammar is None:
            return
        async with self._lock:
            pool = await self._ready_pool()
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(self.compile_timeout_s):
                    reason = await loop.run_in_executor(pool, _compile, grammar)
            except TimeoutError:
                self._kill()
                raise InvalidRequestError(
                    f"{param}: the {_NOUNS[grammar.kind]} did not compile within "
                    f"{self.compile_timeout_s:g} s",
                    param=param,
                ) from None
            except BrokenProcessPool:
                self._kill()
                raise UnavailableError("the grammar compiler exited; try again") from None
        if reason is not None:
            raise InvalidRequestError(f"{param}: {reason}", param=param)

    async def _ready_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"))
            try:
                await asyncio.get_running_loop().run_in_executor(pool, _load, self.model_dir)
            except (BrokenProcessPool, ImportError) as exc:
                pool.shutdown(wait=False, cancel_futures=True)
                raise UnavailableError(f"the grammar compiler could not start: {exc}") from None
            self._pool = pool
        return self._pool

    def _kill(self) -> None:
        """End the child (a compilation still running in it included); the next grammar starts
        a new one."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._kill()
