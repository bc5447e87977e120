// Python bindings of the native ops (one extension module, built by layers/native.py).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged single-token attention (float32, CPU)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("table_rows") = pybind11::none(),
        pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0);
  m.def("rms_norm", &rms_norm, "out = weight * (x / rms(x)) per row (float32, CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place; returns rms_norm(residual) (float32, CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up = [gate | up] per row (float32, CPU)");
  m.def("rotary_", &rotary_, "rotate [T, heads, D] in place by per-token cos/sin [T, 1, D] (float32, CPU)");
  m.def("quantize_activations", &quantize_activations,
        "[M, K] float32 -> [M, K + 8K/32] int8: codes, then per-32 scales and scale * sums as float32");
  m.def("quant_linear", &quant_linear, "y = x W^T (+ b), W in GGUF-derived int codes (U4, U8, S8), float32 CPU");
  m.def("quant_packed_rows", &quant_packed_rows,
        "output rows per group of quant_linear's packed weight layout on this build (0: no packed layout)");
  bind_decode_stack(m);
  m.def("skinny_linear", &skinny_linear, "y = x W^T (+ b) for a few rows, W in [N/16, K, 16] panels (float32, CPU)");
}
