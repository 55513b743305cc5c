"""One (slots, width) of the MTP step's CUDA graphs (`StepGraphs`, made and kept by
`pd.spec.graphs.SpecGraphs`, whose layout and forward passes they replay): the verify, draft and
advance graphs, the chained step's graph (the three in one replay), the logprobs graphs per
top-k width and the top_logprobs 0 variants of the draft and chained graphs, with the static
buffers they read and write; without capture (CPU) each computes eagerly into the same
attributes. `lp0_columns` reads the top_logprobs 0 pairs those variants pack after the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from pd_kernels.token_logprob import token_logprob
from pd.engine.cuda_graph import LOGPROB_GRAPH_ELEMENTS
from pd.engine.graph import Graph, capture
from pd.engine.host_ring import HostRing
from pd.engine.logprobs import packed_logprobs
from pd.model.context import ForwardContext

if TYPE_CHECKING:
    from pd.spec.graphs import SpecGraphs


def lp0_columns(a: np.ndarray) -> tuple[list[list[float]], list[list[int]]]:
    """The host copy of `StepGraphs.draft(lp0=True)`'s last k + 1 columns (int64, as numpy:
    its views cost a tenth of torch's) -> per slot, its k + 1 rows' token logprobs, and per
    slot their ranks: two conversions for the whole step, no copy (`SpecDecoder.results`
    slices each slot's)."""
    return a.view(np.float32)[:, 0::2].tolist(), a.view(np.int32)[:, 1::2].tolist()


class Verified(NamedTuple):
    hidden: torch.Tensor  # [T, H]
    logits: torch.Tensor  # [T, V] in the model's dtype (widened where a sampler or logprobs need it)
    target: torch.Tensor  # [S, k + 1] int64 (argmax; overwritten for sampled rows)
    context: ForwardContext  # the rows as one-query sequences


class StepGraphs:
    """The graphs of one (S, W) (verify, draft, advance; logprobs per top-k width) and their
    static buffers. Without capture (CPU, where the layout is tested) each computes eagerly into
    the same attributes."""

    def __init__(self, owner: "SpecGraphs", key: tuple[int, int], capture: bool) -> None:
        num_slots, width = key
        self.owner, self.width = owner, width
        self.layout = owner.layout(key)
        host, _ = owner.host_inputs(key)
        self.inputs = host.to(owner.device)
        self.views = {**self.layout.views(self.inputs), **owner.constants(num_slots)}
        self.p_draft = torch.zeros(num_slots, owner.k, device=owner.device)
        self.uniforms = torch.zeros(num_slots, owner.k, device=owner.device)
        self.graphs = None
        self.lp_graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.lp0_graph: tuple[Graph, torch.Tensor] | None = None  # `draft(lp0)`
        self.chain_lp0: tuple[Graph, torch.Tensor] | None = None  # `chain(lp0)`
        self.verified: Verified | None = None
        self.result: torch.Tensor | None = None  # [S, 2k + 4] int64
        # the known part of `inputs` (`Layout.tail` on) as last written (`pd.spec.graphed.KnownPart`)
        self.known = None
        self.known_inputs = self.inputs[self.layout.tail:]  # that part of the device's copy
        self.rings = HostRing(pin=owner.device.type == "cuda")  # `host_buffer`'s
        self.side = None  # `_chain_lp0`'s second stream
        if capture:
            self.side = torch.cuda.Stream(owner.device)
            self._capture()

    def _capture(self) -> None:
        owner, dev = self.owner, self.owner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        snapshot = self.inputs.clone()  # the warm-up of `advance` moves the inputs
        with torch.cuda.stream(side):  # warm-up outside the capture (allocator, kernel loads)
            result = owner._draft(self.views, owner._verify(self.views, self.width), self.p_draft,
                                  self.uniforms, self.width)
            owner._advance(self.views, result)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.inputs.copy_(snapshot)
        verify, draft, advance, chain = Graph(), Graph(), Graph(), Graph()
        with verify.capturing(owner.pool_owner):
            self.verified = owner._verify(self.views, self.width)
        with draft.capturing(owner.pool_owner):
            self.result = owner._draft(self.views, self.verified, self.p_draft, self.uniforms, self.width)
        with advance.capturing(owner.pool_owner):
            owner._advance(self.views, self.result)
        # NOTE: a chained step's three in one replay; captured here, where replaying it would
        # only move padding: a capture on first use warms up first, and its advance would move
        # a live step's inputs once more
        with chain.capturing(owner.pool_owner):
            owner._advance(self.views, self.result)
            verified = owner._verify(self.views, self.width)
            self.result.copy_(owner._draft(self.views, verified, self.p_draft, self.uniforms,
                                           self.width))
        self.graphs = (verify, draft, advance, chain)

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped like `like` for a step's device-to-host copy (`HostRing`)."""
        return self.rings.get(like.shape, like.dtype)

    def verify(self) -> None:
        if self.graphs is not None:
            self.graphs[0].replay()
        else:
            self.verified = self.owner._verify(self.views, self.width)

    def draft(self, lp0: bool = False) -> torch.Tensor | None:
        """The draft chain into `result`. With `lp0` (a step whose rows ask top_logprobs 0) it
        also returns the result followed by each verified row's token logprob and rank
        (`token_logprob`'s int32 pairs: float32 bits, rank; as k + 1 int64 columns) [S, 3k + 5],
        for one host copy (`lp0_columns`): a graph of its own, captured on first use, where the
        logits are small enough to keep (`LOGPROB_GRAPH_ELEMENTS`)."""
        if lp0 and self.graphs is not None and self.verified.logits.numel() <= LOGPROB_GRAPH_ELEMENTS:
            if self.lp0_graph is None:
                self.lp0_graph = capture(self._draft_lp0, self.owner.pool_owner, self.owner.device)
            graph, out = self.lp0_graph
            graph.replay()
            return out
        if self.graphs is not None:
            self.graphs[1].replay()
        else:
            self.result = self.owner._draft(self.views, self.verified, self.p_draft, self.uniforms,
                                            self.width)
        return self._with_lp0(self.result) if lp0 else None

    def _draft_lp0(self) -> torch.Tensor:
        result = self.owner._draft(self.views, self.verified, self.p_draft, self.uniforms, self.width)
        self.result.copy_(result)  # where `advance` reads it
        return self._with_lp0(result)

    def _lp0_output(self, result: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a step's `result` [S, 2k + 4] goes with top_logprobs 0: [S, 3k + 5] int64, the
        result then its k + 1 rows' pairs (`lp0_columns` reads it), and the view of those
        columns as each row's (logprob bits, rank) int32 pair [S, k + 1, 2], where
        `token_logprob` writes them."""
        k1 = self.owner.k + 1
        num_slots, width = result.shape
        out = torch.empty(num_slots, width + k1, dtype=torch.int64, device=result.device)
        return out, out[:, width:].view(torch.int32).view(num_slots, k1, 2)

    def _with_lp0(self, result: torch.Tensor) -> torch.Tensor:
        """The result followed by its k + 1 rows' (logprob bits, rank) int32 pairs, read from
        the accepted columns in place and written in place: one copy and `token_logprob`'s
        kernels."""
        out, pairs = self._lp0_output(result)
        out[:, :result.shape[1]].copy_(result)
        token_logprob(self.verified.logits, result[:, :self.owner.k + 1], int_ranks=True,
                      out=pairs)
        return out

    def logprobs(self, num_top: int) -> torch.Tensor:
        """Raw logprobs of each row's accepted token with `num_top` top columns, from the
        verified logits and the result, packed (`pack_logprobs`) [S * (k + 1), 2 + 2 num_top];
        a graph per `num_top` where the logits are small enough to keep the temporaries
        (`LOGPROB_GRAPH_ELEMENTS`). With no top columns, `pd_kernels.token_logprob`'s one kernel."""
        def packed() -> torch.Tensor:
            accepted = self.result[:, :self.owner.k + 1].clamp(min=0).reshape(-1)
            return packed_logprobs(self.verified.logits.float(), accepted, num_top)

        if self.graphs is None or self.verified.logits.numel() > LOGPROB_GRAPH_ELEMENTS:
            return packed()
        if num_top not in self.lp_graphs:
            self.lp_graphs[num_top] = capture(packed, self.owner.pool_owner, self.owner.device)
        graph, out = self.lp_graphs[num_top]
        graph.replay()
        return out

    def advance(self) -> None:
        """The next step's inputs from this step's result, in place (a chained step)."""
        if self.graphs is not None:
            self.graphs[2].replay()
        else:
            self.owner._advance(self.views, self.result)

    def chain(self, lp0: bool = False) -> torch.Tensor | None:
        """`advance`, `verify` and `draft` in one replay (a chained step; its result in
        `result`; `verified` is not this step's: the logprobs graphs read it). With `lp0` (its
        rows ask top_logprobs 0) it returns what `draft(lp0=True)` returns, from a graph of its
        own captured on first use where the logits are small enough to keep; else three
        replays."""
        if self.graphs is None or (lp0 and self.verified.logits.numel() > LOGPROB_GRAPH_ELEMENTS):
            self.advance()
            self.verify()
            return self.draft(lp0)
        if not lp0:
            self.graphs[3].replay()
            return None
        if self.chain_lp0 is None:
            # NOTE: the capture's warm-up runs this very step (the same KV writes as the
            # replay), then its moved inputs and result are put back for the replay
            saved = self.inputs.clone(), self.result.clone()
            self.chain_lp0 = capture(self._chain_lp0, self.owner.pool_owner, self.owner.device)
            self.inputs.copy_(saved[0])
            self.result.copy_(saved[1])
        graph, out = self.chain_lp0
        graph.replay()
        return out

    def _chain_lp0(self) -> torch.Tensor:
        """`chain(lp0=True)`'s graph. A chained step is greedy without logit processing: the
        tokens it keeps are its verify's argmax (`Verified.target`) up to its kept count, so
        their logprobs need not wait for the acceptance and run on a second stream beside the
        draft chain, a branch of the graph (the host reads the kept columns alone; the pairs
        are those `_with_lp0` computes from the accepted ids, the same kernel on the same
        logits and ids)."""
        owner = self.owner
        owner._advance(self.views, self.result)
        verified = owner._verify(self.views, self.width)
        out, pairs = self._lp0_output(self.result)
        main = torch.cuda.current_stream(self.result.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            token_logprob(verified.logits, verified.target, int_ranks=True, out=pairs)
        result = owner._draft(self.views, verified, self.p_draft, self.uniforms, self.width)
        self.result.copy_(result)
        out[:, :result.shape[1]].copy_(result)
        main.wait_stream(self.side)
        return out
