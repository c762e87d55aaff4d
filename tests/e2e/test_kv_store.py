"""``stageserve up --kv-store-gb``: the prefix cache's third tier through the whole system.

``up`` starts a ``mooncake_master`` and prefill's rank lends the store its segment. A prompt's
pages reach the store; a longer prompt then evicts them from prefill's small device pool
(``--prefill-num-pages``), so the same prompt again reads them back from the store
(``stageserve_prefill_prefix_cache_store_hits_total``) and answers as the first time. Once
``up`` stops (SIGTERM), the master is gone with it.
"""

from __future__ import annotations

import random
import re
import secrets
import time
import urllib.request

import openai
import pytest

from services.launch_config import LaunchConfig
from services.prefill import kv_store_master
from tests.e2e.system import pid_alive, running_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _master_missing() -> str | None:
    try:
        kv_store_master.master_binary()
    except FileNotFoundError as exc:
        return str(exc)
    return None


MASTER_MISSING = _master_missing()
if MASTER_MISSING is not None:
    pytest.skip(
        f"up --kv-store-gb needs mooncake_master: {MASTER_MISSING}", allow_module_level=True
    )

PAGE = LaunchConfig.page_size
SEGMENT_GB = 0.064
PROMPT_PAGES = 20  # its last token's page is never cached: 19 pages reach the store
EVICTOR_PAGES = 30  # leaves room for 2 of the prompt's 19 cached pages in the pool
POOL_PAGES = 32
STORE_HITS = "stageserve_prefill_prefix_cache_store_hits_total"
STORE_FAILURES = "stageserve_prefill_prefix_cache_store_failures_total"
WAIT_S = 60


def token_ids(seed: str, num_pages: int) -> list[int]:
    """A prompt of ``num_pages`` full pages of ordinary token ids (no special token)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 2000) for _ in range(num_pages * PAGE)]


def master_metric(metrics_port: int, name: str) -> float:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        match = re.search(rf"^{name} (\S+)$", reply.read().decode(), re.M)
    assert match, name
    return float(match.group(1))


def test_pages_evicted_from_prefill_are_read_back_from_the_store(tmp_path) -> None:
    key = secrets.token_urlsafe(16)
    args = (
        # the store's clients listen on every interface; "=": a key may start with "-"
        *("--host", "0.0.0.0", f"--api-key={key}"),
        *("--kv-store-gb", str(SEGMENT_GB), "--prefill-num-pages", str(POOL_PAGES)),
        *("--num-pages", "256"),
    )
    with running_system(tmp_path, *args) as system:
        master = system.state["kv_store_master"]
        master_pid, metrics_port = int(master["master_pid"]), int(master["metrics_port"])
        assert master_metric(metrics_port, "master_total_capacity_bytes") == int(SEGMENT_GB * 1e9)
        client = openai.OpenAI(base_url=system.base_url, api_key=key, max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def complete(prompt: list[int]):
            return client.completions.create(
                model=model, prompt=prompt, max_tokens=4, temperature=0
            )

        prompt = token_ids("prompt", PROMPT_PAGES)
        num_stored = PROMPT_PAGES - 1
        keys_before = master_metric(metrics_port, "master_key_count")
        first = complete(prompt)
        assert first.usage.prompt_tokens == len(prompt)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        deadline_mono = time.monotonic() + WAIT_S  # the rank writes them in the background
        while master_metric(metrics_port, "master_key_count") < keys_before + num_stored:
            assert time.monotonic() < deadline_mono, "the prompt's pages never reached the store"
            time.sleep(0.2)

        # A store lookup that failed (the leader's client connects at its first one) skips the
        # store for 5 s: the prompt then runs without it, and the next try reads it.
        for attempt in range(3):
            complete(token_ids(f"evictor {attempt}", EVICTOR_PAGES))
            hits_before = system.metric("prefill", STORE_HITS)
            again = complete(prompt)
            if system.metric("prefill", STORE_HITS) > hits_before:
                break
            time.sleep(5)
        else:
            pytest.fail(
                f"no store hits; store failures: {system.metric('prefill', STORE_FAILURES)}"
            )
        hits = system.metric("prefill", STORE_HITS) - hits_before
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached == num_stored * PAGE  # device pages that survived, the rest from the store
        evicted = num_stored - (POOL_PAGES - EVICTOR_PAGES)  # at least: the evictor's room
        assert evicted * PAGE <= hits <= cached and hits % PAGE == 0
        assert again.choices[0].text == first.choices[0].text
    assert not pid_alive(master_pid)  # stopped with up, not orphaned
