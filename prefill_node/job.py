"""A request at the prefill node (`Job`): its state from arrival to the decode node's KVAck
(`JobState`, transitions in `JOB_STATES`), and what of its KV has gone."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pd.engine.request import Req
from pd.service.states import Transitions
from pd.wire import messages as m

if TYPE_CHECKING:
    from prefill_node.link import DecodeLink


class JobState(enum.Enum):
    QUEUED = "queued"  # waiting for or in its prefill; the decode node does not know of it
    ANNOUNCED = "announced"  # in its prefill, RequestMeta sent (the decode node reserves blocks)
    HANDED_OFF = "handed_off"  # first token sent, waiting for KVAccept
    KV_SENT = "kv_sent"  # KV in flight, waiting for KVAck
    DONE = "done"


JOB_STATES = Transitions({
    JobState.QUEUED: (JobState.ANNOUNCED, JobState.HANDED_OFF, JobState.DONE),
    JobState.ANNOUNCED: (JobState.HANDED_OFF, JobState.DONE),
    JobState.HANDED_OFF: (JobState.KV_SENT, JobState.DONE),
    JobState.KV_SENT: (JobState.DONE,),
    JobState.DONE: (),
})
PREFILLING = (JobState.QUEUED, JobState.ANNOUNCED)  # in this node's scheduler
AT_DECODE = (JobState.ANNOUNCED, JobState.HANDED_OFF, JobState.KV_SENT)  # the decode node knows of it


@dataclass(eq=False)
class Job:
    msg: m.PrefillRequest
    req: Req
    deadline: float
    state: JobState = JobState.QUEUED
    link: DecodeLink | None = None
    arrival: float = field(default_factory=time.monotonic)
    kv_started: float = 0.0
    kv_bytes: int = 0  # KV bytes sent for it
    accept: m.KVAccept | None = None  # the decode node's, come while it was ANNOUNCED
    kv_sent: int = 0  # prompt blocks sent (`DecodeLink.send_kv`; parts go during the prefill)
    kv_records: int = 0
    kv_chunk: object = None  # copy event of its last direct part
    kv_ready: object = None  # CUDA: event after the last step that computed its KV
