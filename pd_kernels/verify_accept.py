"""`verify_accept`: how many of each slot's draft tokens the target accepts, and the tokens the
step emits (the accepted drafts, then the target's own token at the first rejected position,
or after the last draft when all were accepted).

Per slot b with `num_drafts[b]` = n drafts d_0..d_{n-1}:
- greedy slot: draft j is accepted while d_j == target_ids[b, j] (the target's argmax there);
- sampled slot: draft j is accepted while uniforms[b, j] * draft_probs[b, j] <
  target_probs[b, j], i.e. with probability min(1, p(d_j) / q(d_j)).
With a accepted, accepted_ids[b] = d_0..d_{a-1}, target_ids[b, a], then -1 padding, and
num_accepted[b] = a + 1. For a sampled slot, target_ids[b, j] must already hold a draw from
normalize(max(p_j - q_j, 0)) for j < n and from p_n at j = n (the caller's job, see
`pd.spec.verify`); this kernel only selects. Slots whose `slot_index` is negative are skipped:
their outputs keep the initial -1 / 0.
"""

from __future__ import annotations

import torch

from pd_kernels.launch import check, launch, use_kernels

# NOTE: the run of one slot as a device function, which `pd_kernels.accept_step` calls too;
# draft_probs may be null there (every draft probability 1)
DEVICE = r"""
__device__ int accept_run(int n, const long long* d, const long long* t, const float* dp,
                          const float* tp, const float* u, bool greedy, long long* out, int k)
{
    int a = 0;
    for (; a < n; ++a) {
        bool ok = greedy ? (d[a] == t[a]) : (u[a] * (dp ? dp[a] : 1.0f) < tp[a]);
        if (!ok) break;
        out[a] = d[a];
    }
    out[a] = t[a];
    for (int j = a + 1; j <= k; ++j) out[j] = -1;
    return a + 1;
}
"""

SOURCE = DEVICE + r"""
extern "C" __global__ void verify_accept(
    const long long* slot_index, const int* num_drafts, const long long* draft_ids,
    const long long* target_ids, const float* draft_probs, const float* target_probs,
    const float* uniforms, const int* greedy, long long* accepted_ids, int* num_accepted,
    int num_slots, int k)
{
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_slots || slot_index[b] < 0) return;
    long long o = (long long)b * k, t = (long long)b * (k + 1);
    num_accepted[b] = accept_run(num_drafts[b], draft_ids + o, target_ids + t, draft_probs + o,
                                 target_probs + o, uniforms + o, greedy[b] != 0,
                                 accepted_ids + t, k);
}
"""


def verify_accept_ref(slot_index, num_drafts, draft_ids, target_ids, draft_probs, target_probs,
                      uniforms, greedy, accepted_ids, num_accepted) -> None:
    """The torch twin: same inputs, same in-place outputs."""
    num_slots, k = draft_ids.shape
    dev = draft_ids.device
    j = torch.arange(k, device=dev)
    ok = torch.where(greedy[:, None].bool(), draft_ids == target_ids[:, :k],
                     uniforms * draft_probs < target_probs)
    ok &= j[None, :] < num_drafts[:, None]
    a = ok.to(torch.int32).cumprod(dim=1).sum(dim=1)  # [B] accepted drafts
    jj = torch.arange(k + 1, device=dev)[None, :]
    drafts = torch.cat([draft_ids, draft_ids.new_full((num_slots, 1), -1)], dim=1)
    own = target_ids.gather(1, a[:, None].long())  # [B, 1]
    out = torch.where(jj < a[:, None], drafts, torch.where(jj == a[:, None], own, -1))
    valid = slot_index >= 0
    accepted_ids.copy_(torch.where(valid[:, None], out, accepted_ids))
    num_accepted.copy_(torch.where(valid, (a + 1).to(torch.int32), num_accepted))


def verify_accept(slot_index: torch.Tensor, num_drafts: torch.Tensor, draft_ids: torch.Tensor,
                  target_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                  uniforms: torch.Tensor, greedy: torch.Tensor,
                  use_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted_ids [B, k+1] int64, num_accepted [B] int32). Shapes: slot_index [B]
    int64, num_drafts [B] int32 (0..k), draft_ids [B, k] int64, target_ids [B, k+1] int64,
    draft_probs / target_probs / uniforms [B, k] float32, greedy [B] int32."""
    num_slots, k = draft_ids.shape
    dev = draft_ids.device
    for t, name, dtype, shape in (
        (slot_index, "slot_index", torch.int64, (num_slots,)),
        (num_drafts, "num_drafts", torch.int32, (num_slots,)),
        (draft_ids, "draft_ids", torch.int64, (num_slots, k)),
        (target_ids, "target_ids", torch.int64, (num_slots, k + 1)),
        (draft_probs, "draft_probs", torch.float32, (num_slots, k)),
        (target_probs, "target_probs", torch.float32, (num_slots, k)),
        (uniforms, "uniforms", torch.float32, (num_slots, k)),
        (greedy, "greedy", torch.int32, (num_slots,)),
    ):
        check(t, name, dtype, shape, dev)
    accepted_ids = torch.full((num_slots, k + 1), -1, dtype=torch.int64, device=dev)
    num_accepted = torch.zeros(num_slots, dtype=torch.int32, device=dev)
    if use_kernel if use_kernel is not None else use_kernels(draft_ids):
        import numpy as np  # noqa: PLC0415

        launch("verify_accept", SOURCE, num_slots,
               [slot_index, num_drafts, draft_ids, target_ids, draft_probs, target_probs,
                uniforms, greedy, accepted_ids, num_accepted, np.int32(num_slots), np.int32(k)])
    else:
        verify_accept_ref(slot_index, num_drafts, draft_ids, target_ids, draft_probs,
                          target_probs, uniforms, greedy, accepted_ids, num_accepted)
    return accepted_ids, num_accepted
