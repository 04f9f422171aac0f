"""Block pool behaviour on an 11-block pool of 4-token blocks: exact ids and exact free-queue order."""

from __future__ import annotations

from pagedserve.backend.core.block_manager import (
    BlockManager,
    FreeBlockQueue,
    KVCacheBlock,
)
from pagedserve.backend.core.request import Request

BS = 4


def req(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, tokens, cache_salt=cache_salt)


def compute(bm: BlockManager, request: Request, num_tokens: int | None = None) -> list[int]:
    """Allocate and 'run' the request's uncomputed tokens, as the scheduler would, caching full blocks."""
    hits, num_hit = bm.get_computed_blocks(request) if request.num_computed_tokens == 0 else ([], 0)
    todo = (request.num_tokens if num_tokens is None else num_tokens) - request.num_computed_tokens - num_hit
    new = bm.allocate_slots(request, todo, hits, num_hit)
    assert new is not None
    request.num_computed_tokens += num_hit + todo
    bm.cache_full_blocks(request)
    return new


def test_free_queue_pops_appends_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert queue.block_ids() == [2, 1, 3, 4, 0]
    assert queue.num_free == 5


def test_allocation_takes_blocks_in_free_queue_order():
    bm = BlockManager(11, BS)
    a, b = req("a", list(range(10))), req("b", [7, 7, 7])
    assert compute(bm, a) == [0, 1, 2]
    assert compute(bm, b) == [3]
    assert bm.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10]
    assert bm.get_block_table("a") == [0, 1, 2]


def test_freed_uncached_blocks_are_reused_first_in_table_order():
    bm = BlockManager(11, BS, enable_prefix_caching=False)
    a, b = req("a", list(range(10))), req("b", [1])
    compute(bm, a)
    compute(bm, b)
    bm.free(a)
    assert bm.free_queue.block_ids() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert compute(bm, req("c", [9] * 5)) == [0, 1]


def test_freed_cached_blocks_go_to_the_tail_last_block_first():
    bm = BlockManager(11, BS)
    a = req("a", list(range(13)))  # 3 full blocks and one partial
    compute(bm, a)
    bm.free(a)
    # The partial block has no hash and is reused first; the prefix's first block is evicted last.
    assert bm.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1, 0]
    assert bm.num_cached_blocks() == 3


def test_eviction_is_least_recently_used_and_breaks_the_chain():
    bm = BlockManager(11, BS)
    a = req("a", list(range(13)))
    compute(bm, a)
    bm.free(a)
    b = req("b", [100 + i for i in range(36)])  # 9 blocks: 3..10 then evicts block 2
    assert compute(bm, b) == [3, 4, 5, 6, 7, 8, 9, 10, 2]
    assert bm.free_queue.block_ids() == [1, 0]
    c = req("c", list(range(13)))
    hits, num_hit = bm.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8


def test_prefix_hit_on_a_free_block_takes_it_out_of_the_queue():
    bm = BlockManager(11, BS)
    a = req("a", list(range(13)))
    compute(bm, a)
    bm.free(a)
    c = req("c", list(range(12)) + [99])
    hits, num_hit = bm.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [0, 1, 2] and num_hit == 12
    assert bm.allocate_slots(c, 1, hits, num_hit) == [3]
    assert bm.get_block_table("c") == [0, 1, 2, 3]
    assert bm.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10]
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 1]


def test_hit_on_a_block_in_use_raises_its_ref_count():
    bm = BlockManager(11, BS)
    a = req("a", list(range(9)))
    compute(bm, a)
    b = req("b", list(range(8)) + [50, 51])
    assert compute(bm, b) == [3]
    assert bm.get_block_table("b") == [0, 1, 3]
    assert bm.blocks[0].ref_cnt == 2 and bm.blocks[1].ref_cnt == 2
    bm.free(a)
    assert bm.blocks[0].ref_cnt == 1
    assert bm.free_queue.block_ids() == [2, 4, 5, 6, 7, 8, 9, 10]


def test_hit_never_covers_the_last_prompt_token():
    bm = BlockManager(11, BS)
    compute(bm, req("a", list(range(8))))
    hits, num_hit = bm.get_computed_blocks(req("b", list(range(8))))
    assert [blk.block_id for blk in hits] == [0] and num_hit == 4


def test_block_differing_in_its_last_token_is_not_hit():
    bm = BlockManager(11, BS)
    compute(bm, req("a", list(range(13))))
    tokens = list(range(13))
    tokens[7] = 77
    hits, num_hit = bm.get_computed_blocks(req("b", tokens))
    assert [blk.block_id for blk in hits] == [0] and num_hit == 4


def test_cache_salt_keeps_equal_prompts_apart():
    bm = BlockManager(11, BS)
    compute(bm, req("a", list(range(9)), cache_salt="alice"))
    assert bm.get_computed_blocks(req("b", list(range(9)), cache_salt="bob"))[1] == 0
    assert bm.get_computed_blocks(req("c", list(range(9))))[1] == 0
    assert bm.get_computed_blocks(req("d", list(range(9)), cache_salt="alice"))[1] == 8


def test_hash_is_registered_only_once_the_kv_is_computed():
    bm = BlockManager(11, BS)
    a = req("a", list(range(9)))
    assert bm.allocate_slots(a, 9) == [0, 1, 2]
    bm.cache_full_blocks(a)
    assert bm.get_computed_blocks(req("b", list(range(9))))[1] == 0
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    assert bm.get_computed_blocks(req("c", list(range(9))))[1] == 4


def test_identical_blocks_computed_side_by_side_stay_private_to_the_second():
    bm = BlockManager(11, BS)
    a, b = req("a", list(range(5))), req("b", list(range(5)))
    assert bm.allocate_slots(a, 5) == [0, 1]
    assert bm.allocate_slots(b, 5) == [2, 3]
    a.num_computed_tokens = b.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    bm.free(b)
    bm.free(a)
    # b's duplicate of block 0 is uncached, so it is reused before a's cached block.
    assert bm.free_queue.block_ids() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0]


def test_disabled_caching_never_hits_and_reset_forgets_every_hash():
    off = BlockManager(11, BS, enable_prefix_caching=False)
    compute(off, req("a", list(range(9))))
    assert off.get_computed_blocks(req("b", list(range(9))))[1] == 0
    on = BlockManager(11, BS)
    compute(on, req("a", list(range(9))))
    on.reset_prefix_cache()
    assert on.get_computed_blocks(req("b", list(range(9))))[1] == 0
    assert on.num_cached_blocks() == 0


def test_allocate_returns_none_and_changes_nothing_when_the_pool_is_short():
    bm = BlockManager(11, BS)
    compute(bm, req("a", list(range(36))))  # 9 blocks
    b = req("b", list(range(100, 112)))
    assert bm.allocate_slots(b, 12) is None
    assert bm.get_block_table("b") == [] and bm.num_free_blocks == 2
    assert bm.allocate_slots(b, 8) == [9, 10]


def test_evictable_hits_count_against_the_free_blocks_they_occupy():
    bm = BlockManager(11, BS)
    a = req("a", list(range(13)))
    compute(bm, a)
    bm.free(a)
    compute(bm, req("x", [100 + i for i in range(28)]))  # 7 blocks: 3..9, leaving 10, 2, 1, 0
    c = req("c", list(range(12)) + [99] * 8)
    hits, num_hit = bm.get_computed_blocks(c)
    assert num_hit == 12
    # The 3 hit blocks sit in the free queue: only block 10 is left for the 2 new blocks needed.
    assert bm.allocate_slots(c, 8, hits, num_hit) is None
    assert bm.free_queue.block_ids() == [10, 2, 1, 0]


def test_fork_shares_every_block_and_copies_the_partial_one_on_first_write():
    bm = BlockManager(11, BS)
    parent = req("p", list(range(6)))
    compute(bm, parent)
    assert bm.get_block_table("p") == [0, 1]
    parent.append_output_token_id(30)
    child = req("c", list(range(6)))
    bm.fork(parent, child)
    child.num_computed_tokens = 6
    child.append_output_token_id(31)
    assert bm.get_block_table("c") == [0, 1]
    assert bm.blocks[1].ref_cnt == 2
    assert bm.allocate_slots(parent, 1) == [2]
    assert bm.get_block_table("p") == [0, 2]
    assert bm.take_block_copies() == [(1, 2)]
    # The child is now the only holder of block 1: it writes in place, without a copy.
    assert bm.allocate_slots(child, 1) == []
    assert bm.take_block_copies() == []
    assert bm.blocks[0].ref_cnt == 2 and bm.blocks[1].ref_cnt == 1 and bm.blocks[2].ref_cnt == 1


def forked(num_tokens: int) -> tuple[BlockManager, Request, Request]:
    """A pool holding request "p" with `num_tokens` computed, and "c" forked from it (sharing its blocks)."""
    bm = BlockManager(11, BS)
    parent = req("p", list(range(num_tokens)))
    compute(bm, parent)
    child = req("c", list(range(num_tokens)))
    bm.fork(parent, child)
    return bm, parent, child


def test_fork_at_a_block_boundary_needs_no_copy():
    bm, parent, child = forked(8)
    child.num_computed_tokens = 8
    parent.append_output_token_id(1)
    child.append_output_token_id(2)
    assert bm.allocate_slots(parent, 1) == [2]
    assert bm.allocate_slots(child, 1) == [3]
    assert bm.take_block_copies() == []


def test_freeing_a_copy_target_before_the_step_drops_the_pending_copy():
    bm, parent, _ = forked(6)
    parent.append_output_token_id(3)
    assert bm.allocate_slots(parent, 1) == [2]
    bm.free(parent)
    assert bm.take_block_copies() == []
    assert bm.free_queue.num_free + sum(b.ref_cnt > 0 for b in bm.blocks) == 11
