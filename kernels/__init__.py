"""CuPy RawKernels for MTP speculative decoding's per-step bookkeeping, each with a pure-torch
twin: `draft_preprocess` (the MTP layer's inputs from the accepted tokens), `verify_accept`
(accept counts and accepted tokens, greedy and rejection) and `update_status` (lengths, stop
detection inside the accepted run, the device-side "any running" flag).

The wrappers pick the kernel on CUDA when cupy is present and the twin otherwise (CPU, CI);
`cupy` is imported lazily by `kernels.launch`. The model passes and sampling around them are
`pd.spec.mtp`'s and `pd.spec.verify`'s.

`kernels.paged_decode` (not re-exported here, so importing this package never needs triton) is
the decode attention over the paged cache, a Triton kernel with its torch twin, used by
`pd.model.attention` on CUDA.
"""

from kernels.draft_preprocess import draft_preprocess
from kernels.update_status import update_status
from kernels.verify_accept import verify_accept

__all__ = ["draft_preprocess", "update_status", "verify_accept"]
