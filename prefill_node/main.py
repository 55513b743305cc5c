"""`pd prefill`: run a prefill node.

It takes PrefillRequests from routers on --port, prefills them in batches (chunked under
--max-num-batched-tokens), and hands each request with its first token and KV cache to the
decode node the router named: through a shared-memory ring when that node is on this host,
through ZMQ frames otherwise (--transport).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pd.service.flags import (add_engine_arguments, add_node_arguments, add_role_arguments,
                              announce, engine_config, limit_host_threads)
from pd.service.procs import freeze_heap

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    add_node_arguments(p, default_port=7100)
    add_role_arguments(p, "prefill")


def main(args: argparse.Namespace) -> int:
    from pd.config import ModelConfig
    from pd.wire.security import check_bind, configure_from_args

    configure_from_args(args)
    check_bind(args.host, args.insecure)
    cfg = engine_config(args)
    if args.transport == "ipc" and cfg.tensor_parallel_size > 1:
        print("pd prefill: error: --transport ipc writes into one cache; a node with "
              "--tensor-parallel-size > 1 sends KV by the ring (shm) or zmq", file=sys.stderr)
        return 2
    ModelConfig.from_dir(cfg.model)  # a checkpoint pd would compute wrongly: refused here
    # NOTE: imported after the checks: a refusal answers before torch is loaded (2 s)
    from pd.engine.engine import Engine
    from pd.text.tokenizer import Tokenizer
    from prefill_node.node import PrefillNode

    limit_host_threads(cfg, args.threads)
    engine = Engine(cfg, eos_token_ids=Tokenizer.from_dir(cfg.model).eos_token_ids,
                    num_speculative_tokens=args.num_speculative_tokens)
    node = PrefillNode(
        args.node_id or f"prefill-{args.port or os.getpid()}", engine, host=args.host,
        port=args.port, metrics_port=args.metrics_port, transport=args.transport,
        max_queue=args.max_queue, queue_timeout=args.queue_timeout,
        handoff_timeout=args.handoff_timeout, drain_timeout=args.drain_timeout,
        capture_graphs_tokens=args.cuda_graph_prefill_tokens)
    announce("prefill", node.node_id, port=node.port,
             metrics_port=node.probe.port if node.probe else None)
    log.info("prefill node %s serving on %s:%d", node.node_id, args.host, node.port)
    freeze_heap()  # the node's own process: its start-up heap stays out of collections
    node.run()
    if engine.runner.rank_failed:
        return 70  # a tensor-parallel rank died (logged)
    return 0
