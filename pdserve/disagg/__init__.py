"""Prefill/decode disaggregation: protocol, transports, the resource store, the KV sender and
receiver, the prefill and decode nodes and the prefill client."""
