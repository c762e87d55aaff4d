"""One system per layout (``stageserve up`` on the bundled tiny model) serves every test in
this package, through the official ``openai`` client and plain HTTP.

Tests run layout by layout; within one, modules run in name order, so
``test_zz_kv_pages.py`` checks last that no KV page was lost over all of them.
"""

from __future__ import annotations

import pytest

from services.common.paths import BUNDLED_MODEL
from services.engine.grammar import GrammarCache
from tests.e2e.openai_api.helpers import decode_stats
from tests.e2e.system import openai_client, running_system

# dp2: decode as two DP rank processes behind two router processes sharing the port;
# cp2: prefill as two CP rank processes, every batch sharded (--prefill-cp-min-tokens 1);
# encoder2: the vision encoder as two rank processes
LAYOUTS = {
    "dp2": ("--decode-dp", "2", "--router-workers", "2"),
    "cp2": ("--prefill-cp", "2", "--prefill-cp-min-tokens", "1"),
    "encoder2": ("--encoder-ranks", "2"),
}


@pytest.fixture(scope="package", params=list(LAYOUTS))
def system(request, tmp_path_factory):
    args = LAYOUTS[request.param]
    with running_system(tmp_path_factory.mktemp("system"), "--num-pages", "1024", *args) as system:
        yield system


@pytest.fixture(scope="package")
def client(system):
    return openai_client(system)


@pytest.fixture(scope="package")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="package")
def initial_free_pages(system):
    return decode_stats(system).num_free_pages


@pytest.fixture(scope="package")
def grammar_cache():
    return GrammarCache(BUNDLED_MODEL)
