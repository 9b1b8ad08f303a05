"""kvtui's registries hold what it watches by identity and weakly: an object's entry never answers for another
object that later gets its id, and `by_id` (the C-level lookup every watched forward goes through) forgets an
object as it dies, as `get` does."""

from __future__ import annotations

import gc

from kvtui.engine.watch.patches import Registry


class Thing:
    pass


def test_by_id_answers_for_live_objects_and_forgets_them_as_they_die():
    registry: Registry[str] = Registry()
    died = []
    first, second = Thing(), Thing()
    registry.add(first, "first", on_dead=lambda: died.append("first"))
    registry.add(second, "second")
    key = id(first)
    assert registry.by_id(key) == registry.get(first) == "first"
    assert registry.by_id(id(second)) == "second"
    del first
    gc.collect()
    assert died == ["first"] and registry.by_id(key) is None  # gone before its id could be another object's
    assert [value for value in registry.values()] == ["second"]


def test_discard_and_add_again_keep_by_id_and_get_agreeing():
    registry: Registry[str] = Registry()
    thing = Thing()
    registry.add(thing, "old")
    registry.add(thing, "new")  # a newer watch of the same object
    assert registry.by_id(id(thing)) == registry.get(thing) == "new"
    registry.discard(thing, "old")  # the earlier one lets go: not the newer one's entry
    assert registry.by_id(id(thing)) == "new"
    registry.discard(thing, "new")
    assert registry.by_id(id(thing)) is None and registry.get(thing) is None
    registry.add(thing, "again")
    key = id(thing)
    del thing
    gc.collect()
    assert registry.by_id(key) is None  # the re-added entry went with its object too
    registry.clear()
    assert len(registry) == 0
