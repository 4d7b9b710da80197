"""The block pool and KV manager: allocation, ref counts, prefix hits, copy-on-write, LRU eviction.

The property-based test simulates the KV contents as token ids: every write puts the token into
its slot, every copy-on-write copies a block's slots, and after every operation each live
request must read back exactly its own tokens through its block table. A prefix hit on wrong
content, a write into a shared block or a lost copy all break that.
"""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from serving.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens
from serving.kv_manager import KVCacheManager


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free_blocks == 4
    q.append(blocks[2])
    assert q.popleft() is blocks[0]
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    with pytest.raises(ValueError):
        q.append(blocks[3])  # already queued
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not queued


def test_pool_refcounts_and_double_free():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert a.ref_cnt == b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([a])
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([a, b])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="double free"):
        pool.free([a])
    with pytest.raises(ValueError):
        pool.allocate(5)
    pool.check_invariants()


def test_eviction_is_least_recently_freed_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, hash_block_tokens(None, [i]))
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    (got,) = pool.allocate(1)
    assert got is blocks[1] and got.block_hash is None and pool.num_evictions == 1
    assert pool.get_cached(hash_block_tokens(None, [1])) is None
    assert pool.get_cached(hash_block_tokens(None, [0])) is blocks[0]  # still cached, still free
    pool.check_invariants()


def test_hash_chains_the_prefix():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4])
    assert hash_block_tokens(None, [1, 2]) == h1


def test_manager_prefix_hit_and_out_of_space():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    toks = list(range(10))
    hits, n = kv.get_computed_blocks("a", toks)
    assert hits == [] and n == 0
    assert kv.allocate_slots("a", 0, 10) is not None  # 3 blocks
    kv.cache_computed("a", toks, 10)  # 2 full blocks cached
    hits, n = kv.get_computed_blocks("b", toks[:8] + [99, 98])
    assert len(hits) == 2 and n == 8
    assert kv.allocate_slots("b", n, 2, hits).new_block_ids  # shares 2 blocks, adds 1
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.num_free_blocks == 2
    assert kv.allocate_slots("c", 0, 13) is None  # needs 4: nothing changes
    assert kv.num_free_blocks == 2 and "c" not in kv.req_blocks
    kv.free("a")
    assert kv.num_free_blocks == 3  # the shared two stay referenced by b
    with pytest.raises(KeyError):
        kv.free("a")
    kv.pool.check_invariants()


def test_full_prompt_hit_copies_the_block_it_rewrites():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    toks = list(range(8))
    kv.allocate_slots("a", 0, 8)
    kv.cache_computed("a", toks, 8)
    hits, n = kv.get_computed_blocks("b", toks)
    assert len(hits) == 2 and n == 7  # the last token is recomputed for its logits
    alloc = kv.allocate_slots("b", n, 1, hits)
    (src, dst), = alloc.copies
    assert src == kv.block_ids("a")[1] and dst == kv.block_ids("b")[1] and dst != src
    assert kv.block_ids("b")[0] == kv.block_ids("a")[0]
    kv.pool.check_invariants()


class PoolMachine(RuleBasedStateMachine):
    """Random requests (tokens from a tiny alphabet, so prefixes collide) over a tiny pool."""

    BS = 2

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=7, block_size=self.BS)
        self.slots: dict[int, int] = {}  # slot -> the token whose KV it holds
        self.reqs: dict[str, list[int]] = {}  # live request -> its tokens (all computed)
        self.n = 0

    def _write(self, rid: str, start: int, alloc) -> None:
        for src, dst in alloc.copies:
            for o in range(self.BS):
                if src * self.BS + o in self.slots:
                    self.slots[dst * self.BS + o] = self.slots[src * self.BS + o]
        table, toks = self.kv.block_ids(rid), self.reqs[rid]
        for p in range(start, len(toks)):
            block = self.kv.pool.blocks[table[p // self.BS]]
            assert block.ref_cnt == 1 and block.block_hash is None, f"write into shared/cached {block}"
            self.slots[table[p // self.BS] * self.BS + p % self.BS] = toks[p]
        self.kv.cache_computed(rid, toks, len(toks))

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def add(self, tokens):
        rid = f"r{self.n}"
        self.n += 1
        hits, computed = self.kv.get_computed_blocks(rid, tokens)
        alloc = self.kv.allocate_slots(rid, computed, len(tokens) - computed, hits)
        if alloc is None:
            self.kv.forget(rid)
            return
        self.reqs[rid] = list(tokens)
        self._write(rid, computed, alloc)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def grow(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        toks = self.reqs[rid]
        alloc = self.kv.allocate_slots(rid, len(toks), 1)
        if alloc is not None:
            toks.append(token)
            self._write(rid, len(toks) - 1, alloc)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.kv.forget(rid)
        del self.reqs[rid]

    @invariant()
    def pool_invariants(self):
        self.kv.pool.check_invariants()
        refs = {}
        for rid in self.reqs:
            for b in self.kv.block_ids(rid):
                refs[b] = refs.get(b, 0) + 1
        for b in self.kv.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0)

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for rid, toks in self.reqs.items():
            table = self.kv.block_ids(rid)
            assert len(table) == -(-len(toks) // self.BS)
            got = [self.slots.get(table[p // self.BS] * self.BS + p % self.BS) for p in range(len(toks))]
            assert got == toks

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self):
        # A cached block's slots must equal the tokens of any live request whose block hashes the same.
        for rid, toks in self.reqs.items():
            hashes = self.kv._hashes(rid, toks)
            for i, h in enumerate(hashes):
                block = self.kv.pool.cached.get(h)
                if block is not None:
                    stored = [self.slots.get(block.block_id * self.BS + o) for o in range(self.BS)]
                    assert stored == toks[i * self.BS:(i + 1) * self.BS]


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestPoolMachine = PoolMachine.TestCase
