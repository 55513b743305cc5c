"""Speculative decoding: the MTP drafter and the verify step (acceptance, stops inside an
accepted run, the next drafts), with its bookkeeping in `kernels`."""
