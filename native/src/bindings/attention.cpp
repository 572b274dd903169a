#include "bindings.h"

namespace specd::py_bind {

void register_attention(py::module_& m) { (void)m; }

}  // namespace specd::py_bind
