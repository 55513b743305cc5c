"""What the processes of a serving run spend (`bench_serving.py`): CPU seconds of a live process
(`cpu_seconds`) and of this process's ended children (`children_cpu`), and py-spy samples of a
live process, summarized per thread and frame (`spy`, `summarize_spy`)."""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter


def children_cpu() -> float:
    """CPU seconds of this process's children that have ended and been waited for (the pd bench
    client processes, and py-spy's with --spy; not `pd launch`, which runs to the end)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Spy(threading.Thread):
    """`delay` s from its start, records `seconds` of py-spy samples of one process; `summary`
    holds what it found once joined."""

    def __init__(self, exe: str, name: str, pid: int, seconds: float, delay: float,
                 extra: list[str], focus: str) -> None:
        super().__init__(daemon=True)
        self.exe, self.name, self.pid, self.seconds, self.delay = exe, name, pid, seconds, delay
        self.extra, self.focus = extra, focus
        self.summary = ""

    def run(self) -> None:
        time.sleep(self.delay)
        out = tempfile.mktemp(suffix=".txt")
        run = subprocess.run([self.exe, "record", "-p", str(self.pid), "-d", str(max(1, round(self.seconds))),
                              "-r", "250", "-f", "raw", "-o", out, "--threads",
                              # NOTE: py-spy reads native stacks only from a paused process
                              *([] if "--native" in self.extra else ["--nonblocking"]),
                              *self.extra],
                             capture_output=True, text=True)
        found = (summarize_spy(out, max(1, round(self.seconds)) * 250, focus=self.focus)
                 if os.path.exists(out) else run.stderr[-500:])
        self.summary = f"py-spy {self.name}: {found}"


def spy(seconds: float, pids: dict[str, int], delay: float = 3.0, extra: list[str] = (),
        focus: str = "") -> list[Spy]:
    exe = shutil.which("py-spy")
    if exe is None:
        print("--spy: py-spy is not on PATH; no samples", flush=True)
        return []
    spies = [Spy(exe, name, pid, seconds, delay, list(extra), focus) for name, pid in pids.items()]
    for t in spies:
        t.start()
    return spies


_OURS = re.compile(r"\((pd|kernels|router|prefill_node|decode_node)/")  # the project's frames


def summarize_spy(path: str, possible: float, top: int = 18, focus: str = "") -> str:
    """Busy share per thread, the frames with the most samples of their own, and the project's
    functions with the most samples inside them (callees included) (py-spy raw); with `focus`,
    also the frames with the most samples of their own under a frame naming it."""
    own, inside, threads, compiling, total = Counter(), Counter(), Counter(), Counter(), 0
    focused = Counter()
    for line in open(path):
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        threads[frames[0]] += int(n)
        own[frames[-1]] += int(n)
        total += int(n)
        if focus and any(focus in f for f in frames[:-1]):
            focused[frames[-1]] += int(n)
        ours = [f for f in frames[1:] if _OURS.search(f)]
        for f in {f.rsplit(":", 1)[0] + ")" for f in ours}:
            inside[f] += int(n)
        if any("triton/compiler" in f or "triton/backends" in f for f in frames):
            compiling[ours[-1] if ours else "?"] += int(n)
    os.unlink(path)
    lines = [f"{total} samples of {possible:.0f} per thread"]
    lines += [f"  {n / possible:6.1%}  {name}" for name, n in threads.most_common(6)]
    lines += [f"  {n / possible:6.1%}  own: {frame[:140]}" for frame, n in own.most_common(top)]
    lines += [f"  {n / possible:6.1%}  inside: {frame[:140]}" for frame, n in inside.most_common(top)]
    lines += [f"  {n / possible:6.1%}  own under {focus}: {frame[:140]}"
              for frame, n in focused.most_common(top)]
    lines += [f"  {n / possible:6.1%}  compiling Triton from: {frame[:140]}"
              for frame, n in compiling.most_common(6)]
    return "\n".join(lines)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process and its threads (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
