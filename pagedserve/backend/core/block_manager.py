"""Paged KV-cache block pool: free queue, block tables, prefix caching, copy-on-write forks."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

from pagedserve.backend.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_hash,
)
from pagedserve.backend.core.multimodal import block_images_key
from pagedserve.backend.core.request import Request


class KVCacheBlock:
    """One block of `block_size` token slots; it is also its own node in the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while this block is the registered holder of that hash in the prefix cache.
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: pop, push at either end and remove are O(1).

    The head is evicted first, so the tail holds the most recently freed cached blocks (LRU).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Take the block at the head (the eviction candidate)."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue, without searching."""
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail: evicted last."""
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the head: reused first."""
        self._link(block, self._head, self._head.next_free)

    def _link(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        """Free block ids from the next to be reused to the last."""
        return [block.block_id for block in self]


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: str | None = None
) -> bytes:
    """128-bit digest chaining the parent block's digest, this block's tokens and an extra key."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash if parent_hash is not None else b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        # After a fixed-length token section, so a salt can never be mistaken for tokens.
        h.update(b"salt:" + extra_key.encode())
    return h.digest()


class BlockManager:
    """Owns every KV block: allocation, ref counts, prefix cache and copy-on-write for forks."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.block_tables: dict[str, list[int]] = {}
        self._cached: dict[bytes, KVCacheBlock] = {}
        # Per request: how many leading full blocks have been offered to the prefix cache.
        self._num_registered: dict[str, int] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # KV cache events since the last take_events(); None: not recorded (no publisher).
        self.events: list[KVEvent] | None = None

    def record_events(self) -> None:
        """Start recording what the prefix cache gains and loses (core/kv_events.py) for take_events()."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached-but-unused ones included."""
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block ids in position order (empty when it holds none)."""
        return self.block_tables.get(request_id, [])

    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (used or free)."""
        return len(self._cached)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request's tokens, never covering its last token."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks)
        hits: list[KVCacheBlock] = []
        hashes = request.block_hashes
        for i in range(max_blocks):
            block = self._cached.get(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Give the request slots for `num_new_tokens` more tokens; None (and no change) if short.

        `new_computed_blocks` are prefix-cache hits from get_computed_blocks, adopted first. Returns
        the ids of freshly allocated blocks, including the private copy made for copy-on-write.
        """
        bs = self.block_size
        table = self.block_tables.get(request.request_id)
        if table is not None and not new_computed_blocks:
            # Fast path for decodes: the held blocks already cover the new tokens and need no copy.
            start = request.num_computed_tokens
            if start + num_new_tokens <= len(table) * bs and (
                start % bs == 0 or self.blocks[table[start // bs]].ref_cnt == 1
            ):
                return []
        num_held = 0 if table is None else len(table)
        start = request.num_computed_tokens + num_new_computed_tokens
        num_required = max(0, -(-(start + num_new_tokens) // bs) - num_held - len(new_computed_blocks))
        needs_copy = (
            num_new_tokens > 0
            and start % bs != 0
            and start // bs < num_held
            and self.blocks[table[start // bs]].ref_cnt > 1
        )
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_required + needs_copy > self.free_queue.num_free - num_revived:
            return None
        if table is None:
            table = self.block_tables[request.request_id] = []
            self._num_registered[request.request_id] = len(new_computed_blocks)
        for block in new_computed_blocks:
            self._touch(block)
            table.append(block.block_id)
        new_ids = [self._allocate_block().block_id for _ in range(num_required)]
        if needs_copy:
            new_ids.append(self._copy_on_write(table, start // bs))
        table.extend(new_ids[:num_required])
        return new_ids

    def cache_full_blocks(self, request: Request) -> None:
        """Register the hashes of blocks that became full; call only once their KV is written."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_registered.get(rid, num_full)
        if num_full <= done:
            return
        self._update_block_hashes(request, num_full)
        table = self.block_tables[rid]
        stored: list[int] = []
        for i in range(done, num_full):
            block = self.blocks[table[i]]
            block_hash = request.block_hashes[i]
            # The first holder of a hash keeps it; an identical block computed in parallel stays private.
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
                stored.append(i)
        self._num_registered[rid] = num_full
        if self.events is not None and stored:
            self._record_stored(request, stored)

    def fork(self, parent: Request, child: Request) -> None:
        """Make the child share every block of the parent (ref counts +1), partial last block included."""
        table = self.block_tables.get(parent.request_id, [])
        for block_id in table:
            self.blocks[block_id].ref_cnt += 1
        self.block_tables[child.request_id] = list(table)
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)
        child.block_hashes = parent.block_hashes[: child.num_tokens // self.block_size]

    def free(self, request: Request) -> None:
        """Release the request's blocks; cached ones stay reusable until evicted, tail blocks first."""
        table = self.block_tables.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        if table is None:
            return
        if self._pending_copies:
            owned = set(table)
            self._pending_copies = [c for c in self._pending_copies if c[1] not in owned]
        self._release(table)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past those `num_tokens` tokens need (the slots of rejected draft tokens)."""
        table = self.block_tables.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if table is not None and len(table) > keep:
            self._release(table[keep:])
            del table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                # Uncached blocks are reused first so cached prefixes survive longer.
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) copies made by copy-on-write since the last call; the runner applies them."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their contents."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks of the request."""
        hashes, tokens, bs = request.block_hashes, request.all_token_ids, self.block_size
        params = request.sampling_params
        lora_id = params.lora_int_id or None
        lora_name = params.lora_name if lora_id else None
        start = 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[k - 1] + 1:
                continue
            first, last = indices[start], indices[k - 1]
            self.events.append(BlockStored(
                [external_hash(hashes[i]) for i in range(first, last + 1)],
                external_hash(hashes[first - 1]) if first else None,
                list(tokens[first * bs : (last + 1) * bs]), bs, lora_id, lora_name,
            ))
            start = k

    def _touch(self, block: KVCacheBlock) -> None:
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def _allocate_block(self) -> KVCacheBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.events is not None:
                self._record_removed(block.block_hash)
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def _record_removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):  # evictions of one allocation share an event
            last.block_hashes.append(external_hash(block_hash))
        else:
            self.events.append(BlockRemoved([external_hash(block_hash)]))

    def _copy_on_write(self, table: list[int], index: int) -> int:
        src = self.blocks[table[index]]
        dst = self._allocate_block()
        src.ref_cnt -= 1
        table[index] = dst.block_id
        self._pending_copies.append((src.block_id, dst.block_id))
        return dst.block_id

    def _update_block_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            salt = first_block_key(request) if i == 0 else None
            if request.mm_inputs:
                images = block_images_key(request.mm_inputs, i * bs, (i + 1) * bs)
                salt = salt if images is None else f"{salt or ''}|{images}"
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], salt))


def first_block_key(request: Request) -> str | None:
    """The extra key of a request's first block: its cache salt and its LoRA adapter as loaded now (name and
    load id), so no block is shared across adapters nor with an earlier load of the same name."""
    params = request.sampling_params
    if not params.lora_int_id:
        return request.cache_salt
    return f"lora:{params.lora_int_id}:{params.lora_name}:salt:{request.cache_salt or ''}"
