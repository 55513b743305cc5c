"""A graphed decode step's inputs as the host builds them: one flat int64 buffer in the graph's
layout (`DecodeLayout`), filled whole (`fill_decode_inputs`) or, for the step after one of the
same requests in the same order, advanced from that step's (`DecodeInputs`): positions, context
lengths and KV slots move on by one, the ids are read again, and only the blocks the requests
got since are written into the tables. A steady batch's steps are nearly all of the second
kind; on the H100 host the whole fill of 64 rows took 117 us of a 1.4 ms step.

The graphs that read these buffers are `pd.engine.cuda_graph`'s.
"""

from __future__ import annotations

import itertools
from operator import attrgetter, getitem, is_
from typing import NamedTuple

import numpy as np

# the ids a graphed row's argmax may be told to pass over (min_tokens' EOS and stop ids)
GRAPH_BANS = 8


class DecodeLayout(NamedTuple):
    """Where a decode graph of (batch B, block-table width W) finds its inputs in one flat
    int64 buffer: ids, positions, KV slots, context lengths and future rows (B each), the
    block tables [B, W], then each row's banned ids [B, GRAPH_BANS] (-1: none). A future row
    j >= 0 means "this row's id is row j of the previous step's tokens" (sampled by the step
    still in flight; its id is read on the device). A row's banned ids are ids its greedy
    token must not be (a request under min_tokens: `pd.engine.sampler.banned_token_ids`); the
    graph's argmax passes over them."""

    batch: int
    width: int

    @property
    def size(self) -> int:
        return self.batch * (5 + self.width + GRAPH_BANS)

    def views(self, flat):
        """(ids, positions, slots, context_lens, future, block_tables) of `flat` (a tensor or
        an array)."""
        b = self.batch
        cols = [flat[i * b:(i + 1) * b] for i in range(5)]
        return (*cols, flat[5 * b:b * (5 + self.width)].reshape(b, self.width))

    def bans(self, flat):
        """The banned ids [B, GRAPH_BANS] of `flat` (a tensor or an array)."""
        return flat[self.batch * (5 + self.width):self.size].reshape(self.batch, GRAPH_BANS)


_COMPUTED, _TOKENS = attrgetter("num_computed_tokens"), attrgetter("token_ids")


def _starts_and_ids(reqs) -> tuple[np.ndarray, np.ndarray]:
    """Each request's position this step and the id there (a placeholder -(j + 1) for a token
    still on the device).
    NOTE: by `map` over C-level getters, no Python frame per request (64 rows: 15 -> 9 us on
    the CPU against a generator of pairs)."""
    n = len(reqs)
    start = np.fromiter(map(_COMPUTED, reqs), np.int64, n)
    return start, np.fromiter(map(getitem, map(_TOKENS, reqs), start.tolist()), np.int64, n)


def _fill_columns(cols: np.ndarray, tables: np.ndarray, start: np.ndarray, new: np.ndarray,
                  block_size: int) -> None:
    """The five columns of the first len(start) rows, from their tables."""
    n = len(start)
    block, offset = np.divmod(start, block_size)
    cols[0, :n] = np.maximum(new, 0)
    cols[1, :n] = start
    cols[2, :n] = tables[np.arange(n), block] * block_size + offset
    cols[3, :n] = start + 1
    cols[4, :n] = np.where(new < 0, ~new, -1)  # ~x == -x - 1


def _split(flat: np.ndarray, layout: DecodeLayout) -> tuple[np.ndarray, np.ndarray]:
    """(columns [5, B], tables [B, W]) views of `flat`."""
    b = layout.batch
    return flat[:5 * b].reshape(5, b), flat[5 * b:b * (5 + layout.width)].reshape(b, layout.width)


def fill_decode_inputs(flat: np.ndarray, layout: DecodeLayout, reqs, block_size: int,
                       dummy_block: int) -> np.ndarray:
    """A decode step's inputs in `layout` (`flat` int64): each request's one new token at
    position num_computed_tokens, rows past the batch padded (token 0 at position 0 in the
    spare block), no banned ids (`write_bans` writes them). A negative id -(j + 1) (the overlap
    loop's placeholder) becomes future row j. Returns the requests' table widths.
    NOTE: in as few numpy calls as it takes (a decode step's host time is mostly their number:
    ~2 us each on the H100 host)."""
    n = len(reqs)
    cols, tables = _split(flat, layout)
    cols[:, n:] = np.array(((0,), (0,), (dummy_block * block_size,), (1,), (-1,)), np.int64)
    tables.fill(dummy_block)
    layout.bans(flat).fill(-1)
    # NOTE: every table at once, row-major under a mask (256 rows: 135 -> 64 us on the CPU)
    block_ids = [r.block_ids for r in reqs]
    widths = np.fromiter(map(len, block_ids), np.int64, n)
    tables[:n][np.arange(layout.width) < widths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_ids), np.int64, int(widths.sum()))
    _fill_columns(cols, tables, *_starts_and_ids(reqs), block_size)
    return widths


def write_bans(flat: np.ndarray, layout: DecodeLayout, bans: list[tuple[int, ...]]) -> None:
    """Row i's banned ids bans[i] (at most GRAPH_BANS; () for none) into `flat`, filled by
    `fill_decode_inputs` or advanced from a buffer it filled (none banned there)."""
    view = layout.bans(flat)
    for i, banned in enumerate(bans):
        if banned:
            view[i, :len(banned)] = banned


def write_new_blocks(tables: np.ndarray, lists: list, old_lists: list,
                     old_widths: list[int]) -> list[int] | None:
    """Into `tables` (rows written for the block lists `old_lists`, `old_widths` of each), the
    blocks each of `lists` got since; returns the new widths, or None where the rows cannot be
    kept: another list in a row (another request; a request's list is replaced, never
    rewritten, when its blocks are freed) or a shorter one. Then the caller writes them whole.
    NOTE: every step: Python's list compare, not numpy's (each numpy call ~2 us of host on the
    H100 machine; 1 to 256 rows 3.5-13 us in numpy against 0.4-9 here, on the CPU)."""
    if len(lists) != len(old_lists) or not all(map(is_, lists, old_lists)):
        return None
    widths = list(map(len, lists))
    if widths != old_widths:  # a few rows a step got a block, or none
        for i, (w, old) in enumerate(zip(widths, old_widths)):
            if w != old:
                if w < old:
                    return None
                tables[i, old:w] = lists[i][old:]
    return widths


class DecodeInputs:
    """Fills decode steps' inputs (`fill`), advancing the last step's where it can: that step
    had the same layout and the same requests in the same order, with the same block lists
    (a list is replaced, never rewritten, when a request's blocks are freed: preemption, a
    re-admission), which can only have grown since. Then the padding rows and each table's
    known blocks stand as they are; the columns are computed again whatever the requests'
    positions (a steady batch's step moves each by one, an MTP step by what it kept).
    Anything else fills the layout whole."""

    def __init__(self, block_size: int, dummy_block: int) -> None:
        self.block_size, self.dummy_block = block_size, dummy_block
        self.layout: DecodeLayout | None = None
        self.flat = np.zeros(0, np.int64)  # the last step's inputs
        self.reqs: list = []
        self.lists: list = []  # their block lists, and the widths the last step read of them
        self.widths: list[int] = []
        self.advanced = self.filled = 0  # steps of each kind, for tests and benchmarks

    def fill(self, out: np.ndarray, layout: DecodeLayout, reqs: list) -> None:
        """Step inputs for `reqs` into `out` (a buffer of at least layout.size int64)."""
        lists = [r.block_ids for r in reqs]
        if (layout == self.layout and len(reqs) == len(self.reqs)
                and all(map(is_, reqs, self.reqs))):
            cols, tables = _split(self.flat, layout)
            widths = write_new_blocks(tables, lists, self.lists, self.widths)
            if widths is not None:
                _fill_columns(cols, tables, *_starts_and_ids(reqs), self.block_size)
                self.widths = widths
                out[:layout.size] = self.flat
                self.advanced += 1
                return
        flat = out[:layout.size]
        self.widths = fill_decode_inputs(flat, layout, reqs, self.block_size,
                                         self.dummy_block).tolist()
        self.flat = flat.copy()
        self.layout, self.reqs, self.lists = layout, list(reqs), lists
        self.filled += 1
