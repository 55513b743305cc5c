"""`update_status`: advance each slot by the tokens its step emitted, stopping inside the run.

Per slot b whose `slot_index` is >= 0 and whose `stop_flags[b]` is 0 (still running), the
tokens accepted_ids[b, 0 .. num_accepted[b]-1] are taken in order; after each, the slot's
length and output count grow by one, and the run is cut after the first token that
- is a stop id (`stop_ids[b]`, -1 padded: EOS unless ignore_eos, extra EOS, stop_token_ids)
  once the output count reached `min_tokens[b]` -> flag STOP (1), or
- brings the length to `max_seq_lens[b]` (min(prompt + max_tokens, max_model_len)) -> LENGTH (2),
in that order of checks (as `Req.check_stop`). num_accepted[b] becomes the kept count,
seq_lens / num_outputs / stop_flags are updated in place, and `any_running[0]` is set to 1
when some slot is still running after the step (the caller zeroes it first). Invalid slots
(negative index) and already stopped slots are skipped.
"""

from __future__ import annotations

import torch

from pd_kernels.launch import check, launch, use_kernels

RUNNING, STOP, LENGTH = 0, 1, 2

# NOTE: the run's stop checks as a device function, which `pd_kernels.accept_step` calls too:
# advances *len and *outs by the tokens taken, cuts *kept, returns the flag
DEVICE = r"""
__device__ int stop_in_run(const long long* acc, int* kept, long long* len, long long* outs,
                           long long max_len, long long min_tokens, const long long* stop_ids,
                           int num_stop)
{
    int n = *kept, flag = 0;
    for (int j = 0; j < n; ++j) {
        long long tok = acc[j];
        *len += 1; *outs += 1;
        if (*outs >= min_tokens) {
            for (int s = 0; s < num_stop; ++s) {
                long long sid = stop_ids[s];
                if (sid >= 0 && sid == tok) { flag = 1; break; }
            }
        }
        if (flag == 0 && *len >= max_len) flag = 2;
        if (flag != 0) { *kept = j + 1; break; }
    }
    return flag;
}
"""

SOURCE = DEVICE + r"""
extern "C" __global__ void update_status(
    const long long* slot_index, const long long* accepted_ids, int* num_accepted,
    long long* seq_lens, long long* num_outputs, const long long* max_seq_lens,
    const long long* min_tokens, const long long* stop_ids, int* stop_flags, int* any_running,
    int num_slots, int k1, int num_stop)
{
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_slots || slot_index[b] < 0 || stop_flags[b] != 0) return;
    int kept = num_accepted[b];
    long long len = seq_lens[b], outs = num_outputs[b];
    int flag = stop_in_run(accepted_ids + (long long)b * k1, &kept, &len, &outs, max_seq_lens[b],
                           min_tokens[b], stop_ids + (long long)b * num_stop, num_stop);
    num_accepted[b] = kept;
    seq_lens[b] = len;
    num_outputs[b] = outs;
    stop_flags[b] = flag;
    if (flag == 0) atomicOr(any_running, 1);
}
"""


def update_status_ref(slot_index, accepted_ids, num_accepted, seq_lens, num_outputs, max_seq_lens,
                      min_tokens, stop_ids, stop_flags, any_running) -> None:
    """The torch twin: same inputs, same in-place outputs."""
    k1 = accepted_ids.shape[1]
    j = torch.arange(k1, device=accepted_ids.device)[None, :]
    in_run = j < num_accepted[:, None]
    outs_after = num_outputs[:, None] + j + 1  # [B, k1]
    lens_after = seq_lens[:, None] + j + 1
    is_stop = ((accepted_ids[:, :, None] == stop_ids[:, None, :]) & (stop_ids[:, None, :] >= 0)).any(dim=-1)
    is_stop &= (outs_after >= min_tokens[:, None]) & in_run
    is_len = (lens_after >= max_seq_lens[:, None]) & in_run
    hit = is_stop | is_len
    any_hit = hit.any(dim=1)
    first = hit.to(torch.int32).argmax(dim=1)  # first hit (argmax returns the first maximum)
    kept = torch.where(any_hit, first + 1, num_accepted.long())
    flag = torch.where(is_stop.gather(1, first[:, None].long()).squeeze(1), STOP,
                       torch.where(any_hit, LENGTH, RUNNING)).to(torch.int32)
    live = (slot_index >= 0) & (stop_flags == 0)
    num_accepted.copy_(torch.where(live, kept.to(torch.int32), num_accepted))
    seq_lens.copy_(torch.where(live, seq_lens + kept, seq_lens))
    num_outputs.copy_(torch.where(live, num_outputs + kept, num_outputs))
    stop_flags.copy_(torch.where(live, flag, stop_flags))
    any_running.copy_((live & (flag == RUNNING)).any().to(torch.int32).view(1) | any_running)


def update_status(slot_index: torch.Tensor, accepted_ids: torch.Tensor, num_accepted: torch.Tensor,
                  seq_lens: torch.Tensor, num_outputs: torch.Tensor, max_seq_lens: torch.Tensor,
                  min_tokens: torch.Tensor, stop_ids: torch.Tensor, stop_flags: torch.Tensor,
                  use_kernel: bool | None = None) -> torch.Tensor:
    """Updates num_accepted, seq_lens, num_outputs and stop_flags in place; returns the
    any-running flag [1] int32 (on the device). Shapes: slot_index [B] int64, accepted_ids
    [B, k+1] int64, num_accepted [B] int32, seq_lens / num_outputs / max_seq_lens / min_tokens
    [B] int64, stop_ids [B, S] int64 (-1 padded, S may be 0), stop_flags [B] int32."""
    num_slots, k1 = accepted_ids.shape
    num_stop = stop_ids.shape[1]
    dev = accepted_ids.device
    for t, name, dtype, shape in (
        (slot_index, "slot_index", torch.int64, (num_slots,)),
        (accepted_ids, "accepted_ids", torch.int64, (num_slots, k1)),
        (num_accepted, "num_accepted", torch.int32, (num_slots,)),
        (seq_lens, "seq_lens", torch.int64, (num_slots,)),
        (num_outputs, "num_outputs", torch.int64, (num_slots,)),
        (max_seq_lens, "max_seq_lens", torch.int64, (num_slots,)),
        (min_tokens, "min_tokens", torch.int64, (num_slots,)),
        (stop_ids, "stop_ids", torch.int64, (num_slots, num_stop)),
        (stop_flags, "stop_flags", torch.int32, (num_slots,)),
    ):
        check(t, name, dtype, shape, dev)
    any_running = torch.zeros(1, dtype=torch.int32, device=dev)
    if use_kernel if use_kernel is not None else use_kernels(accepted_ids):
        import numpy as np  # noqa: PLC0415

        launch("update_status", SOURCE, num_slots,
               [slot_index, accepted_ids, num_accepted, seq_lens, num_outputs, max_seq_lens,
                min_tokens, stop_ids, stop_flags, any_running, np.int32(num_slots),
                np.int32(k1), np.int32(num_stop)])
    else:
        update_status_ref(slot_index, accepted_ids, num_accepted, seq_lens, num_outputs,
                          max_seq_lens, min_tokens, stop_ids, stop_flags, any_running)
    return any_running
