"""Running the model over requests: request state, scheduler, block allocator, paged KV cache,
the runner that builds each step's tensors, sampler and logprobs, executors and CUDA graphs,
the decode loop (overlap on or off), the `Engine` every node builds on, and `pd.LLM`."""
