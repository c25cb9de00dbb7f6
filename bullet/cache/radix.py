"""A radix tree over token ids at page granularity: every edge is one full page of token ids, every
node one KV page whose K/V hold exactly the tokens on the path from the root to it.

Only full pages are ever shared: K/V at a position depend on every earlier token, so a page is
reusable only by a sequence that starts with the same tokens up to and including that page, and a
partly filled page would have to be extended by the next request (which writes into it). A prefix
that ends mid-page is matched up to its last full page; the rest is recomputed.

Requests in flight pin the node their matched prefix ends at, which pins every ancestor too
(`refs` counts pins through a node, so `refs == 0` at a node means it is 0 in its whole subtree).
Eviction takes unreferenced leaves in least-recently-used order (a logical clock, so the simulator
and a worker evict the same pages). The tree knows nothing of the allocator: `PrefixCache` moves
pages between requests, the tree and the free list."""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence


class Node:
    __slots__ = ("key", "page", "parent", "children", "refs", "last_use", "alive")

    def __init__(self, key: tuple[int, ...], page: int, parent: Node | None):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.refs = 0
        self.last_use = 0
        self.alive = True

    def path_pages(self) -> list[int]:
        """Pages from the root's first child down to this node."""
        pages, node = [], self
        while node.parent is not None:
            pages.append(node.page)
            node = node.parent
        return pages[::-1]


class RadixTree:
    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.root = Node((), -1, None)
        self.root.refs = 1  # never evicted, never counted
        self.num_pages = 0  # nodes (pages) in the tree
        self.num_pinned = 0  # of those, nodes some request pins
        self._clock = itertools.count(1)
        self._leaves: list[tuple[int, int, Node]] = []  # (last_use, tiebreak, node): eviction candidates, lazily checked
        self._tiebreak = itertools.count()

    @property
    def num_evictable(self) -> int:
        return self.num_pages - self.num_pinned

    def _keys(self, tokens: Sequence[int], max_pages: int) -> list[tuple[int, ...]]:
        ps = self.page_size
        n = min(len(tokens) // ps, max_pages)
        return [tuple(tokens[i * ps:(i + 1) * ps]) for i in range(n)]

    # -- lookup -------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_pages: int | None = None) -> Node:
        """The deepest node whose path is a prefix of `tokens` (the root if none), at most
        `max_pages` deep; marks the path as used now."""
        node, now = self.root, next(self._clock)
        for key in self._keys(tokens, len(tokens) if max_pages is None else max_pages):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            node.last_use = now
        return node

    def depth(self, tokens: Sequence[int], max_pages: int | None = None) -> int:
        """How many pages of `tokens` `match` would find, without touching the tree."""
        node, depth = self.root, 0
        for key in self._keys(tokens, len(tokens) if max_pages is None else max_pages):
            node = node.children.get(key)
            if node is None:
                break
            depth += 1
        return depth

    # -- pins ---------------------------------------------------------------------------------------
    def pin(self, node: Node) -> None:
        while node is not None and node.parent is not None:
            node.refs += 1
            if node.refs == 1:
                self.num_pinned += 1
            node = node.parent

    def unpin(self, node: Node) -> None:
        leaf = node
        while node is not None and node.parent is not None:
            if node.refs <= 0:
                raise RuntimeError("unpinned a node no request pins")
            node.refs -= 1
            if node.refs == 0:
                self.num_pinned -= 1
            node = node.parent
        self._maybe_candidate(leaf)

    # -- insertion ----------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[list[int], list[int]]:
        """Add the full pages of `tokens` whose K/V are in `pages` (one per full page, in order).
        Returns (adopted, duplicates): pages that became tree nodes, and pages whose tokens the tree
        already holds in another page (the caller frees those). A page the tree already holds as
        the same node (a pinned prefix) is in neither."""
        node, now = self.root, next(self._clock)
        adopted, duplicates = [], []
        for key, page in zip(self._keys(tokens, len(pages)), pages):
            child = node.children.get(key)
            if child is None:
                child = Node(key, page, node)
                node.children[key] = child
                self.num_pages += 1
                adopted.append(page)
            elif child.page != page:
                duplicates.append(page)
            child.last_use = now
            node = child
        self._maybe_candidate(node)
        return adopted, duplicates

    def extend(self, node: Node, tokens: Sequence[int], pages: Sequence[int]) -> Node:
        """Add the full pages of `tokens` below `node` as new nodes, stopping at the first page the
        tree already holds (another request's copy); returns the deepest node added (or `node`)."""
        now = next(self._clock)
        for key, page in zip(self._keys(tokens, len(pages)), pages):
            if key in node.children:
                break
            child = Node(key, page, node)
            child.last_use = now
            node.children[key] = child
            self.num_pages += 1
            node = child
        self._maybe_candidate(node)
        return node

    # -- eviction -----------------------------------------------------------------------------------
    def _maybe_candidate(self, node: Node) -> None:
        if node.parent is not None and node.alive and node.refs == 0 and not node.children:
            heapq.heappush(self._leaves, (node.last_use, next(self._tiebreak), node))

    def evict(self, num_pages: int) -> list[int]:
        """Remove up to `num_pages` unreferenced leaves, least recently used first (a parent left
        childless becomes a candidate in turn); returns their pages."""
        freed: list[int] = []
        while len(freed) < num_pages and self._leaves:
            last_use, _, node = heapq.heappop(self._leaves)
            if not node.alive or node.refs or node.children or node.last_use != last_use:
                if node.alive and not node.refs and not node.children:
                    self._maybe_candidate(node)  # used since it was queued: queue it at its new time
                continue
            node.alive = False
            parent = node.parent
            del parent.children[node.key]
            self.num_pages -= 1
            freed.append(node.page)
            self._maybe_candidate(parent)
        return freed

    def evict_all(self) -> list[int]:
        """Every unreferenced page (what /flush_cache drops)."""
        return self.evict(self.num_evictable)
