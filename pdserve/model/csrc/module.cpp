// The Python module of pdserve's CPU kernels (one extension, built by model/fused.py).

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache,
                                     torch::Tensor block_tables, torch::Tensor lengths,
                                     double scale);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention straight from the paged KV cache");
  m.def("bf16_linear", &bf16_linear, "x W^T + b for a few rows, bf16 weights read once");
}
