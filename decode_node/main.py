"""`pd decode`: run a decode node.

Prefill nodes hand it requests (first token, then KV cache) on --kv-port; it streams every token
to the router that sent the request. Routers reach it on --port for health, load and aborts.
Decoding overlaps the host's work with the device's unless --no-overlap or PD_DISABLE_OVERLAP=1.
"""

from __future__ import annotations

import argparse
import logging
import os

from pd.service.flags import (add_engine_arguments, add_node_arguments, add_role_arguments,
                              announce, engine_config, limit_host_threads)
from pd.service.procs import freeze_heap

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    add_node_arguments(p, default_port=7200)
    add_role_arguments(p, "decode")


def main(args: argparse.Namespace) -> int:
    from pd.config import ModelConfig
    from pd.wire.security import check_bind, configure_from_args

    configure_from_args(args)
    check_bind(args.host, args.insecure)
    cfg = engine_config(args)
    ModelConfig.from_dir(cfg.model)  # a checkpoint pd would compute wrongly: refused here
    # NOTE: imported after the checks: a refusal answers before torch is loaded (2 s)
    from decode_node.node import DecodeNode
    from pd.engine.engine import Engine
    from pd.engine.decode_loop import overlap_disabled_by_env
    from pd.text.tokenizer import Tokenizer

    limit_host_threads(cfg, args.threads)
    overlap = not (args.no_overlap or overlap_disabled_by_env(os.environ))
    engine = Engine(cfg, eos_token_ids=Tokenizer.from_dir(cfg.model).eos_token_ids,
                    num_speculative_tokens=args.num_speculative_tokens)
    node = DecodeNode(
        args.node_id or f"decode-{args.port or os.getpid()}", engine, host=args.host,
        port=args.port, kv_port=args.kv_port, metrics_port=args.metrics_port,
        max_queue=args.max_queue, kv_timeout=args.kv_timeout, overlap=overlap,
        spec_fallback=args.spec_fallback,
        drain_timeout=args.drain_timeout, capture_graphs_tokens=args.cuda_graph_max_tokens)
    announce("decode", node.node_id, port=node.port, kv_addr=node.kv_addr,
             metrics_port=node.probe.port if node.probe else None)
    log.info("decode node %s serving on %s:%d, KV ingest %s", node.node_id, args.host,
             node.port, node.kv_addr)
    freeze_heap()  # the node's own process: its start-up heap stays out of collections
    node.run()
    if engine.runner.rank_failed:
        return 70  # a tensor-parallel rank died (logged)
    return 0
