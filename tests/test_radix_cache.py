"""RadixCache through the manager: the len-1 cap, page alignment, splits, namespaces, LRU eviction, reset, stats."""

from __future__ import annotations

import pytest
from tests.test_kv_manager import snapshot

from llmjax.kv import BlockPool, KVCacheManager, RadixCache

BS = 4


def cached_manager(*seqs: list[int], num_blocks: int = 32, namespace=None) -> KVCacheManager:
    """A manager whose cache holds the full pages of each sequence, inserted in order."""
    m = KVCacheManager(num_blocks, BS)
    for s in seqs:
        cache(m, s, namespace)
    return m


def cache(m: KVCacheManager, seq: list[int], namespace=None) -> None:
    """Run a request over `seq` and finish it, caching its full pages."""
    m.allocate("tmp", seq, len(seq), namespace)
    m.grow("tmp", len(seq))
    m.free("tmp", seq)


def test_match_leaves_at_least_one_token_to_compute():
    m = cached_manager(list(range(8)))
    assert m.peek_prefix_len(list(range(8))) == 4  # fully cached 2 pages: only 1 may match
    assert m.peek_prefix_len(list(range(9))) == 8
    assert m.peek_prefix_len(list(range(5))) == 4
    assert m.peek_prefix_len(list(range(4))) == 0
    assert m.peek_prefix_len([0]) == 0


def test_only_whole_pages_are_cached_and_matched():
    m = cached_manager(list(range(10)))
    assert m.stats().cached_blocks == 2
    assert m.peek_prefix_len(list(range(11))) == 8
    assert m.peek_prefix_len([0, 1, 2, 3, 4, 5, 9, 9, 9]) == 4  # diverges inside the second page


def test_a_match_ending_inside_a_node_splits_it():
    m = cached_manager(list(range(13)))
    (root,) = m.prefix_cache._roots.values()
    (node,) = root.children.values()
    assert len(node.blocks) == 3
    assert m.allocate("a", list(range(8)) + [99] * 4, 100) == (8, 4)
    (upper,) = root.children.values()
    (lower,) = upper.children.values()
    assert len(upper.blocks) == 2 and len(lower.blocks) == 1
    assert upper.lock_count == 1 and lower.lock_count == 0
    m.check_invariants()


def test_sequences_diverging_after_a_shared_page_branch():
    m = cached_manager([1, 1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 3, 3, 3, 3, 0])
    (root,) = m.prefix_cache._roots.values()
    (shared,) = root.children.values()
    assert shared.pages == [(1, 1, 1, 1)] and len(shared.children) == 2
    assert m.stats().cached_blocks == 3
    m.check_invariants()


def test_namespaces_never_share():
    seq = list(range(9))
    m = cached_manager(seq)
    assert m.peek_prefix_len(seq, "tenant") == 0
    assert m.allocate("t", seq, 100, "tenant") == (0, 9)
    m.free("t", seq)
    assert m.peek_prefix_len(seq, "tenant") == 8 and m.peek_prefix_len(seq) == 8
    roots = m.prefix_cache._roots
    default, tenant = roots[None], roots["tenant"]
    assert not set(m.prefix_cache.path_blocks(next(iter(default.children.values())))) & set(
        m.prefix_cache.path_blocks(next(iter(tenant.children.values())))
    )
    m.check_invariants()


def test_a_namespace_goes_with_its_last_cached_page():
    """One-off tenants leave nothing behind once their pages are evicted: the tree is bounded by
    the pages it caches, not by how many namespaces it has seen."""
    m = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    for tenant in range(50):
        cache(m, [tenant] * 8, namespace=tenant)  # 2 pages each: evicts older tenants' pages
        m.check_invariants()
    assert set(m.prefix_cache._roots) == {48, 49} and m.stats().cached_blocks == 3
    assert m.peek_prefix_len([49] * 9, 49) == 8 and m.peek_prefix_len([48] * 9, 48) == 4
    m.prefix_cache.evict(3)
    assert not m.prefix_cache._roots
    m.check_invariants()


def test_check_invariants_catches_a_node_in_another_namespace():
    m = cached_manager(list(range(9)), namespace="a")
    cache(m, list(range(9)), namespace="b")
    m.check_invariants()
    roots = m.prefix_cache._roots
    roots["a"], roots["b"] = roots["b"], roots["a"]  # each tenant would hit the other's pages
    with pytest.raises(AssertionError, match="a node of namespace 'b' in the tree of 'a'"):
        m.check_invariants()


def test_inserting_a_cached_prefix_keeps_the_existing_blocks():
    m = KVCacheManager(32, BS)
    seq = list(range(9))
    m.allocate("a", seq, 100)
    m.allocate("b", seq, 100)  # both miss and compute the same pages
    a_blocks, b_blocks = list(m.block_table("a")), list(m.block_table("b"))
    m.free("a", seq)
    free_before = m.usage().free
    m.free("b", seq)
    assert m.usage().free == free_before + 3  # all of b's blocks: two duplicates and its partial page
    assert m.prefix_cache.path_blocks(m.prefix_cache.match(seq).node) == a_blocks[:2]
    assert not set(b_blocks) & set(m.block_pool.eviction_order())
    m.check_invariants()


def test_eviction_takes_least_recently_used_leaves_tail_first():
    p, q, r, leaf = [1] * 4, [2] * 4, [3] * 4, [4] * 4
    m = cached_manager(p + q + [0])  # t1: P -> Q
    cache(m, leaf + [0])  # t2: an unrelated leaf
    cache(m, p + r + [0])  # t3: P -> R, touches P again
    blocks = {name: m.prefix_cache.match(s + [0]).blocks[-1] for name, s in
              {"P": p, "Q": p + q, "R": p + r, "L": leaf}.items()}
    order = [blocks[k] for k in ("Q", "L", "R", "P")]
    assert m.block_pool.eviction_order() == order
    for i in range(4):
        assert m.prefix_cache.evict(1) == 1
        assert m.block_pool.eviction_order() == order[i + 1 :]
        m.check_invariants()


def test_a_sequence_loses_its_tail_before_its_head():
    seq = list(range(13))
    m = cached_manager(seq)
    m.prefix_cache.evict(1)
    assert m.peek_prefix_len(seq) == 8
    m.prefix_cache.evict(1)
    assert m.peek_prefix_len(seq) == 4
    m.check_invariants()


def test_locked_paths_are_never_evicted():
    seq = list(range(9))
    m = cached_manager(seq, [7] * 9)
    m.allocate("a", seq, 100)
    assert m.prefix_cache.evict(100) == 2  # only the other sequence's pages
    assert m.peek_prefix_len(seq) == 8 and m.peek_prefix_len([7] * 9) == 0
    m.check_invariants()


def test_reset_flushes_what_is_unlocked():
    seq = list(range(9))
    m = cached_manager(seq, [7] * 9)
    m.allocate("a", seq, 100)
    assert not m.reset_prefix_cache()
    assert m.stats().cached_blocks == 2 and m.usage().cached == 0
    m.free("a")
    assert m.reset_prefix_cache()
    assert m.stats().cached_blocks == 0 and m.usage().free == m.usage().num_blocks
    assert m.stats().queries == 3  # statistics survive a reset
    m.check_invariants()


def test_statistics_count_admitted_queries_only():
    m = KVCacheManager(6, BS)
    cache(m, list(range(9)))
    m.peek_prefix_len(list(range(9)))
    assert m.allocate("a", list(range(9)), 100) == (8, 1)
    assert m.allocate("b", [5] * 20, 100) is None  # does not fit: not counted
    assert m.allocate("b", [5] * 5, 100) == (0, 5)
    s = m.stats()
    assert (s.queries, s.queried_tokens, s.hits, s.hit_tokens, s.cached_blocks) == (3, 23, 1, 8, 2)
    assert s.hit_rate == pytest.approx(8 / 23)


def test_insert_validates_before_changing_anything():
    pool = BlockPool(8)
    tree = RadixCache(pool, BS)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError, match="only 1 blocks"):
        tree.insert(list(range(8)), blocks[:1])
    with pytest.raises(ValueError, match="not held"):
        tree.insert(list(range(8)), [blocks[0], 5])
    for bad in ([blocks[0], blocks[0]], [blocks[0], -1], [blocks[0], 8]):  # one block twice; no such block
        with pytest.raises(ValueError, match="out of range, the null block, or listed twice"):
            tree.insert(list(range(8)), bad)
    assert tree.insert([1, 2, 3], blocks) == (None, [])
    assert pool.num_cached == 0 and not tree._roots
    tree.check_invariants()


def test_a_failed_admission_leaves_the_tree_unsplit():
    m = cached_manager(list(range(13)), num_blocks=5)
    m.allocate("a", [9] * 4, 100)
    before = snapshot(m)
    assert m.allocate("b", list(range(8)) + [5] * 8, 100) is None  # would split the 3-page node
    assert snapshot(m) == before
