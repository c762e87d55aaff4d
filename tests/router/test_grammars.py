"""The router's grammar check: schemas compile in a child process, a bad one is a 400 naming
the field, and one slower than the bound ends its child so the next grammar gets a new one."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidRequestError
from services.common.types import Grammar, GrammarKind
from services.router.grammars import GrammarChecker
from tests.conftest import TINY_MODEL_DIR

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})


async def test_schemas_compile_in_a_child_and_a_slow_one_ends_it():
    checker = GrammarChecker(TINY_MODEL_DIR, compile_timeout_s=60.0)
    try:
        await checker.check(None, "response_format")  # no grammar: nothing starts
        assert checker._pool is None
        await checker.check(Grammar(GrammarKind.JSON_SCHEMA, SCHEMA), "response_format")
        await checker.check(Grammar(GrammarKind.JSON_OBJECT), "response_format")
        first = checker._pool
        bad = Grammar(GrammarKind.JSON_SCHEMA, json.dumps({"type": "no-such-type"}))
        with pytest.raises(InvalidRequestError) as caught:
            await checker.check(bad, "response_format")
        assert caught.value.param == "response_format"
        assert "cannot be compiled" in caught.value.message
        assert checker._pool is first  # a refused schema keeps the child
        checker.compile_timeout_s = 1e-6
        other = Grammar(GrammarKind.JSON_SCHEMA, json.dumps({"type": "array"}))
        with pytest.raises(InvalidRequestError, match="did not compile within"):
            await checker.check(other, "response_format")
        assert checker._pool is None  # the child was killed
        checker.compile_timeout_s = 60.0
        await checker.check(other, "response_format")  # a new child
        assert checker._pool is not None and checker._pool is not first
    finally:
        checker.close()
