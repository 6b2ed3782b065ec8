// The Python module of pdserve's CPU kernels (one extension, built by model/fused.py).

#include "kernels.h"
#include "simd.h"

// Every kernel lets go of the GIL while it runs (its tensors are converted before and its result
// after): the event loop's thread hands streamed tokens to clients while a step computes, instead
// of waiting for the step's longest kernel (a decode step's layers are one call of ~10-20 ms).
static const auto nogil = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, nogil,
        "decode attention straight from the paged KV cache");
  m.def("paged_decode_attention_exact", &paged_decode_attention_exact, nogil,
        "decode attention through the prefix runs' tile: the same bits as a run's query");
  m.def("paged_prefill_attention", &paged_prefill_attention, nogil,
        "a run of queries over a cached prefix, straight from the paged KV cache");
  m.def("write_kv_", &write_kv_, nogil, "a step's new keys and values into their slots of the paged cache");
  m.def("prefill_attention_bf16", &prefill_attention_bf16, nogil,
        "causal attention of a run over the positions before it (k, v hold all of them) in bf16 "
        "(avx2, avx512 builds)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("offset") = 0,
        py::arg("into") = py::none());
  m.def("prefill_attention_f32", &prefill_attention_f32, nogil,
        "the same in float32 (avx2, avx512 builds)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("offset") = 0,
        py::arg("into") = py::none());
  m.def("prefill_attention_amx", &prefill_attention_amx, nogil,
        "the same in bf16 on AMX tiles (avx512 build, CPUs with AMX-BF16)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("offset") = 0,
        py::arg("into") = py::none());
  m.def("amx_linear", &amx_linear, nogil,
        "x W^T + b on AMX tiles (the weight in linear.py amx_tiles), the same bits in any batch");
  m.def("amx_ready", &amx_ready, "whether this process may use AMX tiles (prefill_attention_amx)");
  m.def("native_bf16", []() {
#if defined(PDSERVE_AVX512BF16)
    return true;
#else
    return false;
#endif
  }, "whether this build multiplies bf16 with vdpbf16ps");
  m.def("panels", []() {
#if defined(PDSERVE_AVX2)
    return true;
#else
    return false;
#endif
  }, "whether this build has the panel kernels (bf16_blocked_linear, f32_blocked_linear) and "
     "the fresh-prompt attention (prefill_attention_bf16, prefill_attention_f32)");
  m.def("bf16_linear", &bf16_linear, nogil, "x W^T + b for a few rows, bf16 weights read once");
  m.def("bf16_blocked_linear", &bf16_blocked_linear, nogil,
        "x W^T + b, W in 64-feature panels of input pairs: sums by output alone (avx2, avx512 builds)");
  m.def("f32_linear", &f32_linear, nogil, "x W^T + b for a few float32 rows, each weight row read once");
  m.def("f32_blocked_linear", &f32_blocked_linear, nogil,
        "x W^T + b, W float32 in 64-feature panels: one FMA chain per output (avx2, avx512 builds)");
  m.def("q4_linear", &q4_linear, nogil, "x W^T + b, W in 4 bits (Q4_1's groups), x rounded to int8");
  m.def("q8_linear", &q8_linear, nogil, "x W^T + b, W int8 per row, x rounded to int8");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm of rows (bf16 or float32)");
  m.def("add_rms_norm", &add_rms_norm, nogil, "(h + x, RMSNorm(h + x)) of rows");
  m.def("add_rows", &add_rows, nogil, "a + b");
  m.def("rotary_", &rotary_, nogil, "the rotary embedding of a row's first heads, in place");
  m.def("silu_mul", &silu_mul, nogil, "SiLU(gate) * up of [rows, 2 * intermediate]");
  m.def("decode_layers", &decode_layers, nogil, "a decode step's decoder layers in one call");
}
