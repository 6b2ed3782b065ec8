// A decode step's decoder layers in one call: for a batch of sequences with one new token each,
// every layer's norms, projections, rotary embedding, KV-cache write, paged attention, residual
// adds and SiLU-gated MLP run here, without a Python call or a torch operator per step of it.
// At batch 1 on SmolLM2 the layers are ~100 small torch operators each, and dispatching them
// (and the Python around them) cost more than the int4 matmuls did.
//
// The elementwise parts are layer_ops.cpp's, which the Python path calls too (in bf16 rounding
// where torch's operators round), in bf16 and float32 alike; the linears are the kernels the
// Python path's Linear modules call. In float32 the output is bit-identical to the Python
// layers' (fp32 keeps exact identity between batched and alone, and between the two paths).
//
// h:      [M, hidden] bfloat16 or float32 (one row per sequence), returned updated (a new tensor)
// layers: per layer [input norm, post-attention norm, then (a, b, bias) for qkv, o, gate_up,
//         down]: a uint8 with b float32 is int4 (q4_linear), a int8 with b float32 is int8
//         (q8_linear), a bfloat16 (b empty) is a bf16 weight (bf16_linear; 4 dimensions:
//         panels, bf16_blocked_linear; 6: AMX tiles, amx_linear), a bfloat16 with b the same
//         weight packed by oneDNN
//         (torch.ops.mkldnn._reorder_linear_weight, AMX hosts) takes packed_from rows or more
//         through oneDNN (as Linear.forward does), fewer through bf16_linear, a float32 (b
//         empty) a float32 weight (f32_linear; 3 dimensions: panels, f32_blocked_linear); an
//         empty bias is none
// cos, sin: [M, head_dim] in h's dtype, at each row's position
// caches: per layer [num_blocks, 2, kv_heads, block, head_dim] in h's dtype
// slot_blocks, slot_offsets: [M] int64, where each row's new K/V goes
// block_tables [M, max_blocks] int32, lengths [M] int32: as paged_decode_attention's
// exact: attention through paged_decode_attention_exact (--deterministic), as the Python path's
//        decode batch then has it
// packed_from: rows from which a bf16 linear with a packed weight takes oneDNN (see layers)

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace {

using bf16 = at::BFloat16;

// x W^T (+ bias) through oneDNN's packed weight: the operator Linear.forward calls
// (torch.ops.mkldnn._linear_pointwise), here without Python between the layers.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                               const c10::optional<torch::Tensor>&, c10::string_view,
                               c10::List<c10::optional<c10::Scalar>>,
                               c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<c10::Scalar>>(), "");
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                     const torch::Tensor& bias, int64_t packed_from) {
  const c10::optional<torch::Tensor> add =
      bias.numel() ? c10::optional<torch::Tensor>(bias) : c10::nullopt;
  switch (a.scalar_type()) {
    case torch::kUInt8: return q4_linear(x, a, b, add);
    case torch::kInt8: return q8_linear(x, a, b, add);
    case torch::kBFloat16:
      if (a.dim() == 6) return amx_linear(x, a, add);  // AMX tiles (--deterministic)
      if (b.defined() && b.is_mkldnn() && x.size(0) >= packed_from)
        return onednn_linear(x, b, add);
      return a.dim() == 4 ? bf16_blocked_linear(x, a, add) : bf16_linear(x, a, add);
    case torch::kFloat:
      return a.dim() == 3 ? f32_blocked_linear(x, a, add) : f32_linear(x, a, add);
    default: TORCH_CHECK(false, "decode_layers: unknown linear weight type ", a.scalar_type());
  }
}

template <typename T>
torch::Tensor decode_layers_of(torch::Tensor h, const std::vector<std::vector<torch::Tensor>>& layers,
                               const torch::Tensor& cos, const torch::Tensor& sin,
                               const std::vector<torch::Tensor>& caches,
                               const torch::Tensor& slot_blocks, const torch::Tensor& slot_offsets,
                               const torch::Tensor& block_tables, const torch::Tensor& lengths,
                               int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                               bool exact, int64_t packed_from) {
  const auto dtype = h.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "cos and sin are in h's dtype, contiguous");
  const int64_t m = h.size(0);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& p = layers[l];
    TORCH_CHECK(p.size() == 14, "a layer is 2 norms and 4 linears of 3 tensors");
    const torch::Tensor& cache = caches[l];
    TORCH_CHECK(cache.scalar_type() == dtype && cache.is_contiguous() &&
                    cache.size(2) == kv_heads && cache.size(4) == head_dim,
                "cache is [blocks, 2, kv_heads, block, head_dim] in h's dtype, contiguous");
    const int64_t block = cache.size(3);
    // Attention: qkv, rotary on q and k, K/V into the cache, attention, o, residual.
    auto qkv = linear(rms_norm(h, p[0], eps), p[2], p[3], p[4], packed_from);  // [M, q + 2 kv]
    const int64_t width = qkv.size(1);
    TORCH_CHECK(width == q_width + 2 * kv_width, "qkv width");
    rotary_(qkv, heads + kv_heads, head_dim, cos, sin);  // q's heads, then k's
    auto q = torch::empty({m, heads, head_dim}, h.options());
    const T* qkvp = qkv.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    T* kvp = cache.data_ptr<T>();
    const int64_t half_stride = kv_heads * block * head_dim;  // K -> V in a block
    for (int64_t r = 0; r < m; ++r) {
      const T* row = qkvp + r * width;
      std::copy(row, row + q_width, qp + r * q_width);
      T* slot = kvp + blocks[r] * 2 * half_stride + offsets[r] * head_dim;
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        const T* k = row + q_width + kh * head_dim;
        const T* v = row + q_width + kv_width + kh * head_dim;
        std::copy(k, k + head_dim, slot + kh * block * head_dim);
        std::copy(v, v + head_dim, slot + half_stride + kh * block * head_dim);
      }
    }
    auto attn = exact ? paged_decode_attention_exact(q, cache, block_tables, lengths, scale, 0)
                      : paged_decode_attention(q, cache, block_tables, lengths, scale, 0);
    auto o = linear(attn.view({m, q_width}), p[5], p[6], p[7], packed_from);
    // MLP: the residual and its norm, gate_up, SiLU(gate) * up, down, residual.
    auto normed = add_rms_norm(h, o, p[1], eps);  // {h + o, its norm}
    auto gu = linear(normed[1], p[8], p[9], p[10], packed_from);  // [M, 2 * inter]
    h = add_rows(normed[0], linear(silu_mul(gu), p[11], p[12], p[13], packed_from));
  }
  return h;
}

}  // namespace

torch::Tensor decode_layers(torch::Tensor h, const std::vector<std::vector<torch::Tensor>>& layers,
                            torch::Tensor cos, torch::Tensor sin,
                            const std::vector<torch::Tensor>& caches, torch::Tensor slot_blocks,
                            torch::Tensor slot_offsets, torch::Tensor block_tables,
                            torch::Tensor lengths, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, double eps, bool exact,
                            int64_t packed_from) {
  TORCH_CHECK(layers.size() == caches.size(), "one cache per layer");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h is [M, hidden], contiguous");
  if (h.scalar_type() == torch::kFloat) {
    return decode_layers_of<float>(h, layers, cos, sin, caches, slot_blocks, slot_offsets,
                                   block_tables, lengths, heads, kv_heads, head_dim, eps, exact,
                                   packed_from);
  }
  TORCH_CHECK(h.scalar_type() == torch::kBFloat16, "h is bfloat16 or float32");
  return decode_layers_of<bf16>(h, layers, cos, sin, caches, slot_blocks, slot_offsets,
                                block_tables, lengths, heads, kv_heads, head_dim, eps, exact,
                                packed_from);
}
