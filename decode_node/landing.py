"""A decode node's KV landing: an incoming request's KV records installed into its reserved
blocks, its KVDone answered, and the request joining the running batch once its KV is all in
(`Landing`, the part of `decode_node.intake.Intake` from KVAccept on).

A record's copy into this node's blocks (`shm_ipc.kv.install_kv`) runs on side streams (on the
CPU, a thread of its own) and nothing waits for it while the node decodes: the record's ring
space is held until its copy has completed (`KVReceiver.hold`), and a request whose KVDone
arrives while its last copy still runs waits in LANDING until it has (`land`, before every
step), so no step reads blocks being written and no step waits for a transfer. While nothing
is decoding the intake waits for the copies at once. With tensor parallelism each record is
handed out to the ranks by heads (`install_tp`). A direct request (CUDA IPC) has no records:
its KVDone means the prefill node has written its blocks.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from decode_node.incoming import INCOMING_STATES, Incoming, IncomingState
from pd.wire import messages as m
from shm_ipc.kv import block_bytes, install_kv, installed, payload_tensor, record_block_ids
from shm_ipc.records import KVRecord


class Landing:
    """Mixed into `decode_node.intake.Intake`, whose state it shares: `engine`, `receiver`,
    `metrics`, `owner`, `incoming`, `tp`, and its `expect` and `fail`."""

    landing: deque[Incoming]  # LANDING, in KVDone order
    num_kv_records: int  # KV records installed (`on_socket` waits for new ones)

    def land(self, wait: bool = False) -> None:
        """Join the LANDING requests whose copies have completed (in KVDone order), and give
        back the ring space of records whose copies have; `wait` (nothing decodes): for every
        copy first."""
        if wait and (self.landing or self.receiver.num_held):
            kv = self.engine.runner.kv_cache.kv
            installed(kv)
            if self.tp is not None and kv.is_cuda:  # its installs run on this thread's stream
                torch.cuda.current_stream(kv.device).synchronize()
        while self.landing and (self.landing[0].state is not IncomingState.LANDING
                                or self.landing[0].fence.query()):
            inc = self.landing.popleft()
            if inc.state is IncomingState.LANDING:
                self.join_incoming(inc)
        if self.receiver.num_held:
            self.receiver.release()

    def on_kv(self, inc: Incoming, rec: KVRecord) -> None:
        if inc.direct:
            raise m.MessageError(f"KV record for {inc.req.req_id}, whose KV is written directly")
        if rec.block_start + rec.num_blocks > inc.num_blocks - inc.num_cached:
            raise m.MessageError(f"KV record for {inc.req.req_id} beyond its "
                                 f"{inc.num_blocks - inc.num_cached} uncached blocks")
        try:
            if self.tp is not None:
                fence = self.install_tp(rec, inc.req.block_ids[inc.num_cached:])
            else:
                fence = install_kv(rec, self.engine.runner.kv_cache.kv,
                                   inc.req.block_ids[inc.num_cached:], wait=False)
        except ValueError as e:
            raise m.MessageError(str(e)) from None
        if fence is not None:
            inc.fence = fence
            self.receiver.hold(inc.peer, fence, rec.ring_pos)
        inc.num_records += 1
        inc.kv_bytes += rec.payload.nbytes
        self.num_kv_records += 1
        self.metrics.kv_received_bytes(self.receiver.tier(inc.peer)).inc(rec.payload.nbytes)

    def install_tp(self, rec: KVRecord, dst_block_ids: list[int]):
        """Install a record, which carries every KV head, across the tensor-parallel ranks:
        each takes its heads. Its fence (`Mirror.install_kv`): None when done on return."""
        kv = self.engine.runner.kv_cache.kv
        heads = kv.shape[4] * self.tp.size
        whole = torch.empty((*kv.shape[:4], heads, kv.shape[5]), dtype=kv.dtype, device="meta")
        return self.tp.install_kv(kv, payload_tensor(rec, whole), rec.layer_start, rec.layer_end,
                                  record_block_ids(rec, dst_block_ids))

    def on_kv_done(self, peer: bytes, msg: m.KVDone) -> None:
        inc = self.expect(peer, msg.req_id, IncomingState.RECEIVING)
        if not inc.first_token_at:
            raise m.MessageError(f"KVDone for request {msg.req_id!r} before its FIRST_TOKEN")
        if inc.num_records != msg.num_records:
            self.fail(inc, f"KV incomplete: {inc.num_records} of {msg.num_records} records arrived")
            return
        self.receiver.send_control(peer, m.to_dict(m.KVAck(msg.req_id)))
        if inc.fence is not None and not inc.fence.query():
            INCOMING_STATES.move(inc, IncomingState.LANDING)
            self.landing.append(inc)
            return
        self.join_incoming(inc)

    def join_incoming(self, inc: Incoming) -> None:
        """The request's KV is all in its blocks: it joins the running batch."""
        tier = "ipc" if inc.direct else self.receiver.tier(inc.peer)
        if inc.direct:
            kv = self.engine.runner.kv_cache.kv
            inc.kv_bytes = (inc.num_blocks - inc.num_cached) * block_bytes(kv)
            self.metrics.kv_received_bytes(tier).inc(inc.kv_bytes)
        # the transfer starts once the blocks are reserved and the prefill is done
        now = time.perf_counter()
        self.metrics.kv_transfer_seconds(tier).observe(now - max(inc.accepted_at, inc.first_token_at))
        self.metrics.kv_transfer_bytes(tier).observe(inc.kv_bytes)
        del self.incoming[inc.req.req_id]
        INCOMING_STATES.move(inc, IncomingState.JOINED)
        req = inc.req
        req.num_computed_tokens = req.num_prompt_tokens
        # NOTE: the received blocks join the prefix cache from the decode loop's steps, a
        # bounded number of block hashes a step (`pd.engine.prefix.HASHES_PER_STEP`): a burst
        # of requests joining at once does not stall every stream while their prompts hash
        req.num_registered_blocks = inc.num_cached
        self.owner.join(req, inc.reply_to)
        self.metrics.join_seconds.observe(now - inc.first_token_at)
