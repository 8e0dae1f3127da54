// pydist._C: the one place where op schemas are declared, and the Python
// bindings of the C++ runtime. Device files (ops/flatten_cpu.cpp,
// ops/flatten_cuda.cpp) only register implementations of these schemas.
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/utils/pybind.h>

#include <torch/csrc/distributed/c10d/python_comm_hook.h>

#include "fsdp/output_gate.h"
#include "fsdp/unit_ops.h"
#include "reducer/reducer.h"
#include "transport/comm_hook_transport.h"
#include "transport/process_group_transport.h"
#include "transport/shm_transport.h"

namespace py = pybind11;

namespace pydist::transport {  // csrc/transport/hierarchical_transport.cpp: see [Note: hierarchical collectives]
std::shared_ptr<Transport> make_hierarchical_transport(std::shared_ptr<Transport> local_in,
                                                       std::shared_ptr<Transport> local_out,
                                                       std::shared_ptr<Transport> cross, int64_t rank,
                                                       std::vector<std::vector<int64_t>> rank_of,
                                                       std::vector<std::string> host_names);
}

#include "ops/streaming_copy.h"

namespace {

// [Note: freed without the GIL]
// Freeing some of our objects waits for another thread: a Reducer or a
// ProcessGroupTransport may hold the last reference to a process group (the
// script called destroy_process_group first), whose destructor (gloo's) joins
// its worker threads; a ShmTransport or a wrapper with a thread joins its own.
// A worker finishing a collective lets go of that collective's tensors, and
// letting go of a tensor Python also holds takes the GIL. Python frees our
// objects holding the GIL, so the two threads would wait on each other for
// ever (jobs hung at exit). So every such object handed to Python is freed
// with the GIL released, as torch's bindings free a ProcessGroup
// (IntrusivePtrNoGilDestructor).
template <typename T>
std::shared_ptr<T> freed_without_gil(std::shared_ptr<T> object) {
  T* raw = object.get();
  return std::shared_ptr<T>(raw, [object = std::move(object)](T*) mutable {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      object.reset();
    } else {
      object.reset();
    }
  });
}

}  // namespace

TORCH_LIBRARY(pydist, m) {
  // See csrc/ops/flatten.h for what each op promises and requires.
  m.def("flatten(Tensor[] tensors) -> Tensor");
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) out, float scale=1.0) -> ()");
  m.def("unflatten_into(Tensor flat, Tensor(a!)[] tensors, float scale=1.0) -> ()");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pydist's compiled runtime: fused flatten ops and the gradient reducer";

  using pydist::Reducer;
  // Records: csrc/reducer/records.h, [Note: record clocks].
  py::class_<pydist::ChunkRecord>(m, "ChunkRecord", "One collective of a bucket; ns since the iteration's start_ns")
      .def_readonly("offset", &pydist::ChunkRecord::offset)
      .def_readonly("bytes", &pydist::ChunkRecord::bytes)
      .def_property_readonly("collective",
                             [](const pydist::ChunkRecord& r) { return std::string(pydist::record_name(r.collective)); })
      .def_readonly("launch_ns", &pydist::ChunkRecord::launch_ns)
      .def_readonly("complete_ns", &pydist::ChunkRecord::complete_ns);
  py::class_<pydist::BucketRecord>(m, "BucketRecord", "Timing of one bucket; ns since the iteration's start_ns")
      .def_readonly("index", &pydist::BucketRecord::index)
      .def_readonly("num_params", &pydist::BucketRecord::num_params)
      .def_readonly("bytes", &pydist::BucketRecord::bytes)
      .def_readonly("first_grad_ns", &pydist::BucketRecord::first_grad_ns)
      .def_readonly("last_grad_ns", &pydist::BucketRecord::last_grad_ns)
      .def_readonly("launch_ns", &pydist::BucketRecord::launch_ns)
      .def_readonly("complete_ns", &pydist::BucketRecord::complete_ns)
      .def_readonly("done_ns", &pydist::BucketRecord::done_ns)
      .def_readonly("chunks", &pydist::BucketRecord::chunks)
      .def_readonly("param_indices", &pydist::BucketRecord::param_indices)
      .def_readonly("grad_ns", &pydist::BucketRecord::grad_ns);
  py::class_<pydist::IterationRecord>(m, "IterationRecord", "What the reducer measured in one iteration")
      .def_readonly("iteration", &pydist::IterationRecord::iteration)
      .def_readonly("rank", &pydist::IterationRecord::rank)
      .def_readonly("transport", &pydist::IterationRecord::transport)
      .def_readonly("start_ns", &pydist::IterationRecord::start_ns)
      .def_readonly("backward_end_ns", &pydist::IterationRecord::backward_end_ns)
      .def_readonly("finalize_end_ns", &pydist::IterationRecord::finalize_end_ns)
      .def_readonly("buckets", &pydist::IterationRecord::buckets);
  m.attr("DEFAULT_RECORDS_KEPT") = pydist::kDefaultRecordsKept;
  m.def("profiler_clock_offset_ns", &pydist::profiler_clock_offset_ns,
        "ns to add to a steady-clock (time.monotonic_ns) time to get torch.profiler's clock");

  // Methods that wait on collectives release the GIL: a process group written
  // in Python (the mpi4py backend) needs it to make progress.
  auto nogil = py::call_guard<py::gil_scoped_release>();
  // pydist.transport: see csrc/transport/transport.h, [Note: transports].
  namespace tp = pydist::transport;
  using pydist::ShmTransport;
  py::class_<tp::Future>(m, "TransportFuture", "One collective in flight on a transport")
      .def("wait", &tp::Future::wait, nogil,
           "Blocks until done (raises its error); returns the completion time in ns on the steady clock "
           "(time.monotonic_ns's clock), or -1 when the transport stamps no times")
      .def("done", &tp::Future::completed);
  py::class_<tp::Transport, std::shared_ptr<tp::Transport>>(m, "Transport",
                                                              "Moves tensors between the ranks of one group")
      .def(
          "all_reduce",
          [](tp::Transport& t, at::Tensor piece, double scale, int64_t priority) {
            tp::PriorityScope scope(priority);  // [Note: transfer priority]
            return t.all_reduce(std::move(piece), scale);
          },
          py::arg("piece"), py::arg("scale") = 1.0, py::kw_only(), py::arg("priority") = 0, nogil,
          "piece := sum over ranks of piece * scale, in place; `priority` (higher: more urgent) orders the "
          "transfer on a transport that orders by priority (sim_net, ordered), and is ignored elsewhere")
      .def("reduce_scatter", &tp::Transport::reduce_scatter, py::arg("input"), py::arg("output_shard"),
           py::arg("scale") = 1.0, nogil,
           "output_shard := sum over ranks of shard `rank` of input (world_size contiguous shards) * scale")
      .def("all_gather", &tp::Transport::all_gather, py::arg("shard"), py::arg("output"), nogil,
           "output := every rank's shard, in rank order")
      .def("all_gather_many", &tp::Transport::all_gather_many, py::arg("inputs"), py::arg("outputs"), nogil,
           "outputs[q][i] := rank q's inputs[i]: one all-gather of the inputs' concatenation, scattered into "
           "the outputs (one list per rank, matching inputs' sizes)")
      .def(
          "empty_buffer",
          [](tp::Transport& t, int64_t numel, at::ScalarType dtype) {
            return t.empty_buffer(numel, at::TensorOptions().dtype(dtype));
          },
          py::arg("numel"), py::arg("dtype") = at::kFloat,
          "an uninitialized 1-d CPU tensor to all-reduce pieces of: the shared-memory transport reduces "
          "pieces of such buffers in place ([Note: buckets in shared memory])")
      .def("stats", &tp::Transport::stats,
           "counters a wrapper keeps, or the shared-memory transport's in-place and copied all-reduces; "
           "empty otherwise")
      .def("abort", &tp::Transport::abort, py::arg("why"),
           "this rank has failed: peers waiting on it through shared memory fail at once repeating `why`")
      .def("set_stamp_completion", &tp::Transport::set_stamp_completion, py::arg("on"))
      .def_property_readonly("applies_scale", &tp::Transport::applies_scale)
      .def_property_readonly("owns_buckets", &tp::Transport::owns_buckets)
      .def_property_readonly("orders_by_priority", &tp::Transport::orders_by_priority,
                             "whether it orders the collectives launched through it by priority (sim_net, ordered)")
      .def_property_readonly("rank", &tp::Transport::rank)
      .def_property_readonly("world_size", &tp::Transport::world_size)
      .def_property_readonly("name", &tp::Transport::name);
  py::class_<tp::ProcessGroupTransport, tp::Transport, std::shared_ptr<tp::ProcessGroupTransport>>(
      m, "ProcessGroupTransport", "A torch ProcessGroup (gloo, NCCL, the mpi4py backend) as a transport")
      .def(py::init([](c10::intrusive_ptr<c10d::ProcessGroup> pg) {
             return freed_without_gil(std::make_shared<tp::ProcessGroupTransport>(std::move(pg)));
           }),
           py::arg("process_group"))
      .def_property("failure_context", &tp::ProcessGroupTransport::failure_context,
                    &tp::ProcessGroupTransport::set_failure_context,
                    "Appended to a failed collective's error: the hosts this rank may have lost");
  py::class_<ShmTransport, tp::Transport, std::shared_ptr<ShmTransport>>(
      m, "ShmTransport", "Collectives through shared memory for ranks on one host (csrc/transport/shm_transport.h)")
      .def(py::init([](std::string name, int64_t rank, int64_t world_size, bool create, double timeout_s) {
             return freed_without_gil(std::make_shared<ShmTransport>(
                 std::move(name), rank, world_size, create,
                 std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1e3))));
           }),
           py::arg("name"), py::arg("rank"), py::arg("world_size"), py::arg("create"), py::arg("timeout_s"), nogil)
      .def("unlink", &ShmTransport::unlink)
      .def("close", &ShmTransport::shut_down, nogil,
           "this rank leaves now: peers waiting on it fail at once, later collectives here raise")
      .def(
          "allreduce_",
          [](ShmTransport& self, at::Tensor tensor, double scale) {
            self.all_reduce(tensor, scale).wait();
            return tensor;
          },
          py::arg("tensor"), py::arg("scale") = 1.0, nogil,
          "Sum of every rank's tensor times scale, in place; blocks until done")
      .def_static("supports", &ShmTransport::supports, py::arg("dtype"))
      .def_property_readonly("segment_name", &ShmTransport::segment_name);
  m.def(
      "wrap_transport",
      [](const std::string& name, std::shared_ptr<tp::Transport> inner, const tp::WrapperOptions& options) {
        return freed_without_gil(tp::wrap(name, std::move(inner), options));
      },
      py::arg("name"), py::arg("inner"), py::arg("options") = tp::WrapperOptions{},
        "Puts the registered wrapper `name` in front of `inner`");
  m.def("registered_wrappers", &tp::registered_wrappers);
  m.def(
      "hierarchical_transport",
      [](std::shared_ptr<tp::Transport> local_in, std::shared_ptr<tp::Transport> local_out,
         std::shared_ptr<tp::Transport> cross, int64_t rank, std::vector<std::vector<int64_t>> rank_of,
         std::vector<std::string> host_names) {
        return freed_without_gil(tp::make_hierarchical_transport(std::move(local_in), std::move(local_out),
                                                                 std::move(cross), rank, std::move(rank_of),
                                                                 std::move(host_names)));
      },
      py::arg("local_in"), py::arg("local_out"), py::arg("cross"), py::arg("rank"), py::arg("rank_of"),
      py::arg("host_names"),
      "Shared memory inside each host + a process group across hosts (csrc/transport/hierarchical_transport.cpp)");

  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer", "The C++ gradient reducer (csrc/reducer/reducer.h)")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       std::vector<std::vector<int64_t>> buckets, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                       bool gradient_as_bucket_view, bool find_unused_parameters, bool static_graph,
                       bool rebuild_buckets, bool record_timing, int64_t chunk_bytes, std::shared_ptr<tp::Transport> transport,
                       int64_t records_kept) {
             pydist::ReducerOptions options;
             options.gradient_as_bucket_view = gradient_as_bucket_view;
             options.find_unused_parameters = find_unused_parameters;
             options.static_graph = static_graph;
             options.rebuild_buckets = rebuild_buckets;
             options.record_timing = record_timing;
             options.chunk_bytes = chunk_bytes;
             options.records_kept = records_kept;
             if (!transport) transport = freed_without_gil(std::make_shared<tp::ProcessGroupTransport>(pg));
             return freed_without_gil(std::make_shared<Reducer>(std::move(params), std::move(names),
                                                                std::move(buckets), std::move(pg), options,
                                                                std::move(transport)));
           }),
           py::arg("params"), py::arg("param_names"), py::arg("bucket_indices"), py::arg("process_group"),
           py::arg("gradient_as_bucket_view") = false, py::arg("find_unused_parameters") = false,
           py::arg("static_graph") = false, py::arg("rebuild_buckets") = false, py::arg("record_timing") = false,
           py::arg("chunk_bytes") = pydist::ReducerOptions{}.chunk_bytes, py::arg("transport") = nullptr,
           py::arg("records_kept") = pydist::kDefaultRecordsKept)
      .def("rebuild_buckets", &Reducer::rebuild_buckets, nogil)
      .def("prepare_for_backward", &Reducer::prepare_for_backward, nogil)
      .def_property_readonly("walks_outputs", &Reducer::walks_outputs)
      .def("delay_all_reduce", &Reducer::delay_all_reduce, nogil)
      .def(
          "set_comm_hook",
          [](Reducer& self, py::object state, py::object hook) {
            auto current = self.transport();
            self.set_comm_hook(std::make_shared<tp::CommHookTransport>(
                std::make_unique<c10d::PythonCommHook>(std::move(state), std::move(hook)), current->rank(),
                current->world_size()));
          },
          py::arg("state"), py::arg("hook"))
      .def("set_transport", &Reducer::set_transport, py::arg("transport"),
           "Puts another transport (a wrapper in front of this one) under the reducer: before the first backward, or "
           "later between iterations if it hands buckets to user code exactly when the current one does")
      .def_property_readonly("transport", &Reducer::transport)
      .def("match_all_reduce_for_bwd_pass", &Reducer::match_all_reduce_for_bwd_pass, nogil)
      .def("match_unused_params_allreduce", &Reducer::match_unused_params_allreduce, nogil)
      // Every method that takes the reducer's mutex releases the GIL first:
      // with overlap_optimizer a worker thread may hold that mutex in
      // finish_bucket while its write-back needs the GIL (letting go of a
      // tensor Python also holds), so a caller holding the GIL would deadlock.
      .def("pending_rebuild_order", &Reducer::pending_rebuild_order, nogil,
           "The order gradients became ready, when a bucket rebuild is due; else None")
      .def("bucket_indices", &Reducer::bucket_indices, nogil)
      .def_property_readonly("has_rebuilt_buckets", py::cpp_function(&Reducer::has_rebuilt_buckets, nogil))
      .def("last_record", &Reducer::last_record, nogil)
      .def("iteration_records", &Reducer::iteration_records, nogil)
      .def("clear_records", &Reducer::clear_records, nogil)
      .def("set_record_timing", &Reducer::set_record_timing, py::arg("on"), py::arg("keep") = pydist::kDefaultRecordsKept,
           nogil)
      .def("set_average_divisor", &Reducer::set_average_divisor, nogil)
      .def("set_defer_finalize", &Reducer::set_defer_finalize, py::arg("on"), nogil)
      .def_property_readonly("defer_finalize", py::cpp_function(&Reducer::defer_finalize, nogil))
      .def("finish_bucket", &Reducer::finish_bucket, py::arg("bucket_index"), nogil)
      .def("landed_buckets", &Reducer::landed_buckets, nogil)
      .def("finish_all", &Reducer::finish_all, nogil)
      .def_property_readonly("state", py::cpp_function(&Reducer::state, nogil));

  // pydist/fsdp's ops on a unit's tensors: csrc/fsdp/unit_ops.h ([Note:
  // packing a unit into a rank-major reduce-scatter input]).
  m.def("pack_rank_major", &pydist::fsdp::pack_rank_major, py::arg("grads"), py::arg("numels"), py::arg("out"),
        py::arg("world_size"), py::arg("column"), py::arg("shard_numel"), py::arg("scale") = 1.0, nogil,
        "Writes a unit's gradients (None: zeros), times scale, into its column of a rank-major reduce-scatter input");
  m.def("pack_param_grads", &pydist::fsdp::pack_param_grads, py::arg("params"), py::arg("numels"), py::arg("out"),
        py::arg("world_size"), py::arg("column"), py::arg("shard_numel"), py::arg("scale") = 1.0,
        "pack_rank_major of params' .grads (cast and made contiguous where needed), then clears them; returns which had one");
  m.def("pieces_like", &pydist::fsdp::pieces_like, py::arg("output"), py::arg("likes"), py::arg("offsets"),
        "Views output[offsets[i]:][:likes[i].numel()] in likes[i]'s shape (contiguous strides), one per tensor");
  m.def("hand_out_grads", &pydist::fsdp::hand_out_grads, py::arg("output"), py::arg("params"), py::arg("offsets"),
        "Each params[i].grad becomes output[offsets[i]:][:numel] in its shape, or that is added to it");
  m.def("point_storage_into", &pydist::fsdp::point_storage_into, py::arg("buffer"), py::arg("slot"), py::arg("offset_bytes"),
        "Points buffer's empty storage at slot's bytes from offset_bytes on, without owning them");
  m.def("point_storages_into", &pydist::fsdp::point_storages_into, py::arg("buffers"), py::arg("slot"),
        py::arg("offsets_bytes"), "point_storage_into of each buffer at its offset");
  m.def("point_storage_at_nothing", &pydist::fsdp::point_storage_at_nothing, py::arg("buffer"),
        "Leaves buffer's storage with no memory (frees it if it owned it); returns the address it held");

  // pydist/fsdp's hooks on unit outputs: csrc/fsdp/output_gate.h.
  py::class_<pydist::fsdp::OutputGate, std::shared_ptr<pydist::fsdp::OutputGate>>(
      m, "OutputGate", "A unit output's backward hook that can be closed (csrc/fsdp/output_gate.h)")
      .def(py::init<py::object>(), py::arg("callback"))
      .def("attach", &pydist::fsdp::OutputGate::attach, py::arg("output"),
           "Registers the gate as a backward hook of output (which requires grad)")
      .def("close", &pydist::fsdp::OutputGate::close, py::arg("pack") = nullptr,
           "From now on the hook returns at once, without the GIL, packing `pack` (a GradPack) when it fires")
      .def_property_readonly("closed", &pydist::fsdp::OutputGate::closed);
  py::class_<pydist::fsdp::GradPack, std::shared_ptr<pydist::fsdp::GradPack>>(
      m, "GradPack", "One unit's gradients on their way into its reduce batch (csrc/fsdp/output_gate.h)")
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>,
                    const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>&>(),
           py::arg("params"), py::arg("numels"), py::arg("columns"))
      .def("aim", &pydist::fsdp::GradPack::aim, py::arg("input"), py::arg("world_size"), py::arg("column"),
           py::arg("scale"))
      .def("pack", &pydist::fsdp::GradPack::pack)
      .def_property_readonly("packed", &pydist::fsdp::GradPack::packed)
      .def("take_had", &pydist::fsdp::GradPack::take_had);

  m.def("streaming_isa", &pydist::ops::streaming_isa,
        "instruction set the CPU flatten kernels stream large buffers with (avx512, avx or none)");
}
