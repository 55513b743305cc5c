"""Every flag of the commands that run a model, defined once.

Engine flags (`pd generate`, `pd prefill`, `pd decode`, `pd launch`) become an `EngineConfig`
through `engine_config(args)`. Node flags are one table, `NODE_FLAGS`: each flag's default,
help and the roles it belongs to. `pd prefill` and `pd decode` add their role's flags with
`add_role_arguments`, `pd launch` adds those it passes on to its nodes, and the node classes take
their keyword defaults from `default(name, role)`, so a default is written in one place.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace

from pd.config import EngineConfig, default_model_dir
from pd.wire import security


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory (config.json, *.safetensors, tokenizer files); "
                        "default: the embedded pd-tiny-code model")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights and KV dtype (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks to allocate (default: from --kv-cache-memory on CPU, "
                        "--gpu-memory-fraction on CUDA)")
    g.add_argument("--kv-cache-memory", type=float, default=256,
                   help="KV cache size in MiB on CPU when --num-blocks is not given (default: 256)")
    g.add_argument("--gpu-memory-fraction", "--gpu-memory-utilization", type=float, default=0.85,
                   dest="gpu_memory_fraction",
                   help="fraction of free GPU memory for the KV cache on CUDA (default: 0.85; "
                        "vLLM's --gpu-memory-utilization is the same flag)")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most requests in one step (default: 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step; longer prompts are prefilled in chunks (default: 2048)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length limit (default: the model's context, max_position_embeddings "
                        "stretched by a linear, dynamic or yarn RoPE factor)")
    g.add_argument("--num-speculative-tokens", type=int, default=0, choices=range(0, 5),
                   metavar="K", help="MTP draft tokens verified per step, 0..4 (default: 0 = off; "
                                     "needs a checkpoint with an MTP layer)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep full KV blocks after their request ends and share them by content: "
                        "a prompt starts after its longest cached prefix, and a decode node "
                        "receives only the blocks it does not hold (default: on; "
                        "--no-enable-prefix-caching turns it off)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="run the model on N ranks, one process each (one GPU each on CUDA: rank r "
                        "on cuda:i+r for --device cuda:i; the CPU's cores on CPU), each holding "
                        "1/N of the heads, the MLP and the KV cache; N must divide the attention "
                        "heads, the KV heads and the intermediate size. A prefill node and a "
                        "decode node may have different N: KV crosses with every head "
                        "(default: 1)")
    g.add_argument("--threads", type=at_least_one("threads"), default=None, metavar="N",
                   help="torch's host threads of a process that runs the model (under `pd "
                        "launch`: of each node; default: 1 on CUDA, where a step's host tensors "
                        "are small; every core on CPU, where `pd launch` shares the cores out "
                        "among its nodes: threads spinning on a core another process holds cost "
                        "more than they compute)")
    g.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="log level (default: info)")


def at_least_one(noun: str):
    """An argparse type: a count of 1 or more (`--threads`, the router's `--router-workers`),
    else an error naming what it counts."""
    def count(value: str) -> int:
        if not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number of {noun} (1 or more)")
        return int(value)

    return count


def model_dir(args: argparse.Namespace) -> str:
    return str(args.model) if args.model else str(default_model_dir())


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=model_dir(args),
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=int(args.kv_cache_memory * 2**20),
        gpu_memory_fraction=args.gpu_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enforce_eager=getattr(args, "enforce_eager", False),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
    )


def limit_host_threads(cfg: EngineConfig, threads: int | None = None) -> None:
    """torch's host threads (`--threads`): as given, else one on a GPU (its host tensors are a
    step's inputs, and waking torch's thread pool for them costs more than it saves: a
    40,960-int copy took 2 ms on the H100 host's 16 threads, 13 us on one), else every core.
    Given or one, OMP_NUM_THREADS says it too, so tensor-parallel workers this process starts
    share the same cores."""
    if threads is None and not cfg.device.startswith("cuda"):
        return
    import torch  # noqa: PLC0415 (this module is imported before torch is needed)

    os.environ["OMP_NUM_THREADS"] = str(threads or 1)
    torch.set_num_threads(threads or 1)


def add_node_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
    g = p.add_argument_group("service")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1; use 0.0.0.0 to serve other hosts)")
    g.add_argument("--port", type=int, default=default_port,
                   help=f"control port for routers, ZMQ (default: {default_port}; 0 = any free port)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP port for /metrics and /health (default: none; 0 = any free port)")
    g.add_argument("--node-id", default=None, help="name in logs and metrics (default: role-port)")
    security.add_arguments(g)
    g.add_argument("--insecure", action="store_true",
                   help="serve plain ZMQ sockets on a --host other machines can reach (without "
                        "it, such a node refuses to start unless given --curve-keys)")


@dataclass(frozen=True)
class NodeFlag:
    name: str  # the argparse dest; the flag is --name-with-dashes
    default: object  # one value, or {role: value} where the roles differ
    help: str  # "%(default)s" names the default
    roles: tuple[str, ...]  # "prefill", "decode"
    type: type | None = None
    choices: tuple = ()
    action: str | None = None
    in_launch: bool = True  # pd launch passes it on (flags it owns itself say False)

    def default_for(self, role: str):
        return self.default[role] if isinstance(self.default, dict) else self.default


NODE_FLAGS = (
    NodeFlag("drain_timeout", 30.0, "on SIGTERM, seconds to finish the requests in flight "
             "(taking no new ones) before ending the rest with an error and exiting (default: "
             "%(default)s; SIGINT stops at once)", ("prefill", "decode"), float),
    NodeFlag("transport", os.environ.get("PD_KV_TRANSPORT", "auto"),
             "KV transport to decode nodes: ipc (CUDA IPC: written into the decode node's "
             "GPU blocks, same host, both on GPUs; records still through the ring), shm "
             "(shared-memory ring, same host), zmq (frames over TCP), auto (ipc when the "
             "decode node offers it, else shm on this host, else zmq); env PD_KV_TRANSPORT "
             "(default: %(default)s)", ("prefill",), choices=("auto", "ipc", "shm", "zmq")),
    NodeFlag("max_queue", {"prefill": 1024, "decode": 4096},
             "requests held at once (prefill: queued, prefilling, handing off; decode: being "
             "handed over); more are refused (default: %(default)s)", ("prefill", "decode"), int,
             in_launch=False),
    NodeFlag("queue_timeout", 60.0, "seconds a request may wait for its prefill before it "
             "fails (default: %(default)s)", ("prefill",), float),
    NodeFlag("handoff_timeout", 30.0, "seconds from the first token until the decode node has "
             "the KV (default: %(default)s)", ("prefill",), float),
    NodeFlag("kv_port", 7201, "port where prefill nodes send requests and KV (default: "
             "%(default)s; 0 = any)", ("decode",), int, in_launch=False),
    NodeFlag("kv_timeout", 30.0, "seconds a handed-over request may wait for free blocks, its "
             "first token and its KV before it fails (announced as its prefill starts, a "
             "request waits here for the rest of that prefill too) (default: %(default)s)",
             ("decode",), float),
    NodeFlag("no_overlap", False, "run the plain decode loop (wait for each step before "
             "scheduling the next) instead of the overlap scheduler; PD_DISABLE_OVERLAP=1 does "
             "the same", ("decode",), action="store_true"),
    NodeFlag("cuda_graph_max_tokens", 4096, "CUDA: before serving, capture the decode step "
             "graphs of every batch size for sequences of up to this many tokens (longer ones "
             "are captured when first met, a stall of the running batch); 0 = capture each on "
             "first use (default: %(default)s)", ("decode",), int),
    NodeFlag("cuda_graph_prefill_tokens", 256, "CUDA: before serving, capture the prefill "
             "step graphs of steps of up to this many prompt tokens (one prompt, or several "
             "together); larger steps are captured when first met, a stall of the waiting "
             "requests; 0 = capture each on first use (default: %(default)s)", ("prefill",), int),
    NodeFlag("spec_fallback", "auto", "with MTP: run plain decode steps for batch sizes where "
             "they measure faster than MTP steps (auto: on CUDA; on, off) (default: %(default)s)",
             ("decode",), choices=("auto", "on", "off")),
)
_BY_NAME = {f.name: f for f in NODE_FLAGS}


def default(name: str, role: str):
    """The default of node flag `name` for `role` (what the node classes take)."""
    return _BY_NAME[name].default_for(role)


def _add(group, flag: NodeFlag, role: str) -> None:
    kw = dict(default=flag.default_for(role), help=flag.help)
    if flag.action:
        kw["action"] = flag.action
    else:
        kw["type"] = flag.type or str
    if flag.choices:
        kw["choices"] = flag.choices
    group.add_argument("--" + flag.name.replace("_", "-"), **kw)


def add_role_arguments(p: argparse.ArgumentParser, role: str) -> None:
    """The node flags of `role` ("prefill" or "decode")."""
    g = p.add_argument_group(role)
    for flag in NODE_FLAGS:
        if role in flag.roles:
            _add(g, flag, role)


def add_launch_arguments(group) -> None:
    """The node flags `pd launch` passes on to its nodes (`launch_flags`)."""
    for flag in NODE_FLAGS:
        if flag.in_launch:
            role = flag.roles[0]
            kw_help = flag.help if len(flag.roles) > 1 else f"{role} nodes: {flag.help}"
            _add(group, replace(flag, help=kw_help), role)


def launch_flags(role: str) -> tuple[str, ...]:
    """The names of the flags `pd launch` passes on to its nodes of `role`."""
    return tuple(f.name for f in NODE_FLAGS if f.in_launch and role in f.roles)


def announce(role: str, node_id: str, **ports) -> None:
    """Print the one machine-readable line launchers wait for: `PD_READY {json}`."""
    import json
    import sys

    print("PD_READY " + json.dumps({"role": role, "node_id": node_id, **ports}), flush=True)
    sys.stdout.flush()
