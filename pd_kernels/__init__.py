"""CuPy RawKernels for MTP speculative decoding's per-step bookkeeping, each with a pure-torch
twin: `draft_preprocess` (the MTP layer's inputs from the accepted tokens), `verify_accept`
(accept counts and accepted tokens, greedy and rejection), `update_status` (lengths, stop
detection inside the accepted run, the device-side "any running" flag) and
`pd_kernels.advance_inputs` (a chained step's inputs from the previous step's result).

The wrappers pick the kernel on CUDA when cupy is present and the twin otherwise (CPU, CI);
`cupy` is imported lazily by `pd_kernels.launch`. The model passes and sampling around them are
`pd.spec.mtp`'s and `pd.spec.verify`'s.

The Triton kernels (not re-exported here, so importing this package never needs triton), each
with its torch twin: `pd_kernels.paged_decode` (the decode attention over the paged cache, with
the step's rotary and cache write in a plain decode step, used by `pd.model.attention` on
CUDA), `pd_kernels.rms_norm`, `pd_kernels.rope_cache`, `pd_kernels.activation` (the decode layer's fused
elementwise steps), `pd_kernels.skinny_linear` (the linear layers' product at up to 64 rows,
with the gated MLP's SiLU-and-multiply as its epilogue), `pd_kernels.norm_linear` (RMSNorm as
that product's prologue) and
`pd_kernels.argmax` (greedy sampling inside the decode graphs); `pd_kernels.triton_support` says when
they run and how they are launched back to back (programmatic dependent launch).
"""

from pd_kernels.draft_preprocess import draft_preprocess
from pd_kernels.update_status import update_status
from pd_kernels.verify_accept import verify_accept

__all__ = ["draft_preprocess", "update_status", "verify_accept"]
