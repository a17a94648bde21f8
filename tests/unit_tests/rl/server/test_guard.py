"""megatron.rl.server.guard: the bearer rule and the bounded cache (the servers' tests cover the rest)."""
from megatron.rl.server.guard import LRUCache, authorized, bearer_token, safe_message


def test_bearer_rule():
    assert bearer_token("Bearer abc") == bearer_token("bearer abc") == bearer_token(" BEARER   abc ") == "abc"
    assert bearer_token("abc") is None and bearer_token("Basic abc") is None and bearer_token("Bearer ") is None
    assert authorized(None, None) and authorized("anything", None)
    assert authorized("Bearer k", "k") and not authorized("k", "k") and not authorized("Bearer kk", "k")


def test_lru_cache_evicts_least_recently_used():
    evicted = []
    cache = LRUCache(2, on_evict=lambda k, v: evicted.append(k))
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert evicted == ["b"] and "a" in cache and "c" in cache and len(cache) == 2


def test_safe_message_bounds_and_escapes():
    assert safe_message("x" * 1000, limit=10) == "x" * 10 + "..."
    assert safe_message("bad \ud800").encode("utf-8") == b"bad \\ud800"
