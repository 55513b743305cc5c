"""pd: prefill/decode disaggregated LLM serving."""

from pd.wire.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so `import pd` stays light for processes that need only the wire types.
    if name == "LLM":
        from pd.engine.llm import LLM

        return LLM
    raise AttributeError(name)
