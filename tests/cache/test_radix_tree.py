"""The radix tree alone: page-granular matching, pins, LRU eviction of unreferenced leaves."""

from __future__ import annotations

import pytest

from bullet.cache.radix import RadixTree

PS = 4


def toks(*pages: int, extra: int = 0) -> list[int]:
    """A token sequence of full pages, page k made of the id pages[k], plus `extra` odd tokens."""
    return [t for p in pages for t in [p] * PS] + [999] * extra


def test_match_is_page_granular_and_stops_at_the_first_difference():
    tree = RadixTree(PS)
    adopted, dup = tree.insert(toks(1, 2, 3), [10, 11, 12])
    assert adopted == [10, 11, 12] and dup == [] and tree.num_pages == 3
    assert tree.match(toks(1, 2, 3, 4)).path_pages() == [10, 11, 12]
    assert tree.match(toks(1, 2, 7)).path_pages() == [10, 11]
    # a prefix ending mid-page matches its full pages only
    assert tree.match(toks(1, 2, extra=3)).path_pages() == [10, 11]
    assert tree.match(toks(1) + [2, 2, 2]).path_pages() == [10]
    assert tree.match(toks(5)) is tree.root
    assert tree.match(toks(1, 2, 3), max_pages=1).path_pages() == [10]
    assert tree.depth(toks(1, 2, 9)) == 2


def test_insert_reports_pages_the_tree_already_holds_elsewhere():
    tree = RadixTree(PS)
    tree.insert(toks(1, 2), [10, 11])
    adopted, dup = tree.insert(toks(1, 2, 3), [10, 20, 21])  # page 10 is the tree's own; 20 duplicates 11
    assert adopted == [21] and dup == [20]
    assert tree.match(toks(1, 2, 3)).path_pages() == [10, 11, 21]


def test_pinned_paths_are_never_evicted_and_lru_goes_first():
    tree = RadixTree(PS)
    tree.insert(toks(1, 2), [10, 11])
    tree.insert(toks(3, 4), [12, 13])
    tree.insert(toks(5), [14])
    node = tree.match(toks(1, 2))  # used last among the three chains
    tree.pin(node)
    assert tree.num_evictable == 3 and tree.num_pinned == 2
    assert tree.evict(1) == [13]  # the least recently used leaf
    assert tree.evict(10) == [12, 14]  # its parent became a leaf; then the next chain; 10, 11 are pinned
    assert tree.num_pages == 2
    tree.unpin(node)
    assert tree.num_evictable == 2
    assert tree.evict_all() == [11, 10]  # leaves first
    assert tree.num_pages == 0 and tree.evict(1) == []


def test_a_shared_prefix_is_pinned_by_every_user_until_the_last_lets_go():
    tree = RadixTree(PS)
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    a, b = tree.match(toks(1, 2, 3)), tree.match(toks(1, 2, 8))
    tree.pin(a)
    tree.pin(b)
    tree.unpin(a)
    assert tree.evict(3) == [12]  # only the page a alone used
    tree.unpin(b)
    assert sorted(tree.evict(3)) == [10, 11]
    with pytest.raises(RuntimeError):
        tree.unpin(b)


def test_a_touched_leaf_moves_behind_the_others():
    tree = RadixTree(PS)
    tree.insert(toks(1), [10])
    tree.insert(toks(2), [11])
    tree.match(toks(1))
    assert tree.evict(1) == [11]
