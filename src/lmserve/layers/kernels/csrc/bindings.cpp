// Python bindings of the native ops (one extension module, built by layers/kernels/native.py). The one unit that includes
// torch's headers (ops.h): the kernel units take raw rows (kernels.h), so they compile in seconds, in parallel.
#include "cpu_gate.h"
#include "decode_stack.h"
#include "ops.h"
#include "thread_pool.h"

int lmserve::torch_threads() { return at::get_num_threads(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the matmuls and the attention run without the GIL, as torch's own ops do: other Python threads (a server's event
  // loop) go on meanwhile; the row ops are too short for it to matter
  using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, no_gil(), "paged single-token attention (float32, CPU)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("table_rows") = pybind11::none(),
        pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0);
  m.def("encoder_attention", &encoder_attention, no_gil(), "an encoder step's bidirectional attention over packed "
        "sequences: qkv [T, 3, H, D], starts [B + 1] -> [T, H * D] (float32, CPU; window < 0: none)",
        pybind11::arg("qkv"), pybind11::arg("starts"), pybind11::arg("scale"), pybind11::arg("window") = -1);
  m.def("write_kv", &write_kv, "store K/V [T, kv_heads, D] float32 at their slots of a [2, blocks, block_size, "
        "kv_heads, W] cache, quantizing where its format does (float32, float16, int8, float8_e4m3fn)");
  m.def("rms_norm", &rms_norm, "out = weight * (x / rms(x)) per row (float32, CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place; returns rms_norm(residual) (float32, CPU)");
  // an encoder's bulk step (2,048 rows) takes ~0.4 ms a call: another engine's thread (a chat model's) goes on
  m.def("layer_norm", &layer_norm, no_gil(), "(x - mean) / sqrt(var + eps) * weight + bias per row (float32, CPU; weight, bias "
        "optional)", pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up = [gate | up] per row (float32, CPU)");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up for gate_up = [gate | up] per row (float32, CPU)");
  m.def("argmax_logprob", &argmax_logprob, no_gil(),
        "[B, V] float32 -> (first index of each row's max [B] int64, its log-softmax [B] float32), CPU");
  m.def("rotary_", &rotary_, "rotate [T, heads, D] in place by per-token cos/sin [T, 1, D] (float32, CPU)");
  m.def("quantize_activations", &quantize_activations, no_gil(),
        "[M, K] float32 -> [M, K + 8K/32] int8: codes, then per-32 scales and scale * sums as float32");
  m.def("quant_linear", &quant_linear, no_gil(), "y = x W^T (+ b), W in GGUF-derived int codes (U4, U8, S8), float32 CPU");
  m.def("packed_table_rows", &packed_table_rows, no_gil(), "rows ids of a packed U4, U8 or S8 table as float32 [n, K] "
        "(an embedding lookup)", pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("mins"),
        pybind11::arg("ids"), pybind11::arg("kind"));
  m.def("quant_packed_rows", &quant_packed_rows,
        "output rows per group of quant_linear's packed weight layout on this build (0: no packed layout)");
  bind_decode_stack(m);
  m.def("lora_delta_", &lora_delta_, no_gil(), "y [T, out] += LoRA deltas of the rows with an adapter slot, in a fixed "
        "order (float32 rows; slot weights float32, float16 or bfloat16; lora_delta.cpp)", pybind11::arg("y"), pybind11::arg("x"), pybind11::arg("slots"),
        pybind11::arg("a"), pybind11::arg("bs"), pybind11::arg("rank"));
  m.def("pool_stats", [] {
    const lmserve::PoolStats s = lmserve::pool_stats();
    return std::map<std::string, int64_t>{{"jobs", s.jobs}, {"inline_jobs", s.inline_jobs},
                                          {"worker_parks", s.worker_parks}, {"wakeups", s.wakeups},
                                          {"caller_parks", s.caller_parks}, {"stalls", s.stalls},
                                          {"backoffs", s.backoffs}};
  }, "counters of the kernels' worker pool since it started (thread_pool.h)");
  m.def("pool_machine", [] {
    const lmserve::MachineView v = lmserve::pool_machine();
    return pybind11::dict(pybind11::arg("cpus") = v.cpus, pybind11::arg("others_cores") = v.others,
                          pybind11::arg("threads") = v.threads, pybind11::arg("poll") = v.poll);
  }, "what the pool last saw of the machine (cores other processes keep busy) and the plan it gives");
  m.def("pool_plan", [](int cpus, double others_cores, int requested) {
    const lmserve::Plan p = lmserve::plan_for(cpus, others_cores, requested);
    return pybind11::make_tuple(p.threads, p.poll);
  }, "(threads, workers poll) for `cpus` usable cores of which others keep `others_cores` busy (thread_pool.h)");
  m.def("pool_tuning", [] {
    const lmserve::PoolTuning& t = lmserve::pool_tuning();
    return std::map<std::string, int64_t>{{"worker_poll_us", t.worker_poll_us}, {"pure_spin_us", t.pure_spin_us},
                                          {"caller_spin_us", t.caller_spin_us},
                                          {"chunks_per_thread", t.chunks_per_thread}, {"adaptive", t.adaptive}};
  }, "the pool's waits and policy (thread_pool.h)");
  m.def("set_pool_tuning", [](int64_t worker_poll_us, int64_t pure_spin_us, int64_t caller_spin_us,
                              int64_t chunks_per_thread, int64_t adaptive) {
    lmserve::pool_tuning() = {worker_poll_us, pure_spin_us, caller_spin_us, std::max<int64_t>(chunks_per_thread, 1),
                              adaptive != 0};
  }, "set the pool's waits and policy (benchmarks/pool_spin.py measures them)", pybind11::arg("worker_poll_us"),
        pybind11::arg("pure_spin_us"), pybind11::arg("caller_spin_us"), pybind11::arg("chunks_per_thread"),
        pybind11::arg("adaptive"));
  // the gate between a server's models on a CPU (cpu_gate.h; worker/cpu_gate.py holds and passes it)
  m.def("gate_hold", &lmserve::gate_hold, "an encoder's short step begins: generative steps pause at their next layer");
  m.def("gate_release", &lmserve::gate_release, "that step has ended (the last release wakes the paused steps)");
  m.def("gate_begin_step", &lmserve::gate_begin_step, no_gil(), pybind11::arg("allowance_us"),
        "a generative step begins on this thread: it may pause allowance_us in all; pauses now if the gate is held "
        "(returns the microseconds waited)");
  m.def("gate_end_step", &lmserve::gate_end_step, "the step has ended: no pause on this thread until the next "
        "begins (returns the microseconds the step waited)");
  m.def("gate_pause", &lmserve::gate_pause, no_gil(),
        "wait while the gate is held, within this thread's step allowance (returns the microseconds waited)");
  m.def("gate_stats", [] {
    const lmserve::GateStats s = lmserve::gate_stats();
    return std::map<std::string, int64_t>{{"holds", s.holds}, {"pauses", s.pauses}, {"paused_us", s.paused_us}};
  }, "counters of the gate since the process started (cpu_gate.h)");
  m.def("skinny_linear", &skinny_linear, no_gil(), "y = x W^T (+ b) for a few rows, W in [N/16, K, 16] panels (float32, CPU)");
  m.def("coded_half_linear", &coded_half_linear, no_gil(),
        "skinny_linear over a bfloat16 matrix coded in 12 bits a weight: panel tables of high bytes + exceptions");
  m.def("coded_half_rows", &coded_half_rows, no_gil(), "rows ids of a coded_half_linear matrix, float32 [T, K]");
  m.def("code_half_panels", &code_half_panels, no_gil(),
        "bfloat16 panels [N/16, K, 16] -> (codes, tables, exc_off, exc_pos, exc_val) for coded_half_linear");
  m.def("skinny_linear_experts", &skinny_linear_experts, no_gil(),
        "rows [offsets[e], offsets[e+1]) of x times expert e's panels [E, N/16, K, 16] (float32, CPU)");
  m.def("quant_linear_experts", &quant_linear_experts, no_gil(),
        "rows [offsets[e], offsets[e+1]) of x times expert e's packed GGUF-derived codes [E, N/16, K/32, *] (CPU)");
}
