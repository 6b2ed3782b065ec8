// Fused paged attention for decode on CPU: one query token per sequence attends to its
// context straight from the paged KV cache, without gathering blocks or a per-block loop in
// Python. Parallel over (sequence, KV head); scores, softmax and the weighted sum
// of values are accumulated in float32 whatever the cache dtype. Work is split with
// at::parallel_for, so torch's thread settings apply.
//
// q:            [D, heads, dim]                       (float32 or bfloat16, contiguous)
// cache:        [num_blocks, 2, kv_heads, block, dim] (same dtype, contiguous)
// block_tables: [D, max_blocks] int32 (entries past a sequence's blocks are ignored)
// lengths:      [D] int32, context length of each sequence (>= 1)
// returns       [D, heads, dim] in q's dtype

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Plain conversions the compiler can vectorize (bfloat16 is the top half of a float32).
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
void decode_kernel(const T* q, const T* cache, const int32_t* tables, const int32_t* lengths,
                   T* out, int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t block,
                   int64_t dim, int64_t max_blocks, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t head_stride = block * dim;            // one head's slots in a block
  const int64_t kv_stride = kv_heads * head_stride;   // K -> V inside a block
  const int64_t block_stride = 2 * kv_stride;         // one block
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> qf(group * dim);
    std::vector<float> acc(group * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, kh = item % kv_heads;
      {
        const int64_t len = lengths[s];
        scores.assign(group * len, 0.f);
        for (int64_t g = 0; g < group; ++g) {
          const T* qrow = q + (s * heads + kh * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(qrow[d]) * scale;
        }
        const int32_t* table = tables + s * max_blocks;
        // Scores: q . k for every context position, for each query head of this KV head.
        for (int64_t pos = 0; pos < len; ++pos) {
          const T* k = cache + table[pos / block] * block_stride + kh * head_stride +
                       (pos % block) * dim;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qg[d] * to_float(k[d]);
            scores[g * len + pos] = dot;
          }
        }
        // Softmax per query head.
        for (int64_t g = 0; g < group; ++g) {
          float* row = scores.data() + g * len;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t pos = 0; pos < len; ++pos) mx = std::max(mx, row[pos]);
          float sum = 0.f;
          for (int64_t pos = 0; pos < len; ++pos) {
            row[pos] = std::exp(row[pos] - mx);
            sum += row[pos];
          }
          const float inv = 1.f / sum;
          for (int64_t pos = 0; pos < len; ++pos) row[pos] *= inv;
        }
        // Weighted sum of values.
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t pos = 0; pos < len; ++pos) {
          const T* v = cache + table[pos / block] * block_stride + kv_stride + kh * head_stride +
                       (pos % block) * dim;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + pos];
            float* a = acc.data() + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += p * to_float(v[d]);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          T* orow = out + (s * heads + kh * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(acc[g * dim + d]);
        }
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache,
                                     torch::Tensor block_tables, torch::Tensor lengths,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5, "q [D, heads, dim], cache [N, 2, kvh, bs, dim]");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous(), "q and cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && lengths.scalar_type() == torch::kInt32,
              "block_tables and lengths are int32");
  auto tables = block_tables.contiguous();
  auto lens = lengths.contiguous();
  const int64_t num_seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = cache.size(2), block = cache.size(3);
  TORCH_CHECK(cache.size(4) == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(tables.size(0) == num_seqs && lens.size(0) == num_seqs, "one row per sequence");
  auto out = torch::empty_like(q);
  const int64_t max_blocks = tables.size(1);
  if (q.scalar_type() == torch::kFloat) {
    decode_kernel<float>(q.data_ptr<float>(), cache.data_ptr<float>(), tables.data_ptr<int32_t>(),
                         lens.data_ptr<int32_t>(), out.data_ptr<float>(), num_seqs, heads,
                         kv_heads, block, dim, max_blocks, static_cast<float>(scale));
  } else if (q.scalar_type() == torch::kBFloat16) {
    using B = at::BFloat16;
    decode_kernel<B>(q.data_ptr<B>(), cache.data_ptr<B>(), tables.data_ptr<int32_t>(),
                     lens.data_ptr<int32_t>(), out.data_ptr<B>(), num_seqs, heads, kv_heads,
                     block, dim, max_blocks, static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
  return out;
}
