// pydist._C: the one place where op schemas are declared, and the Python
// bindings of the C++ runtime. Device files (ops/flatten_cpu.cpp,
// ops/flatten_cuda.cpp) only register implementations of these schemas.
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/utils/pybind.h>

#include "reducer/reducer.h"

namespace py = pybind11;

#include "ops/streaming_copy.h"

TORCH_LIBRARY(pydist, m) {
  // See csrc/ops/flatten.h for what each op promises and requires.
  m.def("flatten(Tensor[] tensors) -> Tensor");
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) out, float scale=1.0) -> ()");
  m.def("unflatten_into(Tensor flat, Tensor(a!)[] tensors, float scale=1.0) -> ()");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pydist's compiled runtime: fused flatten ops and the gradient reducer";
#ifdef PYDIST_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif

  using pydist::Reducer;
  py::class_<pydist::BucketRecord>(m, "BucketRecord", "Timing of one bucket; ns since backward began")
      .def_readonly("index", &pydist::BucketRecord::index)
      .def_readonly("num_params", &pydist::BucketRecord::num_params)
      .def_readonly("bytes", &pydist::BucketRecord::bytes)
      .def_readonly("first_grad_ns", &pydist::BucketRecord::first_grad_ns)
      .def_readonly("last_grad_ns", &pydist::BucketRecord::last_grad_ns)
      .def_readonly("launch_ns", &pydist::BucketRecord::launch_ns)
      .def_readonly("complete_ns", &pydist::BucketRecord::complete_ns)
      .def_readonly("done_ns", &pydist::BucketRecord::done_ns);
  py::class_<pydist::IterationRecord>(m, "IterationRecord", "What the reducer measured in one iteration")
      .def_readonly("iteration", &pydist::IterationRecord::iteration)
      .def_readonly("backward_end_ns", &pydist::IterationRecord::backward_end_ns)
      .def_readonly("finalize_end_ns", &pydist::IterationRecord::finalize_end_ns)
      .def_readonly("buckets", &pydist::IterationRecord::buckets);

  // Methods that wait on collectives release the GIL: a process group written
  // in Python (the mpi4py backend) needs it to make progress.
  auto nogil = py::call_guard<py::gil_scoped_release>();
  using pydist::ShmAllreduce;
  py::class_<ShmAllreduce, std::shared_ptr<ShmAllreduce>>(
      m, "ShmAllreduce", "All-reduce through shared memory for ranks on one host (csrc/shm/shm_allreduce.h)")
      .def(py::init([](std::string name, int64_t rank, int64_t world_size, bool create, double timeout_s) {
             return std::make_shared<ShmAllreduce>(std::move(name), rank, world_size, create,
                                                   std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1e3)));
           }),
           py::arg("name"), py::arg("rank"), py::arg("world_size"), py::arg("create"), py::arg("timeout_s"), nogil)
      .def("unlink", &ShmAllreduce::unlink)
      .def(
          "allreduce_",
          [](ShmAllreduce& self, at::Tensor tensor, double scale) {
            self.allreduce(tensor, scale)->waitAndThrow();
            return tensor;
          },
          py::arg("tensor"), py::arg("scale") = 1.0, nogil,
          "Sum of every rank's tensor times scale, in place; blocks until done")
      .def_static("supports", &ShmAllreduce::supports, py::arg("dtype"))
      .def_property_readonly("name", &ShmAllreduce::name)
      .def_property_readonly("rank", &ShmAllreduce::rank)
      .def_property_readonly("world_size", &ShmAllreduce::world_size);

  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer", "The C++ gradient reducer (csrc/reducer/reducer.h)")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       std::vector<std::vector<int64_t>> buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                       bool gradient_as_bucket_view, bool find_unused_parameters, bool static_graph,
                       bool record_timing, int64_t chunk_bytes, std::shared_ptr<ShmAllreduce> shm) {
             pydist::ReducerOptions options;
             options.gradient_as_bucket_view = gradient_as_bucket_view;
             options.find_unused_parameters = find_unused_parameters;
             options.static_graph = static_graph;
             options.record_timing = record_timing;
             options.chunk_bytes = chunk_bytes;
             return std::make_shared<Reducer>(std::move(params), std::move(names), std::move(buckets),
                                              std::move(pg), options, std::move(shm));
           }),
           py::arg("params"), py::arg("param_names"), py::arg("bucket_indices"), py::arg("process_group"),
           py::arg("gradient_as_bucket_view") = false, py::arg("find_unused_parameters") = false,
           py::arg("static_graph") = false, py::arg("record_timing") = false,
           py::arg("chunk_bytes") = pydist::ReducerOptions{}.chunk_bytes, py::arg("shm") = nullptr)
      .def("initialize_buckets", &Reducer::initialize_buckets, nogil)
      .def("rebuild_buckets", &Reducer::rebuild_buckets, nogil)
      .def("prepare_for_backward", &Reducer::prepare_for_backward, nogil)
      .def("delay_all_reduce", &Reducer::delay_all_reduce, nogil)
      .def("set_comm_hook", &Reducer::set_comm_hook)
      .def("match_all_reduce_for_bwd_pass", &Reducer::match_all_reduce_for_bwd_pass, nogil)
      .def("match_unused_params_allreduce", &Reducer::match_unused_params_allreduce, nogil)
      .def("ready_order", &Reducer::ready_order)
      .def("bucket_indices", &Reducer::bucket_indices)
      .def("should_rebuild_buckets", &Reducer::should_rebuild_buckets)
      .def("last_record", &Reducer::last_record)
      .def("set_record_timing", &Reducer::set_record_timing)
      .def("set_average_divisor", &Reducer::set_average_divisor)
      .def_property_readonly("num_iterations", &Reducer::num_iterations);

  m.def("streaming_isa", &pydist::ops::streaming_isa,
        "instruction set the CPU flatten kernels stream large buffers with (avx512, avx or none)");
}
