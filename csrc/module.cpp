// pydist._C: the one place where op schemas are declared, and the Python
// bindings of the C++ runtime. Device files (ops/flatten_cpu.cpp,
// ops/flatten_cuda.cpp) only register implementations of these schemas.
#include <torch/extension.h>
#include <torch/library.h>

#include "ops/streaming_copy.h"

TORCH_LIBRARY(pydist, m) {
  // See csrc/ops/flatten.h for what each op promises and requires.
  m.def("flatten(Tensor[] tensors) -> Tensor");
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) out) -> ()");
  m.def("unflatten_into(Tensor flat, Tensor(a!)[] tensors, float scale=1.0) -> ()");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pydist's compiled runtime: fused flatten ops and the gradient reducer";
#ifdef PYDIST_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("streaming_isa", &pydist::ops::streaming_isa,
        "instruction set the CPU flatten kernels stream large buffers with (avx512, avx or none)");
}
