"""A CUDA MPS control daemon private to one `pd launch` (`--mps`).

Without MPS a GPU shared by a prefill node and a decode node takes turns between the two
processes: a prefill's kernels hold the whole GPU for a time slice and the decode step waiting
behind them stretches (the inter-token tail). Under MPS both processes' kernels run at once on
the GPU's multiprocessors. `MPSDaemon` starts `nvidia-cuda-mps-control -d` with a pipe and log
directory of its own (a 0700 temporary directory), so it serves only the processes given its
`env`, and leaves any other MPS setup of the host alone; `stop` ends it and removes the
directory. The MPS server itself starts with the first client.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

CONTROL = "nvidia-cuda-mps-control"


class MPSError(RuntimeError):
    pass


class MPSDaemon:
    def __init__(self) -> None:
        self.exe = shutil.which(CONTROL)
        if self.exe is None:
            raise MPSError(f"--mps needs {CONTROL} on PATH (installed with the NVIDIA driver)")
        self.dir = tempfile.mkdtemp(prefix="pd-mps-")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.dir, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.dir, "log")}
        self.running = False

    def _run(self, *args: str, text: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.exe, *args], input=text, env={**os.environ, **self.env},
                              capture_output=True, text=True, timeout=30)

    def start(self) -> dict[str, str]:
        """Start the daemon; returns the environment of its clients."""
        for d in self.env.values():
            os.makedirs(d, mode=0o700, exist_ok=True)
        done = self._run("-d")
        if done.returncode != 0:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise MPSError(f"{CONTROL} -d failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
        self.running = True
        return dict(self.env)

    def stop(self) -> None:
        """End the daemon (after its clients have exited) and remove its directory."""
        if self.running:
            self.running = False
            try:
                self._run(text="quit\n")
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
