"""pdserve: LLM serving with prefill/decode disaggregation and peer-to-peer KV-cache transfer."""

__version__ = "0.1.0"
