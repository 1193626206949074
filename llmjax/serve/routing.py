"""Routing policies: which replica serves a request. Pure Python, no I/O, no clock.

The same objects drive the HTTP router (`llmjax/serve/router.py`) and the simulated cluster
(`experiments/routing.py`). A policy sees a request's text, its tenant (`cache_salt`, or None) and
the load of each candidate worker (requests in flight through the router, on the healthy workers
only), and returns a `Decision`: the worker and why.

- `round_robin`: the candidates in turn.
- `least_load`: the candidate with the fewest requests in flight (ties: the earlier worker).
- `cache_aware` (SGLang router's rule): each worker has an `ApproxRadixTree` of the keys
  (`routing_key`: tenant, then text) recently sent to it (characters, not tokens: no tokenizer
  needed). If the load is imbalanced, `max - min > balance_abs_threshold` and
  `max > balance_rel_threshold * min`, the least-loaded worker gets the request. Otherwise the
  worker whose tree shares the longest prefix with the key gets it if the text it matches (the
  tenant's prefix not counted: alone it matches nothing) is more than `cache_threshold` of the
  text; else the least-loaded worker (ties: the smaller tree, then the earlier worker). SGLang
  sends that last case to the smallest tree instead; least load spreads new prefix families over
  idle replicas first. Every decision, imbalanced ones included, inserts the key into the chosen
  worker's tree at once (so a burst of one prefix family sticks together before any answer);
  `retract(decision)` takes it out again when that worker did not serve the request. Once a
  worker has served a request, `remember(worker, text)` stores the text its cache now holds past
  the prompt (the router's: the prompt followed by the answer), so a conversation's next turn,
  which repeats the answer, matches the whole of it; SGLang's router stores the request's text
  only, and a long answer then pulls the next turn under the threshold.

Not thread-safe: one owner calls a policy (the router's event loop, or the simulation driver).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from llmjax.cli_types import UsageError, fraction, non_negative_int, positive_int, positive_number, positive_seconds

Worker = Hashable

# SGLang router's original defaults (sglang_router's RouterArgs and CacheAwareConfig; its tree limit
# counts characters per worker). Later releases raised them to cache_threshold 0.3,
# balance_abs_threshold 64, balance_rel_threshold 1.5 and max_tree_size 2**26.
DEFAULT_CACHE_THRESHOLD = 0.5
DEFAULT_BALANCE_ABS_THRESHOLD = 32
DEFAULT_BALANCE_REL_THRESHOLD = 1.0001
DEFAULT_MAX_TREE_CHARS = 2**24
# The longest silence allowed of a worker (the router's `request_timeout`). A non-streamed request
# is silent until its whole completion is made, which on a loaded CPU replica can take minutes, so
# the default is sglang-router's 30 minutes (there for the whole request).
DEFAULT_REQUEST_TIMEOUT = 1800.0
# the router's /health checks of its workers: every 10 s, 5 s each, a worker out after 3 failures in a row
DEFAULT_HEALTH_CHECK_INTERVAL, DEFAULT_HEALTH_CHECK_TIMEOUT, DEFAULT_HEALTH_FAILURE_THRESHOLD = 10.0, 5.0, 3
POLICIES = ("cache_aware", "round_robin", "least_load")


def routing_key(text: str, tenant: str | None = None) -> str:
    """The key `CacheAware` stores a request under: a prefix naming its tenant (`cache_salt`), then
    the request's text. The prefix is `len:tenant` and a NUL for a tenant, a NUL alone for none:
    no prefix is the start of another (a length says where its tenant ends, and a digit is no NUL),
    so no text, NULs and all, matches past its own prefix into another tenant's keys."""
    return f"{len(tenant)}:{tenant}\x00{text}" if tenant else f"\x00{text}"


class _Node:
    __slots__ = ("edge", "parent", "children", "last_access", "ends")

    def __init__(self, edge: str, parent: _Node | None, last_access: int):
        self.edge = edge
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of the child's edge -> child
        self.last_access = last_access
        self.ends = 0  # inserts not undone whose key ends here


class Insertion:
    """One `ApproxRadixTree.insert`, to be undone at most once (`undo`)."""

    __slots__ = ("tree", "node", "undone")

    def __init__(self, tree: ApproxRadixTree, node: _Node):
        self.tree, self.node, self.undone = tree, node, False

    def undo(self) -> None:
        """Take the key out of the tree again, as if never inserted, except for the LRU refresh of
        its path: the nodes no other stored key ends at or passes through go. A no-op for what was
        evicted meanwhile: a prefix the evicted key shared with other keys stays even when those
        are undone too (a leaf's eviction leaves no record of the keys that passed through its
        parent; the prefix goes when evicted in turn). ValueError when undone already."""
        if self.undone:
            raise ValueError("this insertion was undone already")
        self.undone = True
        self.tree._undo(self.node)


def _common_prefix_len(text: str, start: int, edge: str) -> int:
    if text.startswith(edge, start):
        return len(edge)
    n = 0
    for a, b in zip(edge, text[start:start + len(edge)]):
        if a != b:
            break
        n += 1
    return n


class ApproxRadixTree:
    """The keys recently routed to one worker: a character radix tree of at most `max_chars`
    characters (edge lengths summed) plus the key inserted last. `insert` first evicts the least
    recently inserted leaves, whole edges at a time, until the tree is within `max_chars`, then
    stores its key and refreshes the key's path: eviction waits for the next insert, so a key
    undone meanwhile (a request its worker refused) has evicted nothing. It stands for the
    worker's prefix cache without asking it (hence approximate).

    Memory: the bound counts characters; Python's nodes add to them, from about 7 bytes per
    character kept (long prompts that share prefixes) to about 120 (many short, distinct ones) and
    about 300 (keys that branch at nearly every character)."""

    def __init__(self, max_chars: int = DEFAULT_MAX_TREE_CHARS):
        if max_chars < 1:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        self.max_chars = max_chars
        self.num_chars = 0
        self._clock = 0
        self._root = _Node("", None, 0)
        self._leaves: list[tuple[int, int, _Node]] = []  # (last_access, tiebreak, leaf); stale entries skipped
        self._tiebreak = itertools.count()
        self._num_nodes = 0

    def match(self, key: str) -> int:
        """Length of the longest prefix of `key` stored in the tree. Pure (no LRU refresh)."""
        node, i = self._root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_prefix_len(key, i, child.edge)
            i += n
            if n < len(child.edge):
                break
            node = child
        return i

    def insert(self, key: str) -> Insertion | None:
        """Evict down to `max_chars`, then store `key` and mark its path most recently used. The
        insertion (to undo it) or, for the empty key, which stores nothing, None."""
        if not key:
            return None
        self._evict()
        self._clock += 1
        node, i = self._root, 0
        while i < len(key):
            node.last_access = self._clock
            child = node.children.get(key[i])
            if child is None:
                leaf = _Node(key[i:], node, self._clock)
                node.children[key[i]] = leaf
                self.num_chars += len(leaf.edge)
                self._num_nodes += 1
                node = leaf
                break
            n = _common_prefix_len(key, i, child.edge)
            if n < len(child.edge):
                child = self._split(child, n)
            node, i = child, i + n
        node.last_access = self._clock
        node.ends += 1
        if not node.children:
            self._push_leaf(node)
        return Insertion(self, node)

    def _undo(self, node: _Node) -> None:
        """One key ending at `node` less; then drop the nodes left holding no key, bottom up."""
        node.ends -= 1
        while node.parent is not None and not node.children and node.ends == 0:
            parent = node.parent
            self._remove_leaf(node)
            node = parent

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after `n` characters; returns the new upper node."""
        upper = _Node(child.edge[:n], child.parent, child.last_access)
        upper.parent.children[upper.edge[0]] = upper
        child.edge, child.parent = child.edge[n:], upper
        upper.children[child.edge[0]] = child
        self._num_nodes += 1
        return upper

    def _push_leaf(self, leaf: _Node) -> None:
        heapq.heappush(self._leaves, (leaf.last_access, next(self._tiebreak), leaf))
        if len(self._leaves) > 4 * self._num_nodes + 64:  # drop stale entries
            self._leaves = [e for e in self._leaves if self._live_leaf(e)]
            heapq.heapify(self._leaves)

    @staticmethod
    def _live_leaf(entry: tuple[int, int, _Node]) -> bool:
        last_access, _, node = entry
        return node.parent is not None and not node.children and node.last_access == last_access

    def _evict(self) -> None:
        while self.num_chars > self.max_chars and self._leaves:
            entry = heapq.heappop(self._leaves)
            if not self._live_leaf(entry):
                continue
            self._remove_leaf(entry[2])

    def _remove_leaf(self, leaf: _Node) -> None:
        parent = leaf.parent
        del parent.children[leaf.edge[0]]
        leaf.parent = None
        self.num_chars -= len(leaf.edge)
        self._num_nodes -= 1
        if parent is not self._root and not parent.children:
            self._push_leaf(parent)


@dataclass(frozen=True)
class Decision:
    """A routing decision: the chosen worker and the rule that chose it (`round_robin`,
    `least_load`, `imbalanced`, `cache_hit`, `cache_miss`); `insertion`: what the policy recorded
    for it (`CacheAware`: the key in the worker's tree), which `retract` undoes."""

    worker: Worker
    reason: str
    insertion: Insertion | None = field(default=None, compare=False, repr=False)


class RoutingPolicy:
    """Base class. `select(text, loads, tenant=None)`: the request's text and tenant (`cache_salt`);
    `loads` maps each candidate worker (healthy, in the router's order) to its requests in flight;
    ValueError when it is empty. `retract(decision)`, at most once per decision: its worker did not
    serve the request (it failed, timed out, or the client left first), so the policy forgets what
    `select` recorded for it; a request served is never retracted. `remember(worker, text, tenant)`:
    the worker's cache now holds `text` (a served request's prompt and answer). `forget(worker)`
    drops what the policy remembers of a worker (its cache is presumed lost: it died or restarted)."""

    name = ""

    def select(self, text: str, loads: Mapping[Worker, int], tenant: str | None = None) -> Decision:
        raise NotImplementedError

    def retract(self, decision: Decision) -> None:
        pass

    def remember(self, worker: Worker, text: str, tenant: str | None = None) -> None:
        pass

    def forget(self, worker: Worker) -> None:
        pass


def _check(loads: Mapping[Worker, int]) -> None:
    if not loads:
        raise ValueError("no worker to route to")


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self):
        self._next = 0

    def select(self, text: str, loads: Mapping[Worker, int], tenant: str | None = None) -> Decision:
        _check(loads)
        workers = list(loads)
        worker = workers[self._next % len(workers)]
        self._next += 1
        return Decision(worker, "round_robin")


class LeastLoad(RoutingPolicy):
    name = "least_load"

    def select(self, text: str, loads: Mapping[Worker, int], tenant: str | None = None) -> Decision:
        _check(loads)
        return Decision(min(loads, key=loads.__getitem__), "least_load")


class CacheAware(RoutingPolicy):
    """SGLang's cache-aware rule over one `ApproxRadixTree` per worker (module docstring)."""

    name = "cache_aware"

    def __init__(self, cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
                 balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
                 max_tree_chars: int = DEFAULT_MAX_TREE_CHARS):
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if not balance_abs_threshold >= 0:
            raise ValueError(f"balance_abs_threshold must be at least 0, got {balance_abs_threshold}")
        if not 0.0 < balance_rel_threshold < math.inf:
            raise ValueError(f"balance_rel_threshold must be a positive number, got {balance_rel_threshold}")
        if not max_tree_chars >= 1:
            raise ValueError(f"max_tree_chars must be at least 1, got {max_tree_chars}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_chars = max_tree_chars
        self.trees: dict[Worker, ApproxRadixTree] = {}

    def tree(self, worker: Worker) -> ApproxRadixTree:
        if worker not in self.trees:
            self.trees[worker] = ApproxRadixTree(self.max_tree_chars)
        return self.trees[worker]

    def retract(self, decision: Decision) -> None:
        """Undo the decision's insertion (a no-op once its worker was forgotten: that tree is gone)."""
        if decision.insertion is not None:
            decision.insertion.undo()

    def remember(self, worker: Worker, text: str, tenant: str | None = None) -> None:
        """Store the text in the worker's tree (a no-op once the worker was forgotten)."""
        tree = self.trees.get(worker)
        if tree is not None:
            tree.insert(routing_key(text, tenant))

    def forget(self, worker: Worker) -> None:
        self.trees.pop(worker, None)

    def imbalanced(self, loads: Mapping[Worker, int]) -> bool:
        lo, hi = min(loads.values()), max(loads.values())
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def select(self, text: str, loads: Mapping[Worker, int], tenant: str | None = None) -> Decision:
        _check(loads)
        workers = list(loads)
        key = routing_key(text, tenant)
        tenant_chars = len(key) - len(text)

        def least_loaded() -> Worker:
            return min(workers, key=lambda w: (loads[w], self.tree(w).num_chars))

        if self.imbalanced(loads):
            worker, reason = least_loaded(), "imbalanced"
        else:
            matched = {w: max(self.tree(w).match(key) - tenant_chars, 0) for w in workers}  # of the text
            best = min(workers, key=lambda w: (-matched[w], loads[w]))
            if text and matched[best] / len(text) > self.cache_threshold:
                worker, reason = best, "cache_hit"
            else:
                worker, reason = least_loaded(), "cache_miss"
        return Decision(worker, reason, self.tree(worker).insert(key))


def make_policy(name: str, **cache_aware_options) -> RoutingPolicy:
    """A policy by name (`POLICIES`); `cache_aware_options` go to `CacheAware` and are ignored
    by the others."""
    if name == "cache_aware":
        return CacheAware(**cache_aware_options)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {POLICIES}")


# --- command line -----------------------------------------------------------------------------------
# Flags only `cache_aware` reads: default None, so that giving one to another policy is an error.
CACHE_AWARE_FLAGS = {"cache_threshold": "--cache-threshold", "balance_abs_threshold": "--balance-abs-threshold",
                     "balance_rel_threshold": "--balance-rel-threshold", "max_tree_chars": "--max-tree-chars"}


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """The router's flags: policy, thresholds, health checks, the request timeout (`llmjax router`,
    `llmjax cluster`)."""
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--cache-threshold", type=fraction, default=None,
                        help="cache_aware: go to the best-matching worker when more than this fraction of the "
                             f"request's text matches its tree (default {DEFAULT_CACHE_THRESHOLD})")
    parser.add_argument("--balance-abs-threshold", type=non_negative_int, default=None,
                        help="cache_aware: the load is imbalanced when max - min requests in flight exceeds this "
                             f"(default {DEFAULT_BALANCE_ABS_THRESHOLD}) and max exceeds --balance-rel-threshold "
                             "times min")
    parser.add_argument("--balance-rel-threshold", type=positive_number, default=None,
                        help=f"cache_aware: see --balance-abs-threshold (default {DEFAULT_BALANCE_REL_THRESHOLD})")
    parser.add_argument("--max-tree-chars", type=positive_int, default=None,
                        help=f"cache_aware: characters kept in each worker's tree, LRU eviction "
                             f"(default {DEFAULT_MAX_TREE_CHARS}); about 7 to 300 bytes of memory each")
    parser.add_argument("--health-check-interval", type=positive_seconds, default=DEFAULT_HEALTH_CHECK_INTERVAL,
                        help="seconds between /health checks of every worker (default %(default)s)")
    parser.add_argument("--health-check-timeout", type=positive_seconds, default=DEFAULT_HEALTH_CHECK_TIMEOUT,
                        help="seconds a /health check or a connection attempt may take (default %(default)s)")
    parser.add_argument("--health-failure-threshold", type=positive_int, default=DEFAULT_HEALTH_FAILURE_THRESHOLD,
                        help="failed /health checks in a row that take a worker out (default %(default)s)")
    parser.add_argument("--request-timeout", type=positive_seconds, default=DEFAULT_REQUEST_TIMEOUT,
                        help="seconds a worker may stay silent, waiting for its response headers or for the next "
                             "chunk of its body (each wait on its own, so a long stream is never cut); then the "
                             "client gets a 504, or a stream ends with an error event (default %(default)s)")


def check_router_args(args: argparse.Namespace) -> None:
    """UsageError for a `CACHE_AWARE_FLAGS` flag given with another policy (it would have no effect)."""
    given = [flag for name, flag in CACHE_AWARE_FLAGS.items() if getattr(args, name) is not None]
    if given and args.policy != "cache_aware":
        raise UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --policy cache_aware "
                         f"only, not {args.policy}")


def policy_from_args(args: argparse.Namespace) -> RoutingPolicy:
    """The policy of the flags; the cache-aware flags not given keep `CacheAware`'s defaults."""
    options = {name: getattr(args, name) for name in CACHE_AWARE_FLAGS if getattr(args, name) is not None}
    return make_policy(args.policy, **options)
