"""The model: the Llama-family decoder with its MTP layer, its layers and paged attention, the
per-step forward context, and the checkpoint loader. Knows nothing of requests or scheduling."""
