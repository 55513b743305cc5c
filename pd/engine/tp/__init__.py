"""Tensor parallelism inside a node: the worker ranks, and how they follow rank 0.

A node (or `pd generate`) with `tensor_parallel_size` N > 1 is N processes. Rank 0 is the node
itself: its scheduler, sampler, decode loop and transport run once, there. Ranks 1..N-1 are
worker processes (`python -m pd.engine.tp.worker`, started by `Workers`), each holding its slice
of the weights and of the KV cache (`pd.model.parallel`) and no scheduler. They follow rank 0 by
mirroring its model's calls: each call of rank 0's model (`forward`, `head_logits`,
`mtp_forward`) first sends the call's name, its inputs and the forward context (the step's
batch metadata) to every worker (`Mirror`), then runs; each worker runs the same call on its
slice, meeting rank 0 in the call's collectives (two all-reduces per layer, the vocabulary
gather). What rank 0 samples from the gathered logits is the step's token; the workers keep
nothing of a call but their KV cache writes. Two more calls move KV across the node's edge,
where it travels with all KV heads whatever either side's size: `gather_kv` joins the ranks'
heads of some blocks on rank 0 (before a prefill node sends them), `install_kv` hands each rank
its heads of a received record (on a decode node).

Messages: a call's header is msgpack (op, shapes and dtypes, the context's scalar fields) on the
control group (gloo, host memory); its tensors go packed in one buffer on the data group (gloo
on CPU, NCCL on CUDA). Nothing is pickled; the workers' command lines carry the engine config
as JSON. Rank r runs on `cuda:(i + r)` for a node on `cuda:i`, on the CPU for a CPU node.

A worker that dies takes the node down (`Workers` watches them, logs which one ended, and stops
rank 0's process as Ctrl-C would, ending it outright if that has not within EXIT_GRACE_S): a
node missing a rank cannot compute, and its router routes around a node that is gone. A
worker whose rank 0 dies ends too (its next receive fails; on Linux the kernel also kills it
with its parent).

CUDA graphs: rank 0's graphs (`pd.engine.graph.Graph`) tell the workers when a capture
begins and ends; the calls between are captured there too, each opening with the broadcast of
its packed inputs, so a replay on rank 0 (one REPLAY message to the workers) moves the step's
inputs and meets the twins' collectives on the device, with no other host message.

Not yet: the CUDA IPC KV tier (KV crosses by the ring or ZMQ).

Files: `channel.py` (the messages between ranks, and joining the group), `mirror.py` (rank 0's
side of each call and of KV crossing the node's edge), `workers.py` (rank 0's handle on its
worker processes), `worker.py` (a worker process).
"""

from pd.engine.tp.mirror import Mirror, active
from pd.engine.tp.workers import Workers

__all__ = ["Mirror", "Workers", "active"]
