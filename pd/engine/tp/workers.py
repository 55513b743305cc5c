"""Rank 0's handle on a tensor-parallel node's worker processes (`pd.engine.tp`): started before
the model loads, told the cache's size, watched (one that dies takes the node down), stopped with
the node."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist

from pd.config import EngineConfig
from pd.engine.tp.channel import INIT_TIMEOUT, join, rank_device
from pd.engine.tp.mirror import Mirror, set_active
from pd.model import parallel

log = logging.getLogger(__name__)

EXIT_GRACE_S = 10.0  # a node whose worker died has this long to stop before it exits


class Workers:
    """Rank 0's handle on its worker processes: started before the model loads (every rank
    loads its slice at once), told the cache's size once rank 0 knows it (`setup`), stopped
    with the node."""

    def __init__(self, cfg: EngineConfig) -> None:
        size = cfg.tensor_parallel_size
        self.cfg, self.size = cfg, size
        self.device = rank_device(cfg.device, 0)
        if self.device.type == "cuda":
            last = rank_device(cfg.device, size - 1).index
            if last >= torch.cuda.device_count():
                raise ValueError(f"tensor parallel size {size} on {cfg.device} needs cuda:{last}; "
                                 f"this host has {torch.cuda.device_count()} GPU(s)")
        else:  # the node's cores, shared among its ranks (each worker takes its share too)
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        # NOTE: rank 0 serves the store on a port the OS picks; the workers find it there
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=INIT_TIMEOUT,
                              wait_for_workers=False)
        config = {k: v for k, v in asdict(cfg).items() if k != "extra"}
        self.procs = [subprocess.Popen([sys.executable, "-m", "pd.engine.tp.worker", "--rank", str(r),
                                        "--port", str(store.port), "--config", json.dumps(config)])
                      for r in range(1, size)]
        self.stopping = False
        self.failed: str | None = None  # why a worker's end took the node down
        self.watch_lock = threading.Lock()  # the first worker to end is the one named
        for rank, proc in enumerate(self.procs, start=1):  # one watcher each: any may end first
            threading.Thread(target=self._watch, args=(rank, proc), name=f"pd-tp-watch-{rank}",
                             daemon=True).start()
        log.info("tensor parallel: %d ranks (workers %s)", size,
                 ", ".join(str(p.pid) for p in self.procs))
        self.channel = join(0, size, store, self.device)
        self.mirror: Mirror | None = None

    def setup(self, num_blocks: int, spare_blocks: int, rope_positions: int) -> Mirror:
        """Tell the workers the cache's size (each allocates its heads' share) and how many
        positions the rotary tables cover; returns rank 0's mirror, for its model."""
        self.channel.send({"op": "setup", "num_args": 0, "ctx": None,
                           "num_blocks": num_blocks, "spare_blocks": spare_blocks,
                           "rope_positions": rope_positions}, [])
        self.mirror = Mirror(self.channel)
        set_active(self.mirror)
        return self.mirror

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        """A worker that ends while the node runs takes the node down: SIGINT to this process
        (a node stops as on Ctrl-C, ending what it runs with an error; a script gets
        KeyboardInterrupt), and its exit if that has not ended it within EXIT_GRACE_S."""
        code = proc.wait()
        with self.watch_lock:
            if self.stopping or self.failed is not None:
                return
            self.failed = (f"tensor parallel rank {rank} (pid {proc.pid}) ended with exit code "
                           f"{code}: this node cannot compute without it and goes down")
        log.error("%s", self.failed)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        os.kill(os.getpid(), signal.SIGINT)
        threading.Timer(EXIT_GRACE_S, os._exit, (70,)).start()

    def close(self) -> None:
        with self.watch_lock:
            if self.stopping:
                return
            self.stopping = True
        # NOTE: the graphs go first (on the workers too): NCCL's destroy waits forever on a
        # communicator that a live CUDA graph holds work of; then every rank destroys the group
        # at once (a destroy waits for the other ranks')
        if self.mirror is not None:
            if self.device.type == "cuda" and self.failed is None:
                torch.cuda.synchronize(self.device)  # no replay still running (its twins pair it)
            self.mirror.release_graphs()
        try:
            if self.failed is None:
                with self.mirror.lock if self.mirror is not None else nullcontext():
                    self.channel.send({"op": "stop", "num_args": 0, "ctx": None}, [])
                dist.destroy_process_group()
        finally:
            for p in self.procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            if dist.is_initialized():  # a worker died: nothing to wait for
                dist.destroy_process_group()
            parallel.init(0, 1, None)
            set_active(None)
