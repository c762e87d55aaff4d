"""The prefill prefix cache: the leader's index of what each rank holds, and a rank's pages.

Every decision is the leader's (``PrefixIndex``), made from its own state and sent in the
plan; a rank only applies it (``PrefixPages``), so no rank ever decides anything from
what it holds. Pages are keyed by ``services.common.prefix_keys.page_keys``. For a plan
the leader gives each request the keys of its cached prefix (the longest run of leading
keys that every rank running the plan holds, at most up to the page before the one
holding the last prompt token, whose logits the first token needs) and the keys of the
full pages it computes that the ranks keep afterwards, and each rank the keys it drops
first. One plan runs at a time and a rank frees every page it does not keep when the
plan ends, so the leader knows each rank's free pages exactly: the pool less the pages
it holds for the cache.

Eviction is least recently used. A use touches a prompt's keys deepest first, so a page
was always used less recently than its parent: the least recently used page a rank holds
has no child there, and evicting from the old end never orphans a cached page.

A plan that fails may leave some ranks holding what it stored and others not: the
leader forgets those keys and has every rank drop them with the next plan (dropping a key
a rank lacks does nothing). A re-formed rank group starts empty (``clear`` on both sides).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.engine.kv_cache import RequestPageTable
from services.prefill.request import PrefillInput


@dataclass(frozen=True)
class CacheAsk:
    """One request of a plan as the index sees it."""

    keys: Sequence[bytes]  # page_keys of its prompt
    num_tokens: int
    can_read: bool  # False: its whole prompt is computed (prompt logprobs need every logit)
    can_store: bool  # False: nothing of it is kept (prompt embeddings replace its tokens)

    @classmethod
    def of(cls, request: PrefillInput) -> CacheAsk:
        """Prompt logprobs read nothing (every prompt position's logits are wanted); prompt
        embeddings neither read nor keep (the keys name token ids, not those rows)."""
        return cls(
            request.page_keys,
            request.num_tokens,
            can_read=request.params.num_prompt_logprobs < 0 and not request.prompt_embeds,
            can_store=not request.prompt_embeds,
        )


@dataclass(frozen=True)
class CacheUse:
    """A request's part of a plan: the pages it reuses and the computed pages ranks keep."""

    prefix_keys: tuple[bytes, ...] = ()
    store_keys: tuple[bytes, ...] = ()  # the pages right after the prefix, in order

    def num_cached_tokens(self, page_size: int) -> int:
        return len(self.prefix_keys) * page_size


class PrefixIndex:
    """The leader's record of which keys each of ``num_ranks`` ranks holds, LRU first."""

    def __init__(self, num_ranks: int, num_pages: int, page_size: int) -> None:
        self.num_ranks, self.num_pages, self.page_size = num_ranks, num_pages, page_size
        self._held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_ranks)]
        self._to_drop: list[list[bytes]] = [[] for _ in range(num_ranks)]

    def clear(self) -> None:
        """The ranks re-formed: they hold nothing."""
        for held in self._held:
            held.clear()
        for drop in self._to_drop:
            drop.clear()

    def num_held(self, rank: int) -> int:
        return len(self._held[rank])

    def held(self, rank: int) -> frozenset[bytes]:
        """The keys ``rank`` holds as far as the leader knows."""
        return frozenset(self._held[rank])

    def match(self, keys: Sequence[bytes], ranks: Sequence[int]) -> int:
        """How many leading ``keys`` every one of ``ranks`` holds."""
        held = [self._held[r] for r in ranks]
        for i, key in enumerate(keys):
            if not all(key in h for h in held):
                return i
        return len(keys)

    def reusable(self, ask: CacheAsk, ranks: Sequence[int]) -> int:
        """Pages of ``ask``'s prefix a plan on ``ranks`` would reuse."""
        if not ask.can_read:
            return 0
        limit = (ask.num_tokens - 1) // self.page_size  # the last token's page is computed
        return self.match(ask.keys[:limit], ranks)

    def plan(
        self, asks: Sequence[CacheAsk], ranks: Sequence[int]
    ) -> tuple[list[CacheUse], tuple[tuple[bytes, ...], ...]]:
        """Each request's use of the cache for a plan that ``ranks`` run, and the keys each
        rank drops before it (every rank's, whether it runs the plan or not).

        The plan's pages fit the pool (the scheduler checked), so evicting what the plan
        does not reuse always makes room."""
        uses: list[CacheUse] = []
        storing: set[bytes] = set()
        for ask in asks:
            hit = self.reusable(ask, ranks)
            stored: list[bytes] = []
            if ask.can_store:
                for key in ask.keys[hit:]:
                    if key in storing:  # an earlier request of this plan computes it
                        break
                    stored.append(key)
                storing.update(stored)
            uses.append(CacheUse(tuple(ask.keys[:hit]), tuple(stored)))
        reused = {k for u in uses for k in u.prefix_keys}
        num_new = sum(
            -(-a.num_tokens // self.page_size) - len(u.prefix_keys)
            for a, u in zip(asks, uses, strict=True)
        )
        for rank in ranks:
            self._evict(rank, self.num_pages - num_new, reused)
        drops = tuple(tuple(d) for d in self._to_drop)
        for drop in self._to_drop:
            drop.clear()
        for use in uses:
            path = use.prefix_keys + use.store_keys
            for rank in ranks:
                held = self._held[rank]
                for key in reversed(path):  # deepest first: a parent is used after its child
                    held[key] = None
                    held.move_to_end(key)
        return uses, drops

    def forget(self, stored: Iterable[Sequence[bytes]], ranks: Sequence[int]) -> None:
        """A plan on ``ranks`` failed: what it stored (each request's ``store_keys``) may be
        held by some of them; the next plan has them drop it."""
        for keys in stored:
            for rank in ranks:
                for key in keys:
                    self._held[rank].pop(key, None)
                    self._to_drop[rank].append(key)

    def _evict(self, rank: int, max_held: int, keep: set[bytes]) -> None:
        held = self._held[rank]  # what it drops goes before the plan: that is free then
        excess = len(held) - max_held
        if excess <= 0:
            return
        victims = []
        for key in held:  # least recently used first: each has no child held here
            if key not in keep:
                victims.append(key)
                if len(victims) == excess:
                    break
        assert len(victims) == excess, "a plan's pages exceed the pool"
        for key in victims:
            del held[key]
        self._to_drop[rank].extend(victims)


class PrefixPages:
    """A rank's cached pages by key; what it keeps and drops is the leader's word."""

    def __init__(self, table: RequestPageTable) -> None:
        self.table = table
        self._pages: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def keys(self) -> frozenset[bytes]:
        return frozenset(self._pages)

    def clear(self) -> None:
        self.drop(list(self._pages))

    def drop(self, keys: Sequence[bytes]) -> None:
        pages = [p for p in (self._pages.pop(k, None) for k in keys) if p is not None]
        self.table.manager.free(pages)

    def lend(self, request_id: str, prefix_keys: Sequence[bytes], num_tokens: int) -> None:
        """Give ``request_id`` the prefix's pages, then new pages up to ``num_tokens``."""
        self.table.adopt(request_id, [self._pages[k] for k in prefix_keys])
        self.table.reserve(request_id, num_tokens)

    def settle(
        self,
        request_id: str,
        prefix_keys: Sequence[bytes],
        store_keys: Sequence[bytes],
        computed: bool,
    ) -> None:
        """The plan ended: keep ``store_keys``' pages when ``computed`` (their KV is whole),
        free the rest of what ``request_id`` got beyond its prefix."""
        pages = self.table.detach(request_id)[len(prefix_keys) :]
        kept: set[int] = set()
        if computed:
            for key, page in zip(store_keys, pages, strict=False):
                if key not in self._pages:  # a copy computed again (the last page) goes
                    self._pages[key] = page
                    kept.add(page)
        self.table.manager.free([p for p in pages if p not in kept])
