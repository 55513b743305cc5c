"""Prefix caching: the content hash of each full KV block of a request, and the bookkeeping that
finds a request's cached prefix and registers its newly computed blocks.

A block's hash chains its parent's hash with its own tokens, so equal hashes mean equal prefixes
from position 0 (a 128-bit BLAKE2b, the same in every process: prefill and decode nodes of one
model agree on them). The root is the model's fingerprint, so caches of different models never
agree by accident. With MTP the MTP layer's KV at a block's last position was computed from the
token after it (`pd.spec.mtp`), so that token is hashed with the block (`lookahead`): a block is
hashable, and cacheable, once that token is known.

The blocks themselves (reference counts, parked blocks, eviction) are `allocator.py`'s.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from pd.engine.allocator import BlockAllocator
from pd.engine.request import Req

# block hashes a decode step computes for its requests' prompt blocks (`PrefixCache.register`
# with `bounded`): 64 requests joining a batch at once with 512-token prompts hashed their 2,048
# blocks in one step's processing (3.2 ms of hashing alone on the development CPU; on the H100
# host the step after such a join took 5.4-7.4 ms against a 1.7 ms step); at 128 a step they are
# registered over 16 steps
HASHES_PER_STEP = 128


def root_hash(fingerprint: str) -> int:
    return int.from_bytes(hashlib.blake2b(fingerprint.encode(), digest_size=16).digest(), "little")


def chain_hashes(token_ids, block_size: int, root: int, lookahead: int = 0,
                 prev: list[int] | None = None, limit: int | None = None) -> list[int]:
    """The hashes of every full block of `token_ids` (the first `limit` blocks, when given),
    extending `prev`, the hashes of its first blocks already known."""
    hashes = list(prev or [])
    parent = (hashes[-1] if hashes else root).to_bytes(16, "little")
    first, end = len(hashes), (len(token_ids) - lookahead) // block_size
    if limit is not None:
        end = min(end, limit)
    if end <= first:
        return hashes
    # NOTE: the tokens as bytes once (8 per token), each block a slice of them: a prompt of
    # 8k tokens hashes in 80% of the time it took building an array per block
    data = memoryview(array("q", token_ids[first * block_size:end * block_size + lookahead]).tobytes())
    span, step = (block_size + lookahead) * 8, block_size * 8
    for i in range(end - first):
        parent = hashlib.blake2b(parent + data[i * step:i * step + span], digest_size=16).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


@dataclass
class PrefixStats:
    """Prompt tokens looked up in the cache, and found there (`pd_prefix_cache_*_total`)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, fingerprint: str,
                 lookahead: int = 0) -> None:
        self.allocator, self.block_size, self.lookahead = allocator, block_size, lookahead
        self.root = root_hash(f"{fingerprint}|block_size={block_size}|lookahead={lookahead}")
        self.stats = PrefixStats()
        self.left = HASHES_PER_STEP  # block hashes left to this step (`new_step`, `register`)

    def hashes(self, req: Req, limit: int | None = None) -> list[int]:
        """The request's block hashes, extended to its tokens so far (to its first `limit`
        blocks at least, when given)."""
        want = (req.num_tokens - self.lookahead) // self.block_size
        if limit is not None:
            want = min(want, limit)
        if want > len(req.block_hashes):
            req.block_hashes = chain_hashes(req.token_ids, self.block_size, self.root,
                                            self.lookahead, req.block_hashes, want)
        return req.block_hashes

    def match(self, req: Req, max_blocks: int) -> list[int]:
        """The cached blocks of the request's longest cached prefix, at most `max_blocks` (not
        taken yet: the caller shares them once it admits the request)."""
        # NOTE: hashed only as far as the cache holds the prompt, in doubling steps: a prompt
        # the cache misses costs a hash or two here, before its step is launched; the rest
        # are hashed while the device runs that step (`DecodeLoop.launch`; 0.6 ms of an
        # 8k-token prompt's host time)
        limit = min(max(0, max_blocks), (req.num_tokens - self.lookahead) // self.block_size)
        n, step = 0, 1
        while True:
            n = min(limit, max(n + step, len(req.block_hashes)))
            blocks = self.allocator.match(self.hashes(req, n)[:n])
            if len(blocks) < n or n >= limit:
                return blocks
            step *= 2

    def count(self, req: Req, num_hit_blocks: int) -> None:
        """Count one lookup of the request's prompt in `stats`."""
        self.stats.queries += req.num_prompt_tokens
        self.stats.hits += min(num_hit_blocks * self.block_size, req.num_prompt_tokens)

    def new_step(self) -> None:
        """A decode step's processing begins: its budget of block hashes is whole again."""
        self.left = HASHES_PER_STEP

    def register(self, req: Req, bounded: bool = False) -> None:
        """Register the request's full blocks whose KV is now computed; with `bounded` (a
        decode step's requests) only as many as the step's hashes left allow, the rest in the
        steps after (the decode loops call again while a prompt block is due)."""
        done = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if bounded and done > len(req.block_hashes):
            known = len(req.block_hashes)
            more = min(done - known, self.left)
            self.left -= more
            done = known + more
        if done <= req.num_registered_blocks:
            return
        hashes = self.hashes(req, done)
        first, end = req.num_registered_blocks, min(done, len(hashes))
        self.allocator.register_all(req.block_ids[first:end], hashes[first:end])
        req.num_registered_blocks = end
