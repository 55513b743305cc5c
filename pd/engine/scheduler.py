"""The step scheduler: plain Python over `Req` objects, no tensors.

Each step takes running requests first (each needs `num_tokens - num_computed_tokens` tokens,
one when decoding), then admits waiting ones while the token budget, `max_num_seqs` and free
blocks allow, chunking long prompts. When a running request needs a block and none is free, the
most recently admitted running request is preempted by recompute: its blocks are freed and it
goes back to the head of the queue with its output kept, so it later re-prefills prompt + output
and continues where it was. With prefix caching (`prefix`), a request admitted with nothing
computed starts after its longest cached prefix (shared blocks, at least one token left to
compute); each step registers the prompt's full blocks it completed, and a request leaving the
batch (finished, aborted, preempted) the blocks its decoding filled, all at once: hashing a
block as it fills cost a decode step ~10 us per request that crossed one. The runner
(tensors) and the engine loop are elsewhere.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from pd.engine.allocator import BlockAllocator
from pd.engine.prefix import PrefixCache
from pd.engine.request import FinishReason, Req, ReqStatus

log = logging.getLogger(__name__)


def prompt_block_due(req: Req, block_size: int) -> bool:
    """Whether a full block holding prompt tokens waits to be registered: a running request's
    prompt blocks are registered as they fill (requests sharing the prompt find them at once),
    the blocks its decoding fills when it leaves the batch (`Scheduler.finish`, `_preempt`).
    NOTE: the decode loops inline it (a call per request per step)."""
    done = req.num_registered_blocks * block_size
    return req.num_computed_tokens >= done + block_size and done < len(req.prompt_token_ids)


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    num_new_tokens: list[int]  # tokens computed this step, per request

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether request i catches up this step and so samples its next token (with draft
        tokens, the step runs past `num_tokens`: it verifies them)."""
        req = self.reqs[i]
        return req.num_computed_tokens + self.num_new_tokens[i] >= req.num_tokens


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 num_lookahead_slots: int = 0, prefix: PrefixCache | None = None) -> None:
        self.allocator = allocator
        self.prefix = prefix
        # NOTE: with MTP, blocks are held this many positions past a step's last token, where
        # the drafter writes its chained drafts' KV.
        self.num_lookahead_slots = num_lookahead_slots
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_preemptions = 0

    # -- intake ------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        if req.num_prompt_tokens == 0:
            raise ValueError(f"request {req.req_id}: empty prompt")
        if req.num_tokens >= self.max_model_len:
            raise ValueError(
                f"request {req.req_id}: {req.num_tokens} tokens do not fit the model's context "
                f"of {self.max_model_len} (at least one must be generated)"
            )
        if self.blocks_needed(req, req.num_tokens + 1) > self.allocator.num_blocks:
            raise ValueError(
                f"request {req.req_id}: {req.num_tokens} tokens need more KV blocks than the "
                f"cache has ({self.allocator.num_blocks})"
            )
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def add_running(self, req: Req) -> None:
        """Join a request whose KV is already in its blocks (a decode node after KV import)."""
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, req: Req, num_slots: int) -> int:
        return -(-num_slots // self.block_size) - len(req.block_ids)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self, skip: frozenset = frozenset()) -> ScheduledBatch | None:
        """The next step's batch. Running requests in `skip` sit this step out (the decode
        loop's requests that the step in flight is sure to finish)."""
        budget = self.max_num_batched_tokens
        reqs: list[Req] = []
        counts: list[int] = []
        preempted = False
        i = 0
        # NOTE: a decode step's loop runs per request: locals, no property or method calls
        # where a request needs no block (most steps of most requests)
        bs, lookahead = self.block_size, self.num_lookahead_slots
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req in skip:
                i += 1
                continue
            computed, drafts = req.num_computed_tokens, req.spec_token_ids
            n = min(len(req.token_ids) + len(drafts) - computed, budget)
            if drafts:  # drafts that do not fit the budget are dropped
                del drafts[max(0, n - (len(req.token_ids) - computed)):]
            need = -(-(computed + n + lookahead) // bs) - len(req.block_ids)  # `blocks_needed`
            if need > 0:
                while need > self.allocator.num_free:
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if req.status is not ReqStatus.RUNNING:
                    break  # it preempted itself: nothing after it is left either
                req.block_ids += self.allocator.allocate(need)
            reqs.append(req)
            counts.append(n)
            budget -= n
            i += 1
        while (self.waiting and not preempted and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            hit = self.cached_prefix(req)
            start = req.num_computed_tokens + len(hit) * self.block_size
            n = min(req.num_tokens - start, budget)
            need = self.blocks_needed(req, start + n + self.num_lookahead_slots) - len(hit)
            if need + self.allocator.share_cost(hit) > self.allocator.num_free:
                break
            self.waiting.popleft()
            if self.prefix is not None and not req.num_computed_tokens:
                self.prefix.count(req, len(hit))
            if hit:
                self.allocator.share(hit)
                req.block_ids, req.num_computed_tokens = hit, start
                req.num_registered_blocks = len(hit)
            req.block_ids += self.allocator.allocate(need)
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            reqs.append(req)
            counts.append(n)
            budget -= n
        if not reqs:
            return None
        return ScheduledBatch(reqs, counts)

    def cached_prefix(self, req: Req) -> list[int]:
        """The cached blocks a waiting request with nothing computed can start from (leaving
        at least its last token to compute, which samples the next one)."""
        if (self.prefix is None or req.num_computed_tokens or req.block_ids
                or req.params.prompt_logprobs is not None):  # every prompt position is needed
            return []
        return self.prefix.match(req, (req.num_tokens - 1) // self.block_size)

    def register(self, req: Req) -> None:
        """Put the request's newly completed full blocks in the prefix cache."""
        if self.prefix is not None:
            self.prefix.register(req)

    def register_prompt(self, req: Req) -> None:
        """`register` while a block holding prompt tokens is due (`prompt_block_due`)."""
        if self.prefix is not None and prompt_block_due(req, self.prefix.block_size):
            self.prefix.register(req)

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self.register(req)  # what its decoding filled, kept for its recompute
        self.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        log.debug("preempted %s (recompute %d tokens)", req.req_id, req.num_tokens)

    def update(self, batch: ScheduledBatch, sampled: dict[int, tuple]) -> list[Req]:
        """Advance the batch: `sampled[i]` is (token_id, logprob, rank, top) for each request
        index that sampled. Returns the requests that finished this step."""
        finished = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.num_new_tokens)):
            if req.status is not ReqStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += n
            self.register_prompt(req)
            if i not in sampled:
                continue
            req.append_token(*sampled[i])
            reason = req.check_stop(self.max_model_len)
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
        return finished

    def update_spec(self, batch: ScheduledBatch, results: dict, finish=None) -> list[Req]:
        """Advance the batch after a speculative step: `results[i]` (a `SpecResult`) holds the
        kept tokens of each request index that sampled, its finish reason (found inside the
        accepted run) and its next drafts. Returns the requests that finished this step.
        `finish(req, reason)` ends a request instead of `self.finish` (the decode loop's, when
        a launched step still holds it)."""
        finish = finish or self.finish
        finished = []
        prefix, running, max_len = self.prefix, ReqStatus.RUNNING, self.max_model_len
        if prefix is not None:
            prefix.new_step()
        # NOTE: per request every step: locals, no property calls; the prefix cache is called
        # once a prompt block fills (`prompt_block_due`, inlined)
        for i, (req, n) in enumerate(zip(batch.reqs, batch.num_new_tokens)):
            if req.status is not running:
                continue  # aborted while the step ran
            res = results.get(i)
            if res is None:
                req.num_computed_tokens += n
                self.register_prompt(req)
                continue
            ids = req.token_ids
            req.extend_tokens(res.token_ids, res.logprobs)
            # The target's KV holds every kept token but the newest one.
            req.num_computed_tokens = computed = len(ids) - 1
            if prefix is not None:
                done = req.num_registered_blocks * prefix.block_size
                if computed >= done + prefix.block_size and done < len(req.prompt_token_ids):
                    prefix.register(req, bounded=True)
            reason = res.finish_reason
            if reason is None and req.grammar is not None and req.grammar.terminated:
                reason = FinishReason.STOP  # its stop token taken with ignore_eos, or refused
            if reason is not None:
                req.spec_token_ids = []
                finish(req, reason)
                finished.append(req)
                continue
            room = min(len(req.prompt_token_ids) + req.params.max_tokens, max_len) - len(ids)
            req.spec_token_ids = res.drafts[:max(0, room - 1)]  # a slice: the request's own list
        return finished

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End a request wherever it is; frees its blocks unless the caller holds them."""
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
            self.register(req)  # what its decoding filled (its KV up to num_computed_tokens)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        if not req.hold_blocks_on_finish:
            self.free_blocks(req)

    def detach(self, req: Req) -> None:
        """Take a running request out of the scheduler, keeping its blocks (a prefill node
        hands it to a decode node, and frees the blocks once the KV has been taken)."""
        self.running.remove(req)
        req.status = ReqStatus.FINISHED

    def free_blocks(self, req: Req) -> None:
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []

    def abort(self, req: Req) -> None:
        if not req.is_finished:
            self.finish(req, FinishReason.ABORT)
