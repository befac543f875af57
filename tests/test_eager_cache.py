"""The eager entries' launcher cache is a bounded LRU (eager sizes vary from call to call)."""

from collections import OrderedDict

from treeverify.kernels import eager


def test_cached_reuses_then_evicts_least_recent(monkeypatch):
    monkeypatch.setattr(eager, "MAX_CACHED_LAUNCHERS", 2)
    cache: OrderedDict = OrderedDict()
    made = []

    def make(k):
        return lambda: made.append(k) or f"launcher-{k}"

    assert eager.cached(cache, ("a",), make("a")) == "launcher-a"
    assert eager.cached(cache, ("b",), make("b")) == "launcher-b"
    assert eager.cached(cache, ("a",), make("a")) == "launcher-a"  # hit: no new launcher
    eager.cached(cache, ("c",), make("c"))  # evicts b, the least recently used
    assert list(cache) == [("a",), ("c",)] and made == ["a", "b", "c"]
