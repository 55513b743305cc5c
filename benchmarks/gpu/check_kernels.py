"""On a CUDA machine: each MTP RawKernel against its torch twin on fresh random inputs (invalid,
stopped, prefill and chunk slots; k = 1..4; batch 1..512), then launch timings (kernel vs twin,
CUDA events) with achieved GB/s, and whether a launch makes torch wait on the device.

    python benchmarks/gpu/check_kernels.py

Exits non-zero on any mismatch. Prints one line per case and a timing table.
"""

from __future__ import annotations

import sys

import torch

from pd_kernels import draft_preprocess, update_status, verify_accept
from pd_kernels.accept_step import accept_step
from pd_kernels.advance_inputs import advance_inputs
from pd_kernels.testing import (accept_step_inputs, advance_inputs_inputs, preprocess_inputs,
                             status_inputs, verify_inputs)

KS = (1, 2, 3, 4)
BATCHES = (1, 3, 64, 200, 512)
SEEDS = (0, 1, 2)


def accept_step_written(**kw):
    """`accept_step`'s outputs but the result's draft columns (the draft chain's to write)."""
    result, *rest = accept_step(**kw)
    return (result[:, :(result.shape[1] + 4) // 2], *rest)


# each kernel (as compared: `accept_step` without the draft columns it leaves), the maker of its
# inputs (batch, k, vocab, seed) and its keyword arguments for k
KERNELS = (
    (verify_accept, verify_inputs, lambda k: {}),
    (update_status, status_inputs, lambda k: {}),
    (draft_preprocess, preprocess_inputs, lambda k: {"block_size": 4, "num_chain": k - 1}),
    (advance_inputs, advance_inputs_inputs, lambda k: {"block_size": 4, "spare_slot": 28}),
    (accept_step_written, accept_step_inputs, lambda k: {"block_size": 4, "spare_slot": 28}),
)


def both(fn, x: dict, **kw):
    """Run `fn` as kernel and as twin on separate copies; return both outputs (and inputs)."""
    a = {n: t.clone() for n, t in x.items()}
    b = {n: t.clone() for n, t in x.items()}
    ra = fn(**a, **kw, use_kernel=True)
    rb = fn(**b, **kw, use_kernel=False)
    return (ra, a), (rb, b)


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    if isinstance(x, dict):
        return all(same(x[n], y[n]) for n in x)
    return all(same(a, b) for a, b in zip(x, y, strict=True))


def check_all() -> int:
    failures = 0
    for fn, make, kw in KERNELS:
        cases = 0
        for k in KS:
            for b in BATCHES:
                for seed in SEEDS:
                    x = make(b, k, 64, seed + 100 * b + 1000 * k, device="cuda")
                    (ra, a), (rb, bb) = both(fn, x, **kw(k))
                    ok = same(ra, rb) and same(a, bb)  # outputs and in-place updates
                    cases += 1
                    if not ok:
                        failures += 1
                        print(f"MISMATCH {fn.__name__} k={k} batch={b} seed={seed}")
        print(f"{fn.__name__}: {cases} cases, {'all equal' if not failures else 'FAILURES'}")
    return failures


def timed(fn, x: dict, kw: dict, use_kernel: bool, reps: int = 200) -> float:
    """Median microseconds per call (launch included), CUDA events."""
    for _ in range(10):
        fn(**{n: t.clone() for n, t in x.items()}, **kw, use_kernel=use_kernel)
    times = []
    for _ in range(reps):
        args = {n: t.clone() for n, t in x.items()}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(**args, **kw, use_kernel=use_kernel)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def nbytes(x: dict) -> int:
    return sum(t.numel() * t.element_size() for t in x.values())


def timings() -> None:
    print(f"\n{'kernel':>16} {'k':>2} {'batch':>5} {'kernel_us':>10} {'twin_us':>9} "
          f"{'speedup':>8} {'GB/s':>7}")
    for fn, make, kw in KERNELS:
        for k in (1, 4):
            for b in (1, 64, 512):
                x = make(b, k, 64, 7, device="cuda")
                tk = timed(fn, x, kw(k), True)
                tt = timed(fn, x, kw(k), False)
                # bytes moved: every input read once, outputs about the same again (a bound)
                gbs = 2 * nbytes(x) / (tk * 1e-6) / 1e9
                print(f"{fn.__name__:>16} {k:>2} {b:>5} {tk:>10.1f} {tt:>9.1f} {tt / tk:>7.1f}x {gbs:>7.2f}")


def no_host_wait() -> bool:
    """Launch every kernel under torch's sync debug mode set to error."""
    xs = [(fn, make(64, 3, 64, 5, device="cuda"), kw(3)) for fn, make, kw in KERNELS]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for fn, x, kw in xs:
            fn(**x, **kw, use_kernel=True)
    except RuntimeError as e:
        print(f"a kernel launch synchronized: {e}")
        return False
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    print("no host wait in any kernel launch (torch sync debug mode 'error')")
    return True


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failures = check_all()
    ok = no_host_wait()
    timings()
    return 1 if failures or not ok else 0


if __name__ == "__main__":
    sys.exit(main())
