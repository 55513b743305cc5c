"""Engine flags shared by every command that runs a model (`pd generate`, `pd prefill`,
`pd decode`): one definition, turned into an `EngineConfig` by `engine_config(args)`."""

from __future__ import annotations

import argparse

from pd.wire import security
from pd.config import EngineConfig, default_model_dir


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
    g.add_argument("--gpu-memory-fraction", type=float, default=0.85,
                   help="fraction of free GPU memory for the KV cache on CUDA (default: 0.85)")
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
    g.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="log level (default: info)")


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
    )


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
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to finish the requests in flight (taking no new "
                        "ones) before ending the rest with an error and exiting (default: 30; "
                        "SIGINT stops at once)")


def announce(role: str, node_id: str, **ports) -> None:
    """Print the one machine-readable line launchers wait for: `PD_READY {json}`."""
    import json
    import sys

    print("PD_READY " + json.dumps({"role": role, "node_id": node_id, **ports}), flush=True)
    sys.stdout.flush()
