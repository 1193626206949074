"""Radix tree of page-aligned token runs -> KV blocks (RadixAttention prefix caching).

Each edge is a run of whole pages (a page = `block_size` token ids); each node holds one
block per page, a lock count and a last-access time (a logical clock: it ticks once per
lock or unlock, so orderings are deterministic). Namespaces (tenants) have separate
roots and never share nodes or blocks; a namespace's root goes when its last page is evicted, so
the tree's size is bounded by the pages it caches, however many namespaces came and went.

Ownership and locking contract (the KV cache manager follows it):

- The tree holds no block references: `BlockPool` ref counts count block tables only.
  A cached block is in use while some request holds it, evictable otherwise.
- A request that holds the blocks of a tree path locks that path (`lock` counts the node and
  every ancestor), so a node's lock count equals the ref count of each of its blocks (checked),
  and an unlocked node has only unlocked descendants.
- Blocks become evictable in order tail first, so the pool's eviction queue lists every block
  after all blocks of its descendants and after the later blocks of its own node. Popping its
  head therefore always takes the last block of a least-recently-used unlocked leaf.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from llmjax.kv.block_pool import BlockPool, Page


@dataclass(eq=False, slots=True)
class Node:
    """A tree node: `pages[i]` is cached in `blocks[i]`. The root of a namespace has no pages;
    every node carries its tree's `namespace`."""

    parent: Node | None
    pages: list[Page]
    blocks: list[int]
    namespace: Hashable = None
    children: dict[Page, Node] = field(default_factory=dict)  # keyed by the child's first page
    lock_count: int = 0
    last_access: int = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a query. Valid until the tree next changes.

    `node` is the deepest node reached (None when nothing matched) and `pages_in_node` how many
    of its pages matched; `path_node` splits the node there when the match ends inside it.
    """

    blocks: tuple[int, ...]
    num_tokens: int
    node: Node | None
    pages_in_node: int


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Cumulative query statistics (not reset by `reset`) and the current number of cached blocks."""

    queries: int
    queried_tokens: int
    hits: int  # queries with at least one hit token
    hit_tokens: int
    cached_blocks: int

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried prompt tokens (0.0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class RadixCache:
    """The prefix tree over a `BlockPool`; see the module docstring for the contract."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._roots: dict[Hashable, Node] = {}
        self._node_of: list[Node | None] = [None] * pool.num_blocks
        self._clock = 0
        self._queries = self._queried_tokens = self._hits = self._hit_tokens = 0

    def match(self, tokens: Sequence[int], namespace: Hashable = None) -> PrefixMatch:
        """Longest cached page-aligned prefix of `tokens`, at most len(tokens) - 1 tokens.

        The cap keeps at least one token to compute (its logits are needed). No side effects.
        """
        return self._walk(tokens, namespace, (len(tokens) - 1) // self.block_size)

    def path_node(self, match: PrefixMatch) -> Node | None:
        """The node whose root path is exactly the matched prefix, splitting the last matched node
        where the match ends inside it (a change of shape only); None for an empty match."""
        node = match.node
        if node is not None and match.pages_in_node < len(node.pages):
            return self._split(node, match.pages_in_node)
        return node

    def lock(self, node: Node) -> None:
        """Lock the path from the root to `node` (a `path_node` or `insert` result).
        The caller holds (has a reference to) every block on the path while it is locked."""
        self._add_lock(node, 1)

    def unlock(self, node: Node) -> None:
        """Release one lock on the path ending at `node`. ValueError if it is not locked."""
        if node.lock_count <= 0:
            raise ValueError("unlock of a node that is not locked")
        self._add_lock(node, -1)

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], namespace: Hashable = None) -> tuple[Node | None, list[int]]:
        """Cache the full pages of `tokens`, held by the caller in `blocks` (block i holds page i).

        Pages already cached keep their existing (canonical) blocks. Returns the deepest node of
        the path (None when there is no full page) and the canonical block of every page; the
        caller swaps its duplicates for those, then locks the path. It must hold (ref >= 1) every
        block it passes. ValueError, with nothing changed, when a passed block is cached
        somewhere other than at its page here, when `blocks` is too short, or when its pages'
        blocks are not distinct real blocks.
        """
        num_pages = len(tokens) // self.block_size
        if len(blocks) < num_pages:
            raise ValueError(f"{num_pages} full pages but only {len(blocks)} blocks")
        self.pool.check_distinct(blocks[:num_pages])
        found = self._walk(tokens, namespace, num_pages)
        done = len(found.blocks)
        for i in range(num_pages):
            b = blocks[i]
            if self.pool.ref_count(b) <= 0:
                raise ValueError(f"block {b} is not held by the caller")
            if self.pool.is_cached(b) and (i >= done or found.blocks[i] != b):
                raise ValueError(f"block {b} is cached elsewhere: tokens disagree with the blocks' content")
        if num_pages == 0:
            return None, []
        node = self.path_node(found) or self._roots.setdefault(namespace, _root(namespace))
        if done < num_pages:
            child = Node(parent=node, pages=[self._page(tokens, i) for i in range(done, num_pages)],
                         blocks=list(blocks[done:num_pages]), namespace=namespace, last_access=node.last_access)
            node.children[child.pages[0]] = child
            for b, page in zip(child.blocks, child.pages):
                self.pool.mark_cached(b, page)
                self._node_of[b] = child
            node = child
        return node, [*found.blocks, *blocks[done:num_pages]]

    def evict(self, n: int) -> int:
        """Free up to n blocks, least recently used unlocked leaves first, a sequence's tail
        before its head. Returns how many were freed (fewer when fewer are evictable)."""
        freed = 0
        while freed < n and self.pool.num_evictable:
            b = self.pool.evict_lru()
            node = self._node_of[b]
            assert node is not None and node.parent is not None and not node.children and node.blocks[-1] == b, (
                f"eviction queue head {b} is not the tail of an unlocked leaf"
            )
            self._node_of[b] = None
            node.blocks.pop()
            page = node.pages.pop()
            if not node.pages:
                parent = node.parent
                del parent.children[page]
                if parent.parent is None and not parent.children:  # its namespace's last page
                    del self._roots[parent.namespace]
            freed += 1
        return freed

    def reset(self) -> bool:
        """Evict every unlocked block. True when the cache is now empty, False when locked
        (in-use) paths remain cached."""
        self.evict(self.pool.num_evictable)
        return not self._roots

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted query of `num_tokens` prompt tokens with `num_hit_tokens` cached."""
        self._queries += 1
        self._queried_tokens += num_tokens
        self._hits += num_hit_tokens > 0
        self._hit_tokens += num_hit_tokens

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._queried_tokens, self._hits, self._hit_tokens, self.pool.num_cached)

    def path_blocks(self, node: Node | None) -> list[int]:
        """The blocks of the path from the root to `node`, in order (empty for None)."""
        runs: list[list[int]] = []
        while node is not None and node.parent is not None:
            runs.append(node.blocks)
            node = node.parent
        return [b for run in reversed(runs) for b in run]

    def check_invariants(self) -> None:
        """Raise AssertionError when the tree disagrees with itself or with the pool."""
        pool = self.pool
        order = pool.eviction_order()
        pos = {b: i for i, b in enumerate(order)}
        num_blocks = 0
        for ns, root in self._roots.items():
            assert root.parent is None and not root.pages and root.lock_count == 0, f"bad root for {ns!r}"
            assert root.children, f"the root of {ns!r} is kept with no page cached"
            stack = [root]
            while stack:
                node = stack.pop()
                assert node.namespace == ns, f"a node of namespace {node.namespace!r} in the tree of {ns!r}"
                for key, child in node.children.items():
                    assert child.parent is node and child.pages and key == child.pages[0], "bad child link"
                    if node.parent is not None:
                        assert child.lock_count <= node.lock_count, "child locked more than its parent"
                        assert child.last_access <= node.last_access, "child accessed after its parent"
                        if node.lock_count == 0:
                            assert pos[child.blocks[0]] < pos[node.blocks[-1]], "parent evictable before its child"
                    self._check_node(child, pos)
                    num_blocks += len(child.blocks)
                    stack.append(child)
        assert num_blocks == pool.num_cached, f"{num_blocks} blocks in the tree, {pool.num_cached} cached in the pool"
        for a, b in zip(order, order[1:]):
            na, nb = self._node_of[a], self._node_of[b]
            assert na is not None and nb is not None, "evictable block outside the tree"
            assert na.last_access <= nb.last_access, "eviction queue is not least-recently-used first"

    def _check_node(self, node: Node, pos: dict[int, int]) -> None:
        assert len(node.pages) == len(node.blocks), "pages and blocks differ in length"
        assert node.lock_count >= 0, "negative lock count"
        for page, b in zip(node.pages, node.blocks):
            assert len(page) == self.block_size, "a partial page is cached"
            assert self._node_of[b] is node, f"block {b} is not mapped to its node"
            assert self.pool.content(b) == page, f"block {b} does not hold its node's tokens"
            ref = self.pool.ref_count(b)
            assert ref == node.lock_count, f"block {b}: ref count {ref} but its node's lock count {node.lock_count}"
        if node.lock_count == 0:
            assert all(b in pos for b in node.blocks), "an unlocked node's block is not evictable"
            ranks = [pos[b] for b in node.blocks]
            assert ranks == sorted(ranks, reverse=True), "a node's head is evictable before its tail"

    def _walk(self, tokens: Sequence[int], namespace: Hashable, limit: int) -> PrefixMatch:
        node = self._roots.get(namespace)
        blocks: list[int] = []
        deepest, k, i = None, 0, 0
        while node is not None and i < limit:
            child = node.children.get(self._page(tokens, i))
            if child is None:
                break
            k = 1
            while k < len(child.pages) and i + k < limit and child.pages[k] == self._page(tokens, i + k):
                k += 1
            blocks += child.blocks[:k]
            i += k
            deepest = child
            node = child if k == len(child.pages) else None
        return PrefixMatch(tuple(blocks), i * self.block_size, deepest, k)

    def _page(self, tokens: Sequence[int], i: int) -> Page:
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node` after its first k pages; the new upper node is returned, `node` keeps the rest."""
        assert node.parent is not None and 0 < k < len(node.pages)
        upper = Node(parent=node.parent, pages=node.pages[:k], blocks=node.blocks[:k], namespace=node.namespace,
                     lock_count=node.lock_count, last_access=node.last_access)
        node.parent.children[upper.pages[0]] = upper
        del node.pages[:k], node.blocks[:k]
        node.parent = upper
        upper.children[node.pages[0]] = node
        for b in upper.blocks:
            self._node_of[b] = upper
        return upper

    def _add_lock(self, node: Node, delta: int) -> None:
        self._clock += 1
        n: Node | None = node
        while n is not None and n.parent is not None:
            n.lock_count += delta
            n.last_access = self._clock
            n = n.parent


def _root(namespace: Hashable) -> Node:
    return Node(parent=None, pages=[], blocks=[], namespace=namespace)
