"""`pd router`: the OpenAI-compatible HTTP front over prefill and decode nodes.

Give the nodes with --prefill and --decode (their control ports); the router pings each one
(health and load), picks a prefill node and a decode node per request by --policy, and streams
the decode node's tokens back as OpenAI responses.
"""

from __future__ import annotations

import argparse

from router.main import build_parser, run


def add_arguments(p: argparse.ArgumentParser) -> None:
    build_parser(p)
    g = p.add_argument_group("nodes")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion accepted (default: the model's context)")
    g.add_argument("--heartbeat-interval", type=float, default=0.5,
                   help="seconds between pings to each node (default: 0.5)")
    g.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="a node silent this long is taken out; its requests end (default: 3)")


def main(args: argparse.Namespace) -> int:
    from pd.service.flags import model_dir
    from pd.wire.security import configure_from_args

    configure_from_args(args)
    args.model = model_dir(args)
    if args.router_workers > 1:
        import logging

        from router.workers import serve_workers

        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            serve_workers(args, args.prefill, args.decode, ready_timeout=60.0, healthy=False,
                          on_ready=lambda pids: logging.getLogger("router").info(
                              "%d router workers (pids %s) serving on http://%s:%d/v1",
                              len(pids), " ".join(map(str, pids)), args.host, args.port))
        except KeyboardInterrupt:
            pass
        return 0
    from router.zmq_backend import make_backend

    run(args, make_backend(args, args.prefill, args.decode))
    return 0
