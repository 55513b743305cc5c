"""Text in and out, torch-free: the tokenizer and chat template of a model directory, and the
incremental detokenizer the router and `pd.LLM` share."""
