"""Routing policies (`llmjax/serve/routing.py`) and the router's request text, without any server.

The approximate radix tree is checked against a naive model: the set of inserted keys, where the
longest stored prefix of a key is its longest common prefix with any of them.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmjax.serve.router import answer_texts, followup_text, request_text
from llmjax.serve import routing
from llmjax.serve.routing import ApproxRadixTree, CacheAware, Decision, LeastLoad, RoundRobin, make_policy, routing_key

SYSTEM_A = "You are a pirate. Answer every question in pirate speak, with at least one arr. " * 4
SYSTEM_B = "Act as a careful lawyer. Cite the statute for every claim you make, and hedge. " * 4
SALT = "3f2b8c1e-6d4a-4b9e-9a7c-2e5f8d1c0b6a"  # a tenant's cache_salt, longer than the texts below


def naive_match(keys: list[str], key: str) -> int:
    return max((len(os.path.commonprefix([k, key])) for k in keys), default=0)


keys = st.text(alphabet="abc", max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(keys, max_size=30), st.lists(keys, max_size=10))
def test_tree_matches_the_naive_model(inserted, queries):
    tree = ApproxRadixTree()
    for k in inserted:
        tree.insert(k)
    for q in queries + inserted:
        assert tree.match(q) == naive_match(inserted, q)
    assert tree.num_chars <= sum(map(len, inserted))


@settings(max_examples=200, deadline=None)
@given(st.lists(keys, min_size=1, max_size=30), st.integers(1, 20))
def test_tree_stays_bounded_and_keeps_the_newest_key(inserted, max_chars):
    tree = ApproxRadixTree(max_chars)
    last = ""
    for k in inserted:
        tree.insert(k)
        last = k or last  # the empty key stores nothing
        assert tree.num_chars <= max_chars + len(last)  # the bound, plus the key stored last
        assert tree.match(last) == len(last)  # the newest key is never evicted before the next insert
    for q in inserted:
        assert tree.match(q) <= naive_match(inserted, q)


def distinct_prefixes(keys: list[str]) -> int:
    """Characters of a trie holding `keys`: their distinct non-empty prefixes."""
    return len({k[:i] for k in keys for i in range(1, len(k) + 1)})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(keys, st.integers(0, 29)), max_size=40), st.lists(keys, max_size=10))
def test_undone_insertions_leave_the_tree_of_the_other_keys(ops, queries):
    """Inserts (a key) and undos (an integer: which of the insertions not undone yet), in any order:
    the tree is the one of the keys inserted and not undone, the same key inserted twice included."""
    tree = ApproxRadixTree()
    live: list[tuple[str, object]] = []  # (key, its insertion) not undone
    for op in ops:
        if isinstance(op, str):
            live.append((op, tree.insert(op)))
        elif live:
            key, insertion = live.pop(op % len(live))
            if key:
                insertion.undo()
            else:
                assert insertion is None  # the empty key stores nothing
    live_keys = [k for k, _ in live]
    for q in queries + [op for op in ops if isinstance(op, str)]:
        assert tree.match(q) == naive_match(live_keys, q), q
    assert tree.num_chars == distinct_prefixes(live_keys)


def test_an_insertion_is_undone_once_and_not_after_its_eviction():
    tree = ApproxRadixTree(max_chars=10)
    first = tree.insert("aaaaaaaaaa")
    tree.insert("bbbbbbbbbb")
    tree.insert("cccccccccc")  # evicts the first key (20 characters > 10), then stores its own
    first.undo()
    assert tree.match("bbbbbbbbbb") == tree.match("cccccccccc") == 10 and tree.num_chars == 20
    with pytest.raises(ValueError, match="undone already"):
        first.undo()


def test_tree_evicts_least_recently_inserted_first():
    tree = ApproxRadixTree(max_chars=20)
    tree.insert("aaaaaaaaaa")
    tree.insert("bbbbbbbbbb")
    tree.insert("aaaaaaaaaa")  # refresh a: b is now the oldest
    tree.insert("cccccccccc")  # 20 characters before it: nothing evicted
    tree.insert("dddddddddd")  # 30 before it: b goes
    assert tree.match("aaaaaaaaaa") == tree.match("cccccccccc") == tree.match("dddddddddd") == 10
    assert tree.match("bbbbbbbbbb") == 0


def test_an_undone_key_longer_than_the_tree_evicts_nothing():
    """A request its worker refused (say, a prompt too long for it) leaves the other keys in place."""
    tree = ApproxRadixTree(max_chars=20)
    tree.insert("aaaaaaaaaa")
    tree.insert("bbbbbbbbbb")
    tree.insert("z" * 50).undo()
    tree.insert("cccccccccc")
    assert tree.match("aaaaaaaaaa") == tree.match("bbbbbbbbbb") == tree.match("cccccccccc") == 10


def test_tree_shared_prefix_is_stored_once():
    tree = ApproxRadixTree()
    tree.insert(SYSTEM_A + "question one")
    tree.insert(SYSTEM_A + "question two")
    assert tree.num_chars == len(SYSTEM_A + "question ") + len("one") + len("two")
    assert tree.match(SYSTEM_A + "question six") == len(SYSTEM_A + "question ")


def test_cache_aware_sends_a_prefix_family_to_one_worker():
    policy = CacheAware()
    loads = {"w0": 0, "w1": 0}
    first = policy.select(SYSTEM_A + "q0", loads)
    assert first.reason == "cache_miss"
    loads[first.worker] += 1
    other = policy.select(SYSTEM_B + "q0", loads)  # a new family goes to the least-loaded worker
    assert other.reason == "cache_miss" and other.worker != first.worker
    for i in range(1, 5):
        d = policy.select(SYSTEM_A + f"q{i}", loads)
        assert (d.worker, d.reason) == (first.worker, "cache_hit")


@pytest.mark.parametrize("tenant", [None, SALT])
def test_cache_threshold_is_a_strict_lower_bound_on_the_match_rate(tenant):
    """The match rate is the text's matched share: a tenant's prefix changes no decision."""
    loads = {"w0": 1, "w1": 0}
    at_threshold = CacheAware(cache_threshold=0.5)
    at_threshold.tree("w0").insert(routing_key("x" * 50, tenant))
    assert at_threshold.select("x" * 50 + "y" * 50, loads, tenant) == Decision("w1", "cache_miss")
    above = CacheAware(cache_threshold=0.5)
    above.tree("w0").insert(routing_key("x" * 51, tenant))
    assert above.select("x" * 51 + "y" * 49, loads, tenant) == Decision("w0", "cache_hit")
    zero = CacheAware(cache_threshold=0.0)  # any match of the text at all wins
    zero.tree("w0").insert(routing_key("x", tenant))
    assert zero.select("x" + "y" * 99, loads, tenant) == Decision("w0", "cache_hit")
    assert zero.select("y" * 100, loads, tenant).reason == "cache_miss"  # the tenant's prefix alone: no match


@pytest.mark.parametrize("setting", [dict(cache_threshold=1.5), dict(balance_abs_threshold=-1),
                                     dict(balance_rel_threshold=0.0), dict(balance_rel_threshold=float("nan")),
                                     dict(max_tree_chars=0)])
def test_cache_aware_refuses_a_bad_setting_when_built_not_at_its_first_request(setting):
    with pytest.raises(ValueError, match=next(iter(setting))):
        CacheAware(**setting)


def test_unrelated_texts_of_one_tenant_spread_like_untenanted_ones():
    policy = CacheAware()
    loads = {"w0": 0, "w1": 0}
    decisions = []
    for i in range(8):
        d = policy.select(f"{chr(ord('a') + i)} question {i}?", loads, tenant=SALT)
        loads[d.worker] += 1
        decisions.append(d)
    assert {d.reason for d in decisions} == {"cache_miss"}
    assert Counter(d.worker for d in decisions) == {"w0": 4, "w1": 4}


def test_cache_miss_goes_to_the_least_loaded_worker_then_the_smaller_tree():
    policy = CacheAware()
    policy.tree("w0").insert(routing_key(SYSTEM_A))
    assert policy.select(SYSTEM_B, {"w0": 3, "w1": 5, "w2": 1}) == Decision("w2", "cache_miss")
    policy = CacheAware()
    policy.tree("w0").insert(routing_key("abcdefgh"))
    policy.tree("w1").insert(routing_key("xyz"))
    assert policy.select("something else", {"w0": 0, "w1": 0}) == Decision("w1", "cache_miss")


def test_imbalance_overrides_the_cache_match():
    policy = CacheAware(balance_abs_threshold=32, balance_rel_threshold=1.0001)
    policy.tree("w0").insert(routing_key(SYSTEM_A))
    d = policy.select(SYSTEM_A + "q", {"w0": 40, "w1": 7})  # 33 apart, 40 > 7.0007
    assert (d.worker, d.reason) == ("w1", "imbalanced")
    assert policy.tree("w1").match(routing_key(SYSTEM_A + "q")) == len(routing_key(SYSTEM_A + "q"))  # it learns it
    policy = CacheAware(balance_abs_threshold=32, balance_rel_threshold=1.0001)
    policy.tree("w0").insert(routing_key(SYSTEM_A))
    assert policy.select(SYSTEM_A + "q", {"w0": 40, "w1": 8}) == Decision("w0", "cache_hit")  # 32 apart


def test_relative_threshold_also_has_to_be_exceeded():
    policy = CacheAware(balance_abs_threshold=32, balance_rel_threshold=2.0)
    policy.tree("w0").insert(routing_key(SYSTEM_A))
    assert policy.select(SYSTEM_A, {"w0": 100, "w1": 60}).reason == "cache_hit"  # 100 <= 2 * 60
    assert policy.select(SYSTEM_A, {"w0": 130, "w1": 60}).reason == "imbalanced"


def test_evicted_prefixes_no_longer_attract_requests():
    policy = CacheAware(max_tree_chars=len(SYSTEM_A) + 10)
    assert policy.select(SYSTEM_A + "q0", {"w0": 0, "w1": 0}).worker == "w0"
    policy.select(SYSTEM_B + "q0", {"w0": 0})  # only w0 is a candidate
    policy.select(SYSTEM_B + "q1", {"w0": 0})  # the tree is past its bound: A, the oldest, goes
    assert policy.tree("w0").match(routing_key(SYSTEM_A)) == len(routing_key(""))  # the untenanted keys' prefix
    d = policy.select(SYSTEM_A + "q1", {"w0": 2, "w1": 1})
    assert (d.worker, d.reason) == ("w1", "cache_miss")


def test_tenants_do_not_pull_each_others_traffic():
    policy = CacheAware()
    loads = {"w0": 0, "w1": 0}
    a = policy.select(SYSTEM_A, loads, tenant="tenant-a")
    loads[a.worker] += 1
    b = policy.select(SYSTEM_A, loads, tenant="tenant-b")
    assert b.reason == "cache_miss" and b.worker != a.worker
    loads[b.worker] += 5  # even when the tenant's own worker is busier, same-tenant text sticks to it
    assert policy.select(SYSTEM_A + "more", loads, tenant="tenant-b") == Decision(b.worker, "cache_hit")


@pytest.mark.parametrize("stored, stored_tenant, text, tenant", [
    (SYSTEM_A, "acme", "acme\x00" + SYSTEM_A, None),     # no tenant, a text that spells acme's key
    ("abc\x00" + SYSTEM_A, None, SYSTEM_A, "abc"),        # a tenant, the key of a text of none
    (SYSTEM_A, "t\x00X", "X\x00" + SYSTEM_A, "t"),        # a text that completes another tenant's name
    (SYSTEM_A, "t\x00", "\x00" + SYSTEM_A, "t"),
])
def test_no_text_matches_into_another_tenants_keys(stored, stored_tenant, text, tenant):
    """NULs in a text or a tenant never make a request match another tenant's keys (with the tenant
    and a NUL before the text, each of these spelled the stored key exactly)."""
    policy = CacheAware()
    policy.tree("w0").insert(routing_key(stored, stored_tenant))
    assert policy.select(text, {"w0": 1, "w1": 0}, tenant) == Decision("w1", "cache_miss")
    assert policy.select(stored, {"w0": 1, "w1": 0}, stored_tenant) == Decision("w0", "cache_hit")


def test_forget_drops_a_workers_tree():
    policy = CacheAware()
    policy.tree("w0").insert(routing_key(SYSTEM_A))
    policy.forget("w0")
    assert policy.select(SYSTEM_A, {"w0": 1, "w1": 0}) == Decision("w1", "cache_miss")


def test_a_retracted_decision_leaves_the_key_only_with_the_worker_that_served_it():
    """The first choice fails, the request is re-routed: later requests of the family follow the
    worker that served it, not the one that failed."""
    policy = CacheAware()
    failed = policy.select(SYSTEM_A + "q0", {"w0": 0, "w1": 0})
    assert failed == Decision("w0", "cache_miss")
    policy.retract(failed)
    assert policy.tree("w0").match(routing_key(SYSTEM_A)) == 0 and policy.tree("w0").num_chars == 0
    assert policy.select(SYSTEM_A + "q0", {"w1": 0}) == Decision("w1", "cache_miss")  # the retry, w0 excluded
    assert policy.select(SYSTEM_A + "q1", {"w0": 0, "w1": 0}) == Decision("w1", "cache_hit")


def test_retracting_after_forget_leaves_the_new_tree_alone():
    policy = CacheAware()
    d = policy.select(SYSTEM_A, {"w0": 0})
    policy.forget("w0")
    policy.tree("w0").insert(routing_key(SYSTEM_B))
    policy.retract(d)
    key = routing_key(SYSTEM_B)
    assert policy.tree("w0").match(key) == len(key) and policy.tree("w0").num_chars == len(key)


def test_request_timeout_flag():
    parser = argparse.ArgumentParser(prog="llmjax router")
    routing.add_router_args(parser)
    assert parser.parse_args([]).request_timeout == routing.DEFAULT_REQUEST_TIMEOUT == 1800
    assert parser.parse_args(["--request-timeout", "2.5"]).request_timeout == 2.5
    assert "--request-timeout" in parser.format_help()
    for bad in ("0", "-1", "inf", "nan", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--request-timeout", bad])


def test_round_robin_and_least_load():
    rr = RoundRobin()
    assert [rr.select("", {"a": 9, "b": 0, "c": 0}).worker for _ in range(4)] == ["a", "b", "c", "a"]
    assert LeastLoad().select("", {"a": 2, "b": 1, "c": 1}).worker == "b"
    for policy in (rr, LeastLoad(), CacheAware()):
        with pytest.raises(ValueError):
            policy.select("x", {})
        policy.retract(policy.select("x", {"a": 0}))  # nothing recorded is left behind
        assert not isinstance(policy, CacheAware) or policy.tree("a").num_chars == 0
    with pytest.raises(ValueError):
        make_policy("random")
    assert make_policy("round_robin", cache_threshold=0.9).name == "round_robin"


def _nested(depth: int) -> list:
    value = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


def test_request_text():
    assert request_text({"prompt": "hello"}, chat=False) == "hello"
    assert request_text({"prompt": [1, 22, 333]}, chat=False) == "1 22 333 "
    longer_id = request_text({"prompt": [1, 22, 3334]}, chat=False)
    assert not longer_id.startswith(request_text({"prompt": [1, 22, 333]}, chat=False))
    assert request_text({"prompt": ["ab", [1, 2]]}, chat=False) == "ab\n1 2 "
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    assert request_text({"messages": messages}, chat=True) == "system\nbe brief\nuser\nhi there\n"
    for bad in (None, [], {"prompt": 3}, {"prompt": []}, {"messages": "x"}, {"messages": 5}):
        assert request_text(bad, chat=False) == request_text(bad, chat=True) == ""
    odd_parts = [{"role": "user", "content": [{"type": "text", "text": 5}, {"type": "text", "text": None},
                                              {"type": "text", "text": "ok"}]}, {"role": 1, "content": 2}]
    assert request_text({"messages": odd_parts}, chat=True) == "user\nok\n\n\n"  # other shapes count as ""
    assert request_text({"prompt": ["ab", [[1]], 3]}, chat=False) == "ab\n\n"
    deep = _nested(5000)  # deeper than Python's recursion limit
    assert request_text({"prompt": deep}, chat=False) == request_text({"messages": deep}, chat=True) == ""
    assert request_text({"messages": [{"content": deep}]}, chat=True) == "\n\n"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["prompt", "messages", "role", "content", "text", "type"]) | st.text(max_size=3), inner,
        max_size=3),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_request_text_of_any_json_is_a_string(value):
    """Whatever the body's shape, the router gets a text (the worker judges the body)."""
    for body in (value, {"prompt": value}, {"prompt": [value]}, {"messages": value}, {"messages": [value]},
                 {"messages": [{"role": value, "content": value}]}, {"messages": [{"content": [value]}]}):
        for chat in (False, True):
            assert isinstance(request_text(body, chat), str)


def test_the_answer_after_its_prompt_is_the_next_turns_prefix():
    messages = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "Who are you?"}]
    answer = "Arr, a pirate."
    next_turn = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    held = followup_text({"messages": messages}, True, answer)
    assert request_text({"messages": next_turn}, True).startswith(held) and held.endswith(answer + "\n")
    assert followup_text({"prompt": "Once upon"}, False, " a time") == "Once upon a time"
    for body in ({"prompt": "x", "echo": True}, {"prompt": [1, 2]}, {"prompt": ["a", "b"]}, {"messages": "x"}, []):
        assert followup_text(body, "messages" in body, "y") is None  # nothing a next request would repeat


def test_answers_are_read_from_json_and_sse_bodies():
    chat = {"choices": [{"index": 0, "message": {"content": "one"}}, {"index": 1, "message": {"content": "two"}}]}
    assert answer_texts(json.dumps(chat).encode(), False, True) == ["one", "two"]
    events = [{"choices": [{"index": 0, "text": "Hel"}]}, {"choices": [{"index": 1, "text": "Bye"}]},
              {"choices": [{"index": 0, "text": "lo"}]}, {"choices": [], "usage": {"total_tokens": 3}}]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    assert answer_texts(sse.encode(), True, False) == ["Hello", "Bye"]
    for body, is_sse in ((b"not json", False), (b'{"choices": 3}', False), (b"data: {oops\n\n", True),
                         (b'{"error": {}}', False)):
        assert answer_texts(body, is_sse, True) == []


def test_remember_adds_to_a_workers_tree_until_it_is_forgotten():
    policy = CacheAware()
    d = policy.select(SYSTEM_A, {"w0": 0}, tenant="t")
    policy.remember(d.worker, SYSTEM_A + " and its answer", tenant="t")
    assert policy.tree("w0").match(routing_key(SYSTEM_A + " and its answer", "t")) == len(
        routing_key(SYSTEM_A + " and its answer", "t"))
    policy.forget("w0")
    policy.remember("w0", SYSTEM_B)  # its cache is presumed lost: nothing to add to
    assert "w0" not in policy.trees
