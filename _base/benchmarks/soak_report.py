"""The soak's judgement and tables (`benchmarks/soak.py` runs the load and gathers the report
these read): `checks` lists what failed, `print_report` prints the request counts, the RSS
tables and the overload figures.
"""

from __future__ import annotations

import argparse
import statistics


def checks(report: dict, args: argparse.Namespace) -> list[str]:
    """What failed, in words; empty when every check passed."""
    bad = []
    s, o, a = report["soak"], report["overload"], report["after"]
    if s.correct != args.requests:
        bad.append(f"soak: {s.correct} of {args.requests} correct ({s.wrong} wrong text, "
                   f"{s.refused} refused, errors {s.errors})")
    if o.refused == 0:
        bad.append(f"overload: no 429 for {args.overload} requests at once")
    if o.wrong or o.errors or o.correct + o.refused != args.overload:
        bad.append(f"overload: {o.wrong} wrong text, errors {o.errors}")
    if o.max_waiting > args.max_queue:
        bad.append(f"overload: {o.max_waiting:.0f} waiting, more than --max-queue {args.max_queue}")
    if a.correct != 1:
        bad.append(f"after the overload a request did not succeed: {a.errors or 'wrong text'}")
    bad += [f"{name} exited during the run" for name, ok in report["alive"].items() if not ok]
    return bad


def slope_per_1k(samples: list, name: str) -> float | None:
    """Least-squares RSS growth in MiB per 1000 requests done, over `samples`."""
    pts = [(x.done, x.rss[name] / 1024) for x in samples if x.rss.get(name) is not None]
    if len({d for d, _ in pts}) < 2:
        return None
    md, mr = statistics.fmean(d for d, _ in pts), statistics.fmean(r for _, r in pts)
    var = sum((d - md) ** 2 for d, _ in pts)
    return 1000 * sum((d - md) * (r - mr) for d, r in pts) / var


def mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"


def print_report(report: dict, args: argparse.Namespace) -> None:
    s, o = report["soak"], report["overload"]
    print(f"\npd launch --model {report['model']} --max-running {args.max_running} --max-queue "
          f"{args.max_queue} {args.launch_args}".rstrip())
    print(f"soak: {args.requests} streamed completions at concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}, {len(report['want'])} prompts, model {report['model']}")
    print(f"  {s.correct} correct, {s.wrong} wrong, {s.refused} refused (429), "
          f"{sum(s.errors.values())} errors {s.errors or ''} in {s.seconds:.1f} s "
          f"({args.requests / s.seconds:.1f} req/s)")
    warm, end, last = report["warm"], report["end"], report["last"]
    after_warm = [x for x in report["samples"] if x.t >= warm.t]
    soaking = [x for x in after_warm if x.t <= end.t]
    print(f"\nRSS (MiB); warm-up = first {warm.done} requests, ended at {warm.t:.0f} s; "
          f"soak ended at {end.t:.0f} s")
    print(f"{'process':<12}{'pid':>8}{'start':>9}{'warm-up':>9}{'peak after':>12}{'soak end':>10}"
          f"{'overload':>10}{'growth':>9}{'growth %':>10}{'MiB/1k req':>12}")
    for name, pid in report["pids"].items():
        w, e = warm.rss.get(name), end.rss.get(name)
        peak = max((x.rss.get(name) or 0 for x in after_warm), default=0)
        growth = "-" if w is None or e is None else f"{(e - w) / 1024:+.1f}"
        pct = "-" if not w or e is None else f"{100 * (e - w) / w:+.1f}"
        slope = slope_per_1k(soaking, name)
        slope = "-" if slope is None else f"{slope:+.2f}"
        print(f"{name:<12}{pid:>8}{mib(report['first'].rss.get(name)):>9}{mib(w):>9}"
              f"{mib(peak):>12}{mib(e):>10}{mib(last.rss.get(name)):>10}{growth:>9}{pct:>10}"
              f"{slope:>12}")
    samples = report["samples"]
    step = max(1, len(samples) // args.series_rows)
    rows = [x for i, x in enumerate(samples) if i % step == 0 or x.label]
    names = list(report["pids"])
    print("\nRSS over time (MiB)")
    print(f"{'t (s)':>7}{'done':>7}" + "".join(f"{n:>12}" for n in names) + "  event")
    for x in rows:
        print(f"{x.t:>7.0f}{x.done:>7}" + "".join(f"{mib(x.rss.get(n)):>12}" for n in names)
              + f"  {x.label}")
    med = statistics.median(o.refused_seconds) * 1000 if o.refused_seconds else float("nan")
    print(f"\noverload: {args.overload} streamed requests at once against --max-running "
          f"{args.max_running} --max-queue {args.max_queue}")
    print(f"  {o.correct} served (all correct: {o.wrong == 0 and not o.errors}), {o.refused} "
          f"answered 429 (median {med:.1f} ms), other {sum(o.errors.values())}; router waiting "
          f"gauge peak {o.max_waiting:.0f} (bound {args.max_queue}); {o.seconds:.1f} s; "
          f"request after it: {'ok' if report['after'].correct == 1 else 'FAILED'}")
    print("\nengine steps (whole run): " + ", ".join(
        f"{name} {n} steps, {over1} over 1 s, {over25} over 2.5 s"
        for name, (n, over1, over25) in report["steps"].items()))
    warnings = report["warnings"]
    print(f"pd launch logged {len(warnings)} warning(s)/error(s)"
          + "".join(f"\n  {w[:160]}" for w in warnings[:8])
          + (f"\n  ... {len(warnings) - 8} more" if len(warnings) > 8 else ""))
