"""The request-facing KV manager: block tables, prefix hits, slot allocation, copy-on-write.

Like vLLM v1's ``KVCacheManager``: the scheduler asks ``allocate_slots`` for room for a
request's next tokens and gets ``None`` when the pool is short (it then preempts someone);
misuse (unknown request, freeing twice) raises. One block table per request, keyed by
``request_id``; block ``i`` of a request holds its tokens ``[i*block_size, (i+1)*block_size)``.

Copy-on-write: a block that is shared (ref count > 1) or cached (a prefix others may hit)
is never written. When a request must write into one (it matched a prompt entirely from
the cache and recomputes the last token for its logits), the block is copied into a fresh
one first; the copies are returned for the cache to apply before the forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from serving.block_pool import BlockPool, KVBlock, hash_block_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Allocation:
    """What ``allocate_slots`` did: the request's new blocks and the (src, dst) block copies to apply."""

    new_block_ids: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}  # hashes of the request's full blocks so far
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def max_tokens(self) -> int:
        """The most tokens one request can ever hold."""
        return self.pool.num_blocks * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks(request_id)]

    def _blocks(self, request_id: str) -> list[KVBlock]:
        if request_id not in self.req_blocks:
            raise KeyError(f"request {request_id!r} holds no blocks")
        return self.req_blocks[request_id]

    def _hashes(self, request_id: str, token_ids: list[int]) -> list[bytes]:
        hashes = self.req_hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request_id: str, token_ids: list[int]) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks that prefixes ``token_ids``, and how many tokens
        need no compute. At least the last token is always recomputed: its logits are needed."""
        if request_id in self.req_blocks:
            raise ValueError(f"request {request_id!r} already holds blocks")
        hits: list[KVBlock] = []
        if self.pool.enable_caching:
            for h in self._hashes(request_id, token_ids):
                block = self.pool.get_cached(h)
                if block is None:
                    break
                hits.append(block)
        return hits, min(len(hits) * self.block_size, len(token_ids) - 1)

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> Allocation | None:
        """Make room for tokens ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.

        ``computed_blocks`` are a new request's prefix hits (from ``get_computed_blocks``).
        Returns ``None``, changing nothing, when the pool cannot supply the blocks.
        """
        blocks = self.req_blocks.get(request_id, [])
        hits = list(computed_blocks or [])
        if blocks and hits:
            raise ValueError(f"request {request_id!r} already holds blocks; prefix hits are for new requests")
        table = blocks + hits
        bs = self.block_size
        end = num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, cdiv(end, bs) - len(table))
        first_write, last_write = num_computed_tokens // bs, min(cdiv(end, bs), len(table))
        hit_ids = {id(b) for b in hits}
        to_copy = [i for i in range(first_write, last_write)
                   if table[i].block_hash is not None or table[i].ref_cnt + (id(table[i]) in hit_ids) > 1]
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)  # hits sitting in the free queue
        if num_new_blocks + len(to_copy) + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(hits)
        table = list(table)
        result = Allocation()
        for i in to_copy:
            (dst,) = self.pool.allocate(1)
            result.copies.append((table[i].block_id, dst.block_id))
            self.pool.free([table[i]])
            table[i] = dst
        new = self.pool.allocate(num_new_blocks)
        table.extend(new)
        result.new_block_ids = [b.block_id for b in new]
        self.req_blocks[request_id] = table
        # Leading blocks already in the prefix cache; a copied block is fresh, so it is not.
        num_cached = max(self.num_cached_blocks.get(request_id, 0), len(hits))
        self.num_cached_blocks[request_id] = min(num_cached, to_copy[0]) if to_copy else num_cached
        return result

    def cache_computed(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """After a step: cache the request's blocks that are now full of computed tokens."""
        if not self.pool.enable_caching:
            return
        blocks = self._blocks(request_id)
        hashes = self._hashes(request_id, token_ids[:num_computed_tokens])
        n_full = num_computed_tokens // self.block_size
        for i in range(self.num_cached_blocks.get(request_id, 0), n_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request_id] = max(self.num_cached_blocks.get(request_id, 0), n_full)

    def free(self, request_id: str) -> None:
        """Release a finished, aborted or preempted request's blocks (tail first: evicted first)."""
        blocks = self._blocks(request_id)
        self.pool.free(list(reversed(blocks)))
        del self.req_blocks[request_id]
        self.num_cached_blocks.pop(request_id, None)
        # Hashes depend only on the tokens, so a preempted request keeps them for its resumption.

    def forget(self, request_id: str) -> None:
        """Drop what is kept about a request that will not come back."""
        if request_id in self.req_blocks:
            self.free(request_id)
        self.req_hashes.pop(request_id, None)
