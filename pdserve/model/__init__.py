"""Llama-family model code and weight loading (safetensors directories and GGUF files)."""
