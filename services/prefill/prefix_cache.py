"""The prefill prefix cache: the leader's index of what each rank holds (a rank's pages:
``prefix_pages.py``).

Every decision is the leader's (``PrefixIndex``), made from its own state and sent in the
plan; a rank only applies it (``prefix_pages.PrefixPages``), so no rank ever decides anything from
what it holds. Pages are keyed by ``services.common.prefix_keys.page_keys``. For a plan
the leader gives each request the keys of its cached prefix (the longest run of leading
keys that every rank running the plan holds, at most up to the page before the one
holding the last prompt token, whose logits the first token needs) and the keys of the
full pages it computes that the ranks keep afterwards, and each rank its moves first
(``CacheMoves``: pages to drop, to spill into the host tier, to load back from it). One
plan runs at a time and a rank frees every page it does not keep when the plan ends, so
the leader knows each rank's free pages exactly: the pool less the pages it holds for the
cache.

Two tiers (``--host-cache-gb``): device pages, and a host-memory copy per rank that device
pages spill into when evicted; a reused page found there is copied back before the plan's
forward, inside the rank's step (a move is a copy the rank makes when the leader says, not
a queue it drains on its own). On a GPU a spill's copy to host memory runs beside the step
(``PrefixPages``, ``HostTier``). A key is in one tier at a time.

Eviction is least recently used. A use touches a prompt's keys deepest first, so a page
was always used less recently than its parent: the least recently used page a rank holds
has no child there, and evicting from the old end never orphans a cached page; spilled
pages keep that order in the host tier.

A plan that fails may leave some ranks holding what it stored, spilled or loaded and
others not: the leader forgets those keys and has every rank drop them with the next plan
(dropping a key a rank lacks does nothing). A re-formed rank group starts empty (``clear``
on both sides).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from services.prefill.messages import CacheMoves
from services.prefill.request import PrefillInput


@dataclass(frozen=True)
class CacheAsk:
    """One request of a plan as the index sees it."""

    keys: Sequence[bytes]  # page_keys of its prompt
    num_tokens: int
    can_read: bool  # False: its whole prompt is computed (prompt logprobs need every logit)
    can_store: bool  # False: nothing of it is kept (prompt embeddings replace its tokens)
    in_store: int = 0  # leading keys the shared KV store held when the leader asked

    @classmethod
    def of(cls, request: PrefillInput, in_store: int = 0) -> CacheAsk:
        """Prompt logprobs read nothing (every prompt position's logits are wanted); prompt
        embeddings neither read nor keep (the keys name token ids, not those rows)."""
        return cls(
            request.page_keys,
            request.num_tokens,
            can_read=request.params.num_prompt_logprobs < 0 and not request.prompt_embeds,
            can_store=not request.prompt_embeds,
            in_store=in_store,
        )


@dataclass(frozen=True)
class CacheUse:
    """A request's part of a plan: the pages it reuses and the computed pages ranks keep."""

    prefix_keys: tuple[bytes, ...] = ()
    store_keys: tuple[bytes, ...] = ()  # the pages right after the prefix, in order

    def num_cached_tokens(self, page_size: int) -> int:
        return len(self.prefix_keys) * page_size


class PrefixIndex:
    """The leader's record of which keys each of ``num_ranks`` ranks holds in device memory
    and in its host tier (``num_host_pages`` each; 0: none), least recently used first."""

    def __init__(
        self,
        num_ranks: int,
        num_pages: int,
        page_size: int,
        num_host_pages: int = 0,
        has_store: bool = False,
    ) -> None:
        """``has_store``: the ranks share a KV store (``kv_store.py``): plans fetch what it
        holds and one rank writes what a plan computed to it."""
        self.num_ranks, self.num_pages, self.page_size = num_ranks, num_pages, page_size
        self.num_host_pages, self.has_store = num_host_pages, has_store
        self._held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_ranks)]
        self._host: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_ranks)]
        self._to_drop: list[list[bytes]] = [[] for _ in range(num_ranks)]

    def clear(self, num_host_pages: int | None = None, has_store: bool | None = None) -> None:
        """The ranks re-formed: they hold nothing (and each has ``num_host_pages`` host pages
        and, ``has_store``, the shared KV store, when given)."""
        for tier in (*self._held, *self._host):
            tier.clear()
        for drop in self._to_drop:
            drop.clear()
        if num_host_pages is not None:
            self.num_host_pages = num_host_pages
        if has_store is not None:
            self.has_store = has_store

    def num_held(self, rank: int) -> int:
        return len(self._held[rank])

    def num_host_held(self, rank: int) -> int:
        return len(self._host[rank])

    def held(self, rank: int) -> frozenset[bytes]:
        """The keys ``rank`` holds in device memory as far as the leader knows."""
        return frozenset(self._held[rank])

    def host_held(self, rank: int) -> frozenset[bytes]:
        """The keys ``rank`` holds in its host tier as far as the leader knows."""
        return frozenset(self._host[rank])

    def match(self, keys: Sequence[bytes], ranks: Sequence[int]) -> int:
        """How many leading ``keys`` every one of ``ranks`` holds, in either tier."""
        tiers = [(self._held[r], self._host[r]) for r in ranks]
        for i, key in enumerate(keys):
            if not all(key in device or key in host for device, host in tiers):
                return i
        return len(keys)

    def reusable(self, ask: CacheAsk, ranks: Sequence[int]) -> int:
        """Pages of ``ask``'s prefix a plan on ``ranks`` would reuse: those every one of them
        holds, or as many as the shared KV store holds (fetched by the ranks that lack them)."""
        if not ask.can_read:
            return 0
        limit = (ask.num_tokens - 1) // self.page_size  # the last token's page is computed
        return max(self.match(ask.keys[:limit], ranks), min(ask.in_store, limit))

    def plan(
        self, asks: Sequence[CacheAsk], ranks: Sequence[int]
    ) -> tuple[list[CacheUse], tuple[CacheMoves, ...]]:
        """Each request's use of the cache for a plan that ``ranks`` run, and each rank's moves
        before it (every rank's, whether it runs the plan or not).

        A reused page in a rank's host tier is loaded back into a device page; the device
        pages the plan needs come from evicting what it does not reuse, least recently used
        first, into the host tier while it has room (its own least recently used pages out
        first) and freed otherwise. The plan's pages fit the pool (the scheduler checked), so
        that always makes room."""
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
        reused = dict.fromkeys(k for u in uses for k in u.prefix_keys)  # in order, once each
        num_new = sum(
            -(-a.num_tokens // self.page_size) - len(u.prefix_keys)
            for a, u in zip(asks, uses, strict=True)
        )
        spills: dict[int, list[bytes]] = {}
        loads: dict[int, list[bytes]] = {}
        fetches: dict[int, list[bytes]] = {}
        for rank in ranks:
            host = self._host[rank]
            loads[rank] = [k for k in reused if k in host]
            fetches[rank] = [k for k in reused if k not in host and k not in self._held[rank]]
            for key in loads[rank]:  # out of the host tier first: they make room there
                del host[key]
            for key in storing:  # computed again (a last token's page): the new copy stays
                if key in host:
                    del host[key]
                    self._to_drop[rank].append(key)
            num_in = len(loads[rank]) + len(fetches[rank])
            victims = self._evict(rank, self.num_pages - num_new - num_in, reused)
            recomputed = [k for k in victims if k in storing]  # the plan stores it again
            spills[rank] = self._spill(rank, [k for k in victims if k not in storing])
            self._to_drop[rank].extend(recomputed)
        puts = [  # the computed pages past what the store held
            k
            for u, a in zip(uses, asks, strict=True)
            for k in u.store_keys[max(0, a.in_store - len(u.prefix_keys)) :]
        ]
        writer = ranks[0] if self.has_store else -1  # one rank writes the computed pages
        moves = tuple(
            CacheMoves(
                tuple(self._to_drop[r]),
                tuple(spills.get(r, ())),
                tuple(loads.get(r, ())),
                tuple(fetches.get(r, ())),
                tuple(puts) if r == writer else (),
            )
            for r in range(self.num_ranks)
        )
        for drop in self._to_drop:
            drop.clear()
        for use in uses:
            path = use.prefix_keys + use.store_keys
            for rank in ranks:
                held = self._held[rank]
                for key in reversed(path):  # deepest first: a parent is used after its child
                    held[key] = None
                    held.move_to_end(key)
        return uses, moves

    def forget(self, keys: Iterable[bytes], ranks: Sequence[int]) -> None:
        """A plan on ``ranks`` failed: where ``keys`` (what it stored, spilled or loaded) are
        is not known for sure; the next plan has every one of them drop them."""
        keys = list(keys)
        for rank in ranks:
            for key in keys:
                self._held[rank].pop(key, None)
                self._host[rank].pop(key, None)
                self._to_drop[rank].append(key)

    def _evict(self, rank: int, max_held: int, keep: Mapping[bytes, None]) -> list[bytes]:
        """Take device keys of ``rank`` out, least recently used first and none of ``keep``,
        until it holds ``max_held``; they go before the plan, so their pages are free then."""
        held = self._held[rank]
        excess = len(held) - max_held
        if excess <= 0:
            return []
        victims = []
        for key in held:  # least recently used first: each has no child held here
            if key not in keep:
                victims.append(key)
                if len(victims) == excess:
                    break
        assert len(victims) == excess, "a plan's pages exceed the pool"
        for key in victims:
            del held[key]
        return victims

    def _spill(self, rank: int, victims: list[bytes]) -> list[bytes]:
        """Put ``victims`` into ``rank``'s host tier, its least recently used pages out first
        when full (dropped). The keys copied there, in order."""
        if not self.num_host_pages:
            self._to_drop[rank].extend(victims)
            return []
        host = self._host[rank]
        for key in victims:  # the device's least recently used first: their order holds
            host[key] = None
        out = list(itertools.islice(host, max(0, len(host) - self.num_host_pages)))
        for key in out:
            del host[key]
        self._to_drop[rank].extend(out)  # a victim's device page, or an older host copy
        dropped = set(out)
        return [k for k in victims if k not in dropped]
