"""The figures of one `pd bench` run: per-request outcomes in, summary, table, JSON and plot out.

Meanings are those of `vllm bench serve`, so figures compare: TTFT is request start to the
first streamed chunk; ITL is the gap between consecutive chunks; TPOT is a request's
(E2EL - TTFT) / (output tokens - 1), over requests with more than one output token; E2EL is
request start to the last chunk; goodput counts completed requests that meet every SLO given
(ttft/tpot/e2el in ms) per second of the run. Sending requests is `bench.py`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
           ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))


@dataclass
class RequestOutput:
    """What one request did, in seconds and tokens."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    error: str = ""
    turn: int = 0  # the turn of its conversation (--multi-turn), 0-based

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (ms); refuses other keys."""
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if out[key] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be positive")
    return out


def summarize(outputs: list[RequestOutput], duration: float, percentiles: list[float],
              goodput: dict[str, float] | None = None) -> dict:
    ok = [o for o in outputs if o.success]
    series = {
        "ttft": [o.ttft for o in ok],
        "tpot": [t for o in ok if (t := o.tpot) is not None],
        "itl": [g for o in ok for g in o.itl],
        "e2el": [o.latency for o in ok],
    }
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    good = 0
    if goodput:
        for o in ok:
            got = {"ttft": o.ttft, "tpot": o.tpot or 0.0, "e2el": o.latency}
            good += all(got[k] * 1000 <= slo for k, slo in goodput.items())
    s = {
        "duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    turns = sorted({o.turn for o in ok})
    if len(turns) > 1:  # --multi-turn: TTFT per turn of the conversations
        s["median_ttft_ms_by_turn"] = [
            float(np.median([o.ttft for o in ok if o.turn == t]) * 1000) for t in turns]
    for key, values in series.items():
        ms = np.asarray(values or [0.0]) * 1000
        s[f"mean_{key}_ms"] = float(ms.mean())
        s[f"median_{key}_ms"] = float(np.median(ms))
        s[f"std_{key}_ms"] = float(ms.std())
        for p in percentiles:
            s[f"p{p:g}_{key}_ms"] = float(np.percentile(ms, p))
    return s


def table(s: dict, percentiles: list[float]) -> str:
    def row(name: str, value) -> str:
        v = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{name:<40}{v:<10}"

    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Successful requests:", s["completed"]), row("Failed requests:", s["failed"]),
             row("Benchmark duration (s):", s["duration"]),
             row("Total input tokens:", s["total_input_tokens"]),
             row("Total generated tokens:", s["total_output_tokens"]),
             row("Request throughput (req/s):", s["request_throughput"])]
    if s["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", s["request_goodput"]))
    lines += [row("Output token throughput (tok/s):", s["output_throughput"]),
              row("Total Token throughput (tok/s):", s["total_token_throughput"])]
    for key, title, short in METRICS:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(row(f"Mean {short} (ms):", s[f"mean_{key}_ms"]))
        lines.append(row(f"Median {short} (ms):", s[f"median_{key}_ms"]))
        for p in percentiles:
            lines.append(row(f"P{p:g} {short} (ms):", s[f"p{p:g}_{key}_ms"]))
    if "median_ttft_ms_by_turn" in s:
        lines.append("{s:{c}^{n}}".format(s="TTFT by turn", n=50, c="-"))
        for t, v in enumerate(s["median_ttft_ms_by_turn"]):
            lines.append(row(f"Median TTFT, turn {t + 1} (ms):", v))
    lines.append("=" * 50)
    return "\n".join(lines)


def per_request(outputs: list[RequestOutput]) -> dict:
    """The per-request arrays of the result JSON (as `vllm bench serve --save-result` has them)."""
    return {"input_lens": [o.prompt_len for o in outputs],
            "output_lens": [o.output_len for o in outputs],
            "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
            "e2els": [o.latency for o in outputs], "errors": [o.error for o in outputs]}


def plot(outputs: list[RequestOutput], path: str, title: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2EL, in ms) of the completed requests, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [o for o in outputs if o.success]
    data = {"ttft": [o.ttft for o in ok], "tpot": [t for o in ok if (t := o.tpot) is not None],
            "itl": [g for o in ok for g in o.itl], "e2el": [o.latency for o in ok]}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, name, short) in zip(axes.flat, METRICS):
        ms = np.sort(np.asarray(data[key]) * 1000)
        if len(ms):
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
            for p in (50, 90, 99):
                ax.axvline(np.percentile(ms, p), color="grey", ls=":", lw=0.8)
        ax.set_title(f"{short}: {name} (n={len(ms)})", fontsize=9)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
