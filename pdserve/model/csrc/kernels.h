// The kernels of pdserve's CPU extension, as the module (module.cpp) and each other call them.

#pragma once

#include <torch/extension.h>

#include <array>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache,
                                     torch::Tensor block_tables, torch::Tensor lengths,
                                     double scale, int64_t window);
// The same through the prefix runs' tile: a position's attention is the same bits decoded or
// recomputed in a run (--deterministic).
torch::Tensor paged_decode_attention_exact(torch::Tensor q, torch::Tensor cache,
                                           torch::Tensor block_tables, torch::Tensor lengths,
                                           double scale, int64_t window);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor cache,
                                      torch::Tensor block_table, int64_t context_len,
                                      double scale, int64_t window);
void write_kv_(torch::Tensor cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_blocks,
               torch::Tensor slot_offsets);
torch::Tensor prefill_attention_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    double scale, int64_t offset,
                                    c10::optional<torch::Tensor> into);
torch::Tensor prefill_attention_f32(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    double scale, int64_t offset,
                                    c10::optional<torch::Tensor> into);
// The rows kernels' shape checks (prefill_attention.cpp, avx2 and avx512 builds): {t, heads,
// dim, kv_heads}.
std::array<int64_t, 4> check_fresh(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, int64_t offset, torch::ScalarType dtype);
// Their output: `into` (checked: q's shape and dtype, contiguous), else a new tensor.
torch::Tensor fresh_output(const c10::optional<torch::Tensor>& into, const torch::Tensor& q);
// Whether this process may use AMX tiles (an avx512 build on a CPU with them, Linux granting the
// tile state); prefill_attention_amx refuses otherwise.
bool amx_ready();
torch::Tensor prefill_attention_amx(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    double scale, int64_t offset,
                                    c10::optional<torch::Tensor> into);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
// x W^T (+ bias) on AMX tiles, batch-invariant (amx_attention.cpp; linear.py amx_tiles).
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor bf16_blocked_linear(torch::Tensor x, torch::Tensor w,
                                  c10::optional<torch::Tensor> bias);
torch::Tensor f32_blocked_linear(torch::Tensor x, torch::Tensor w,
                                 c10::optional<torch::Tensor> bias);
torch::Tensor f32_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm,
                        c10::optional<torch::Tensor> bias);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales,
                        c10::optional<torch::Tensor> bias);

// The layer ops (layer_ops.cpp), each in bfloat16 or float32 (all tensors in one dtype).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor x, torch::Tensor weight,
                                        double eps);
torch::Tensor add_rows(torch::Tensor a, torch::Tensor b);
void rotary_(torch::Tensor x, int64_t heads, int64_t head_dim, torch::Tensor cos,
             torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);

torch::Tensor decode_layers(torch::Tensor h, const std::vector<std::vector<torch::Tensor>>& layers,
                            torch::Tensor cos, torch::Tensor sin,
                            const std::vector<torch::Tensor>& caches, torch::Tensor slot_blocks,
                            torch::Tensor slot_offsets, torch::Tensor block_tables,
                            torch::Tensor lengths, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, double eps, bool exact, int64_t packed_from);
