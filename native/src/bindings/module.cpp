#include "bindings.h"

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "specd native kernel library: tensors and the CPU/GPU ops of the qwen35 target and drafters.";
  specd::py_bind::register_core(m);
  specd::py_bind::register_quants(m);
  specd::py_bind::register_norm(m);
  specd::py_bind::register_rope(m);
  specd::py_bind::register_attention(m);
  specd::py_bind::register_ssm(m);
  specd::py_bind::register_activations(m);
  specd::py_bind::register_sampling(m);
  specd::py_bind::register_copy(m);
}
