"""The KV block pool: fixed-size blocks, a free queue with LRU eviction, and the prefix cache.

Follows vLLM v1 (``vllm/v1/core/block_pool.py``): a block is an id, a reference count and
(once full and computed) a hash of its tokens chained with its prefix's hash. Blocks whose
reference count drops to zero go to the *tail* of the free queue but keep their hash, so a
later request with the same prefix can take them back (a cache hit) until they reach the
*head* and are handed out again (eviction, least recently freed first):

    free queue:  head -> [b7] <-> [b2] <-> [b9] <- tail
                 (evicted first)        (freed last)

Taking a cached block back out of the middle of the queue must be O(1), hence a doubly
linked list threaded through the blocks themselves rather than a ``deque``.
"""
from __future__ import annotations

import hashlib
from array import array


class KVBlock:
    """One block of ``block_size`` token slots in every layer's K and V cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set once the block is full and cached
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head, append at the tail, remove anywhere in O(1)."""

    def __init__(self, blocks: list[KVBlock]):
        self.num_free_blocks = 0
        self._head = KVBlock(-1)  # sentinels keep the link updates branch-free
        self._tail = KVBlock(-2)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


def hash_block_tokens(parent_hash: bytes | None, token_ids) -> bytes:
    """SHA-256 of a full block's tokens chained with its prefix's hash (collisions would share KV wrongly)."""
    h = hashlib.sha256(parent_hash or b"root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """Allocates, frees, caches and evicts ``num_blocks`` blocks.

    Invariants (checked by ``check_invariants``, exercised by the property-based tests):
    a block is in the free queue iff its ref count is 0; every hash in the cache map points to
    a block carrying that hash; allocation never hands out a block with ref count > 0.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0  # cached blocks handed out again

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (free, whether or not they hold cached KV)."""
        return self.free_queue.num_free_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """``n`` blocks with ref count 1, evicting the least recently freed cached ones; raises when short."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._uncache(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each. Pass them tail-first so a request's last blocks are evicted first
        (vLLM's order: a shared prefix outlives the suffixes built on it)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise ValueError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Record that ``block`` holds the (computed) tokens hashing to ``block_hash``."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # the same content is already cached in another block; keep that one
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _uncache(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def check_invariants(self) -> None:
        in_queue = {b.block_id for b in self.free_queue}
        assert len(in_queue) == self.free_queue.num_free_blocks
        for b in self.blocks:
            assert b.ref_cnt >= 0, b
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), b
        for h, b in self.cached.items():
            assert b.block_hash == h, b
