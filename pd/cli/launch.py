"""`pd launch`: router + prefill nodes + decode nodes on this host, in one command.

Checks that --host:--port is free, starts --num-decode decode nodes and --num-prefill prefill
nodes at once as child processes on free ports (bound to 127.0.0.1), printing a line for each as
it comes up, then serves the router in this process on --host:--port. When every node answers
its heartbeat it prints the URL and a curl line. Ctrl-C (or SIGTERM) stops the
router and every node, which remove their shared-memory segments on the way out. Model and
engine flags go to every node, and each node flag of `pd.service.flags.NODE_FLAGS` to the nodes
of its role (--transport, --queue-timeout, --handoff-timeout to prefill nodes; --kv-timeout,
--no-overlap to decode nodes; --drain-timeout to both). A checkpoint pd would compute wrongly
is refused before any node starts. Every node serves /metrics and /health on a free port of its own,
printed on its `node ...` line (`metrics HOST:PORT`); the router's are at the router's URL.
On the way out every node gets SIGTERM at once and --drain-timeout to end what it still runs.
Without --curve-keys (and unless --insecure), the router and nodes use CURVE keys made for this
launch alone in a 0700 temporary directory, removed at the end: no other local user can reach a
node's ZMQ sockets.
The router takes a node out when its connection drops, or when it leaves pings unanswered for
--heartbeat-timeout (longer on CPU, where one prefill step can take seconds).
With --mps (CUDA) the nodes run as clients of an MPS daemon of this launch alone
(`pd.service.mps`), started before them and stopped after them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from pd.service.flags import add_engine_arguments, add_launch_arguments, launch_flags, model_dir

log = logging.getLogger("pd.cli.launch")

ENGINE_FLAGS = ("dtype", "device", "block_size", "num_blocks", "kv_cache_memory",
                "gpu_memory_fraction", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                "log_level", "num_speculative_tokens", "enforce_eager", "enable_prefix_caching",
                "tensor_parallel_size", "threads")
NEGATABLE = ("enable_prefix_caching",)  # on by default: passed on as --no-... when off


def add_arguments(p: argparse.ArgumentParser) -> None:
    from router.main import add_router_arguments

    add_engine_arguments(p)
    g = p.add_argument_group("launch")
    g.add_argument("--num-prefill", type=int, default=1, help="prefill nodes to start (default: 1)")
    g.add_argument("--num-decode", type=int, default=1, help="decode nodes to start (default: 1)")
    g.add_argument("--mps", action="store_true",
                   help="CUDA: run the nodes under an MPS daemon of this launch alone (its own "
                        "pipe directory; stopped with the launch), so that prefill and decode "
                        "nodes sharing a GPU run their kernels at once instead of taking turns: "
                        "a prefill no longer stretches the decode steps behind it (the "
                        "inter-token tail). Leave it off where the host already runs MPS: the "
                        "nodes join that one")
    g.add_argument("--prefill-sm-percent", type=int, default=None, metavar="PCT",
                   help="with --mps: the share of the GPU's multiprocessors each prefill node "
                        "may run its kernels on (1-100; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in its "
                        "environment alone), so that a long prefill leaves the rest to the decode "
                        "steps beside it (default: all of them)")
    g.add_argument("--prefill-low-priority", action="store_true",
                   help="with --mps: each prefill node an MPS client of below-normal priority "
                        "(CUDA_MPS_CLIENT_PRIORITY=1 in its environment alone), the decode "
                        "nodes' of normal priority: a hint to the GPU to schedule a decode step's "
                        "kernels ahead of a prefill's running beside it (default: every node "
                        "normal)")
    g.add_argument("--prefill-num-blocks", type=int, default=None,
                   help="KV blocks of each prefill node, when they should differ from the decode "
                        "nodes' --num-blocks (a prefill node holds only prompts in flight and its "
                        "prefix cache) (default: --num-blocks)")
    g.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="ranks of each prefill node, when they should differ from the decode "
                        "nodes' --tensor-parallel-size (default: --tensor-parallel-size)")
    g.add_argument("--prefill-max-num-batched-tokens", type=int, default=None,
                   help="tokens one step of each prefill node may compute, when it should differ "
                        "from the decode nodes' --max-num-batched-tokens: where prefill and decode "
                        "share a GPU, a smaller budget keeps each prefill step short, and with it "
                        "the decode steps it holds up (default: --max-num-batched-tokens)")
    add_launch_arguments(p.add_argument_group("nodes"))
    g.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="router: seconds a node may leave a heartbeat unanswered before it is "
                        "taken out and its requests end (default: 3 on CUDA, 10 on CPU, where one "
                        "prefill step of a large batch takes seconds and no ping is answered "
                        "during a step)")
    g.add_argument("--ready-timeout", type=float, default=120.0,
                   help="seconds to wait for every node to come up")
    g.add_argument("--insecure", action="store_true",
                   help="plain ZMQ sockets: without --curve-keys, pd launch otherwise makes CURVE "
                        "keys for this launch alone (in a 0700 temporary directory) so that no "
                        "other local user can reach its nodes' sockets")
    add_router_arguments(p.add_argument_group("router"), with_nodes=False)


def node_args(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name)
        if value is True:
            out.append(f"--{name.replace('_', '-')}")
        elif value is False and name in NEGATABLE:
            out.append(f"--no-{name.replace('_', '-')}")
        elif value is not None and value is not False:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def cpu_share(num_nodes: int) -> int:
    """Each of `num_nodes` CPU nodes' torch threads: this process's cores shared out (at least
    one). On 2 cores, a prefill and a decode node on one thread each served 810-812 output
    tokens/s against 544-670 with both nodes on both cores (`benchmarks/bench_serving.py`, the
    embedded model, concurrency 16): a decode step's threads waited on the one another process
    had taken off its core."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, num_nodes))


def prefill_mps_env(mps_env: dict | None, percent: int | None,
                    low_priority: bool = False) -> dict | None:
    """A prefill node's environment under the launch's MPS daemon: limited to `percent` of the
    GPU's multiprocessors where given, a client of below-normal priority with `low_priority`
    (the MPS client's own settings, read when its CUDA context starts)."""
    if mps_env is None or (percent is None and not low_priority):
        return mps_env
    env = dict(mps_env)
    if percent is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percent)
    if low_priority:
        env["CUDA_MPS_CLIENT_PRIORITY"] = "1"
    return env


def main(args: argparse.Namespace) -> int:
    from pd.config import ModelConfig
    from pd.wire.sampling_params import generation_defaults
    from pd.wire.security import configure, generate

    args.model = model_dir(args)
    # a checkpoint pd would compute wrongly starts nothing (pd.cli.main prints the one line)
    ModelConfig.from_dir(args.model)
    generation_defaults(args.model, args.generation_config)
    if args.mps and not args.device.startswith("cuda"):
        print("pd launch: error: --mps needs --device cuda (MPS shares a GPU between processes)",
              file=sys.stderr)
        return 1
    if args.prefill_sm_percent is not None and (not args.mps
                                                or not 1 <= args.prefill_sm_percent <= 100):
        print(f"pd launch: error: --prefill-sm-percent {args.prefill_sm_percent}: a share from 1 "
              "to 100, with --mps", file=sys.stderr)
        return 1
    if args.prefill_low_priority and not args.mps:
        print("pd launch: error: --prefill-low-priority is an MPS client priority: it needs --mps",
              file=sys.stderr)
        return 1
    try:  # the router's port, before any key or node is made, held until the router binds it
        # NOTE: held, not only checked: the nodes' own ports (port 0) and connections could
        # otherwise be given this port while they start, if it lies in the ephemeral range
        args.port_hold = socket.create_server((args.host, args.port))
    except OSError as e:
        print(f"pd launch: error: cannot serve on {args.host}:{args.port} (--host, --port): "
              f"{e.strerror or e}", file=sys.stderr)
        return 1
    ephemeral = None
    if args.curve_keys is None and not args.insecure:
        # NOTE: keys of this launch alone, in a 0700 directory: no other local user can reach a
        # node's sockets (submit work, inject tokens, take a peer's identity)
        ephemeral = tempfile.mkdtemp(prefix="pd-launch-keys-")
        args.curve_keys = generate(ephemeral).directory
    try:
        return _main(args)
    finally:
        args.port_hold.close()  # where the router never came to bind it
        if ephemeral is not None:
            shutil.rmtree(ephemeral, ignore_errors=True)
            configure(None)  # this process's sockets made from now on are plain again


def _main(args: argparse.Namespace) -> int:
    from pd.service.procs import spawn_node
    from pd.wire.security import configure_from_args

    keys = configure_from_args(args)
    mps_env = None
    if args.mps:
        from pd.service.mps import MPSDaemon, MPSError

        try:
            mps = MPSDaemon()
            mps_env = mps.start()
        except MPSError as e:
            print(f"pd launch: error: {e}", file=sys.stderr)
            return 1
        print(f"MPS daemon for this launch: {mps.env['CUDA_MPS_PIPE_DIRECTORY']}", flush=True)
    if args.threads is None and not args.device.startswith("cuda"):
        args.threads = cpu_share(args.num_prefill + args.num_decode)
        print(f"nodes on the CPU: {args.threads} torch thread{'s' * (args.threads > 1)} each "
              "(--threads)", flush=True)
    common = ["--model", args.model, "--metrics-port", "0", *node_args(args, ENGINE_FLAGS)]
    if keys is not None:
        common += ["--curve-keys", keys.directory]
    nodes = []
    # the last --num-blocks (--max-num-batched-tokens, --tensor-parallel-size) given wins
    prefill_blocks = ["--num-blocks", str(args.prefill_num_blocks)] if args.prefill_num_blocks else []
    if args.prefill_max_num_batched_tokens:
        prefill_blocks += ["--max-num-batched-tokens", str(args.prefill_max_num_batched_tokens)]
    if args.prefill_tensor_parallel_size:
        prefill_blocks += ["--tensor-parallel-size", str(args.prefill_tensor_parallel_size)]

    prefill_env = prefill_mps_env(mps_env, args.prefill_sm_percent, args.prefill_low_priority)

    def stop_all() -> None:
        for node in nodes:  # NOTE: every node drains at once, then each is waited for
            node.proc.send_signal(signal.SIGTERM)
        for node in reversed(nodes):
            node.stop(timeout=args.drain_timeout + 10)
        if mps_env is not None:
            mps.stop()

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        # every node starts at once; each says so as it comes up
        for i in range(args.num_decode):
            nodes.append(spawn_node("decode", [*common, "--port", "0", "--kv-port", "0",
                                               "--node-id", f"decode-{i}",
                                               *node_args(args, launch_flags("decode"))],
                                    env=mps_env, die_with_parent=True))
        for i in range(args.num_prefill):
            nodes.append(spawn_node("prefill", [*common, "--port", "0", "--node-id", f"prefill-{i}",
                                                *node_args(args, launch_flags("prefill")),
                                                *prefill_blocks],
                                    env=prefill_env, die_with_parent=True))
        deadline = time.monotonic() + args.ready_timeout
        for n in nodes:
            n.wait_ready(max(0.0, deadline - time.monotonic()))
            print(f"node {n.info['node_id']} pid {n.pid} control 127.0.0.1:{n.info['port']}"
                  f"{' kv ' + n.info['kv_addr'] if 'kv_addr' in n.info else ''}"
                  f" metrics 127.0.0.1:{n.info['metrics_port']} log {n.log_path}",
                  flush=True)
        prefill = [f"127.0.0.1:{n.info['port']}" for n in nodes if n.role == "prefill"]
        decode = [f"127.0.0.1:{n.info['port']}" for n in nodes if n.role == "decode"]
        run_router(args, prefill, decode, nodes)
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        print(f"pd launch: {e}", file=sys.stderr)
        return 1
    finally:
        print("pd launch: stopping", file=sys.stderr)
        stop_all()
    return 0


def run_router(args: argparse.Namespace, prefill: list[str], decode: list[str], nodes) -> None:
    from pd.text.tokenizer import Tokenizer
    from router.zmq_backend import make_backend
    from router.main import run_loop, server_config, start, wait_healthy
    from router.server import RouterServer

    args.heartbeat_interval = 0.5
    if args.heartbeat_timeout is None:
        args.heartbeat_timeout = 10.0 if args.device == "cpu" else 3.0
    reported: set[int] = set()

    def watch_nodes() -> None:  # a node that exits is routed around; say so once
        for n in nodes:
            if n.proc.poll() is not None and n.pid not in reported:
                reported.add(n.pid)
                log.error("%s exited with status %s; serving with the others (its log: %s)",
                          n.info.get("node_id", n.role), n.proc.returncode, n.log_path)

    def banner(name: str) -> str:
        url = f"http://{args.host}:{args.port}"
        return (f"pd is serving {name} at {url}/v1 ({len(prefill)} prefill, {len(decode)} decode)\n"
                f"try:\n  curl {url}/v1/completions -H 'Content-Type: application/json' "
                f"-d '{{\"model\": \"{name}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 48}}'")

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "port_hold", None) is not None:  # the router binds it now
        args.port_hold.close()
    if args.router_workers > 1:
        from router.workers import serve_workers

        name = server_config(args).served_model_name

        def ready(pids: list[int]) -> None:
            print(f"router workers: {args.router_workers}, pids {' '.join(map(str, pids))}\n"
                  + banner(name), flush=True)

        serve_workers(args, prefill, decode, ready_timeout=args.ready_timeout, on_ready=ready,
                      watch=watch_nodes)
        return
    backend = make_backend(args, prefill, decode)
    server = RouterServer(backend, Tokenizer.from_dir(args.model), server_config(args))

    async def serve() -> None:
        runner = await start(server, args.host, args.port)
        error = await wait_healthy(backend, prefill, decode, args.ready_timeout)
        if error is not None:
            raise RuntimeError(error)
        print(banner(server.config.served_model_name), flush=True)
        try:
            while True:
                watch_nodes()
                await asyncio.sleep(0.5)
        finally:
            await runner.cleanup()
            await backend.close()

    profile_path = os.environ.get("PD_ROUTER_PROFILE")  # a benchmark's look inside the router
    if not profile_path:
        run_loop(serve())
        return
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        run_loop(serve())
    finally:
        prof.disable()
        prof.dump_stats(profile_path)
