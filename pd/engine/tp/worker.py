"""A worker rank of a tensor-parallel node (`pd.engine.tp`): `python -m pd.engine.tp.worker`,
started by its rank 0 (`Workers`), not by hand. It loads its slice of the model, allocates its
share of the KV cache when rank 0 says how big, then runs each call rank 0 sends, captures and
replays the twins of rank 0's graphs, until told to stop."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from contextlib import nullcontext

import torch
import torch.distributed as dist

from pd.config import EngineConfig
from pd.engine.device_check import may_check_products
from pd.engine.kv_cache import KVCache
from pd.engine.tp.channel import INIT_TIMEOUT, context_of, join, rank_device
from pd.engine.tp.mirror import gather_kv, install_kv
from pd.model.context import forward_context
from pd.model.loader import load_model

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when rank 0's ends (PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def worker_main(rank: int, port: int, cfg: EngineConfig) -> None:
    """Rank `rank`: load this rank's slice, allocate its cache when rank 0 says how big, then
    run each call rank 0 sends until it says stop."""
    _die_with_parent()
    device = rank_device(cfg.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_num_threads(1)
    else:  # the node's cores, shared among its ranks
        torch.set_num_threads(max(1, torch.get_num_threads() // cfg.tensor_parallel_size))
    store = dist.TCPStore("127.0.0.1", port, cfg.tensor_parallel_size, is_master=False,
                          timeout=INIT_TIMEOUT)
    channel = join(rank, cfg.tensor_parallel_size, store, device)
    may_check_products(device, cfg.torch_dtype)
    model = load_model(cfg.model, cfg.torch_dtype, device)
    header, _ = channel.recv()
    if header["op"] == "stop":
        return
    kv_cache = KVCache(model.config, header["num_blocks"], cfg.block_size, cfg.torch_dtype, device,
                       spare_blocks=header["spare_blocks"],
                       kv_heads=model.attention_layers()[0].num_kv_heads)
    kv_cache.bind(model.attention_layers())
    model.rotary.cache_positions(header["rope_positions"], device, cfg.torch_dtype)
    log.info("tensor parallel rank %d ready on %s", rank, device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}  # twins of rank 0's graphs, by key
    capturing = None  # (key, graph, its capture context) between capture_begin and _end
    pool = None  # one memory pool for every twin, as rank 0's graphs share one
    with torch.inference_mode():
        while True:
            header, tensors = channel.recv()
            op = header["op"]
            if op == "replay":
                graphs[header["key"]].replay()
                continue
            if op == "stop":
                break
            if op == "capture_begin":
                graph = torch.cuda.CUDAGraph()
                capturing = (header["key"], graph, torch.cuda.graph(graph, pool=pool))
                capturing[2].__enter__()
                continue
            if op == "capture_end":
                key, graph, cm = capturing
                cm.__exit__(None, None, None)
                pool = pool if pool is not None else graph.pool()
                graphs[key] = graph
                capturing = None
                continue
            args = tensors[:header["num_args"]]
            ctx = context_of(header["ctx"], tensors[header["num_args"]:])
            with forward_context(ctx) if ctx is not None else nullcontext():
                if op == "forward":
                    model(*args)
                elif op == "head_logits":
                    model.head_logits(*args)
                elif op == "mtp_forward":
                    model.mtp_forward(*args)
                elif op == "gather_kv":
                    gather_kv(kv_cache.kv, args[0], channel.data)
                elif op == "install_kv":
                    l0, l1 = args[2].tolist()
                    install_kv(kv_cache.kv, args[0], args[1], l0, l1)
                else:
                    raise RuntimeError(f"tensor parallel rank {rank}: unknown call {op!r}")
    # NOTE: graphs first (none still running), then the group, with rank 0 (`Workers.close`)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for graph in graphs.values():
        graph.reset()
    dist.destroy_process_group()
    logging.shutdown()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pd.engine.tp.worker",
                                description="A tensor-parallel worker rank of a pd node (started "
                                            "by the node; not run by hand).")
    p.add_argument("--rank", type=int, required=True, help="this process's rank, 1..N-1")
    p.add_argument("--port", type=int, required=True, help="rank 0's store port on 127.0.0.1")
    p.add_argument("--config", required=True, help="the node's engine config, as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{args.rank} "
                                                   "%(name)s: %(message)s")
    cfg = EngineConfig(**json.loads(args.config))
    worker_main(args.rank, args.port, cfg)


if __name__ == "__main__":
    main()
