#include "bindings.h"

namespace specd::py_bind {

void register_quants(py::module_& m) { (void)m; }

}  // namespace specd::py_bind
