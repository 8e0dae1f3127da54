// The transport seam and the implementations that wrap torch's objects: see
// transport.h and [Note: transports]. (The shared-memory transport, and each
// wrapper, live in files of their own.)
#include "transport/transport.h"

#include "ops/flatten.h"
#include "transport/comm_hook_transport.h"
#include "transport/process_group_transport.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <sstream>

namespace pydist {
namespace transport {

const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::kAllReduce: return "all-reduce";
    case Collective::kReduceScatter: return "reduce-scatter";
    case Collective::kAllGather: return "all-gather";
  }
  return "collective";
}

namespace {
thread_local int64_t priority_ = 0;  // see [Note: transfer priority]
}  // namespace

PriorityScope::PriorityScope(int64_t priority) : previous_(priority_) { priority_ = priority; }
PriorityScope::~PriorityScope() { priority_ = previous_; }
int64_t current_priority() { return priority_; }

int64_t Future::wait() const {
  TORCH_CHECK(done_, "transport Future: waited on a future that holds no collective");
  if (bounded_wait_) bounded_wait_();
  done_->waitAndThrow();
  return done_->value().toInt();
}

namespace {

// Completes with the time `parent` completed, or with its error.
c10::intrusive_ptr<c10::ivalue::Future> stamped(const c10::intrusive_ptr<c10::ivalue::Future>& parent, bool stamp) {
  return parent->then(
      [stamp](c10::ivalue::Future& done) -> c10::IValue {
        if (done.hasError()) std::rethrow_exception(done.exception_ptr());
        return stamp ? steady_now_ns() : int64_t{-1};
      },
      c10::IntType::get());
}

}  // namespace

// --- all_gather_many ---------------------------------------------------------

int64_t check_all_gather_many(const char* who, const std::vector<at::Tensor>& inputs,
                              const std::vector<std::vector<at::Tensor>>& outputs, int64_t world_size) {
  TORCH_CHECK(!inputs.empty(), who, ": needs at least one input (its dtype is the collective's)");
  const at::Tensor& first = inputs[0];
  auto check_one = [&](const at::Tensor& t, const char* role, int64_t q, size_t i) {
    TORCH_CHECK(t.defined() && t.is_contiguous(), who, ": ", role, q < 0 ? "" : c10::str("[", q, "]"), "[", i,
                "] is ", t.defined() ? "not contiguous" : "None");
    TORCH_CHECK(t.scalar_type() == first.scalar_type() && t.device() == first.device(), who, ": ", role,
                q < 0 ? "" : c10::str("[", q, "]"), "[", i, "] is ", t.scalar_type(), " on ", t.device(),
                ", inputs[0] ", first.scalar_type(), " on ", first.device());
  };
  int64_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_one(inputs[i], "inputs", -1, i);
    total += inputs[i].numel();
  }
  TORCH_CHECK(static_cast<int64_t>(outputs.size()) == world_size, who, ": outputs has ", outputs.size(),
              " lists, one per rank (world_size ", world_size, ") expected");
  for (int64_t q = 0; q < world_size; ++q) {
    const auto& mine = outputs[static_cast<size_t>(q)];
    TORCH_CHECK(mine.size() == inputs.size(), who, ": outputs[", q, "] has ", mine.size(), " tensors, one per input (",
                inputs.size(), ") expected");
    for (size_t i = 0; i < mine.size(); ++i) {
      check_one(mine[i], "outputs", q, i);
      TORCH_CHECK(mine[i].numel() == inputs[i].numel(), who, ": outputs[", q, "][", i, "] has ", mine[i].numel(),
                  " elements, inputs[", i, "] ", inputs[i].numel());
    }
  }
  return total;
}

int64_t all_gather_many_bytes(const std::vector<at::Tensor>& inputs, int64_t world_size) {
  int64_t bytes = 0;
  for (const at::Tensor& t : inputs) bytes += static_cast<int64_t>(t.nbytes());
  return bytes * world_size;
}

// The oracle every transport has: concatenate, all_gather, copy out.
Future Transport::all_gather_many(std::vector<at::Tensor> inputs, std::vector<std::vector<at::Tensor>> outputs) {
  const int64_t n = world_size();
  const int64_t per_rank = check_all_gather_many("Transport.all_gather_many", inputs, outputs, n);
  at::Tensor joined = ops::flatten(inputs);
  at::Tensor gathered = at::empty({per_rank * n}, joined.options());
  Future inner = all_gather(joined, gathered);
  // The copy out runs on the thread that completes the all-gather. The
  // tensors stay with the returned handle: see [Note: who lets go of a
  // collective's tensors] in transport.h.
  struct Pending {
    at::Tensor joined, gathered;
    std::vector<std::vector<at::Tensor>> outputs;
  };
  auto pending = std::make_shared<Pending>(Pending{std::move(joined), std::move(gathered), std::move(outputs)});
  const bool stamp = stamp_completion();
  if (!pending->gathered.is_cpu()) {
    // A device collective completes on the host before its copies are done
    // on the group's streams (gloo stages a CUDA all-gather through pinned
    // memory and copies back on a stream of its own; only its Work::wait
    // orders the caller's stream behind that copy). So the copy out runs on
    // the waiting thread, on its current stream, after the group's wait.
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
    auto once = std::make_shared<std::once_flag>();
    auto copy_out = [inner, pending, per_rank, n, done, once, stamp] {
      std::call_once(*once, [&] {
        const int64_t completed = inner.wait();
        for (int64_t q = 0; q < n; ++q) {
          ops::unflatten_into(pending->gathered.narrow(0, q * per_rank, per_rank),
                              pending->outputs[static_cast<size_t>(q)], 1.0);
        }
        done->markCompleted(stamp ? steady_now_ns() : completed);
      });
    };
    return Future(std::move(done), std::move(copy_out), inner.inner(), std::move(pending));
  }
  auto done = inner.ivalue()->then(
      [pending, per_rank, n, stamp](c10::ivalue::Future& finished) -> c10::IValue {
        if (finished.hasError()) std::rethrow_exception(finished.exception_ptr());
        for (int64_t q = 0; q < n; ++q) {
          ops::unflatten_into(pending->gathered.narrow(0, q * per_rank, per_rank),
                              pending->outputs[static_cast<size_t>(q)], 1.0);
        }
        return stamp ? steady_now_ns() : int64_t{-1};
      },
      c10::IntType::get());
  return Future(std::move(done), [inner] { inner.wait(); }, inner.inner(), std::move(pending));
}

// --- wrappers ---------------------------------------------------------------

WrappingTransport::WrappingTransport(std::shared_ptr<Transport> inner) : inner_(std::move(inner)) {
  TORCH_CHECK(inner_, "WrappingTransport: the transport to wrap is None");
  Transport::set_stamp_completion(inner_->stamp_completion());
}

namespace {
std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<std::string, WrapperFactory>& registry() {
  static std::map<std::string, WrapperFactory> factories;
  return factories;
}
}  // namespace

bool register_wrapper(const std::string& name, WrapperFactory factory) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  TORCH_CHECK(registry().emplace(name, std::move(factory)).second, "register_wrapper: a transport wrapper named '",
              name, "' is registered already");
  return true;
}

std::vector<std::string> registered_wrappers() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> names;
  for (const auto& entry : registry()) names.push_back(entry.first);
  return names;
}

std::shared_ptr<Transport> wrap(const std::string& name, std::shared_ptr<Transport> inner,
                                const WrapperOptions& options) {
  WrapperFactory factory;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto found = registry().find(name);
    if (found != registry().end()) factory = found->second;
  }
  if (!factory) {
    std::ostringstream known;
    for (const std::string& known_name : registered_wrappers()) known << " '" << known_name << "'";
    TORCH_CHECK(false, "pydist.transport.wrap: no transport wrapper named '", name, "'; registered:", known.str());
  }
  TORCH_CHECK(inner, "pydist.transport.wrap('", name, "'): the transport to wrap is None");
  return factory(std::move(inner), options);
}

// --- ProcessGroupTransport ---------------------------------------------------
// _reduce_scatter_base, _allgather_base and their coalesced forms are the
// names torch 2.11 has; 2.13 keeps them, deprecated, as aliases.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> process_group)
    : process_group_(std::move(process_group)) {
  TORCH_CHECK(process_group_, "ProcessGroupTransport: process_group is None");
}

namespace {

// Waits on `work`; a failure is rethrown with `context` after the group's
// own message (see ProcessGroupTransport::set_failure_context).
void wait_naming(const c10::intrusive_ptr<c10d::Work>& work, const std::string& context) {
  if (context.empty()) {
    work->wait();
    return;
  }
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(e.what()) + "; " + context);
  }
}

}  // namespace

Future ProcessGroupTransport::track(c10::intrusive_ptr<c10d::Work> work) const {
  c10::intrusive_ptr<c10::ivalue::Future> inner;
  try {
    inner = work->getFuture();
  } catch (const c10::Error&) {
    // Some collectives have no future (gloo's reduce-scatter): the handle
    // then completes when it is waited on, stamped with that time.
  }
  const std::string context = failure_context_;
  if (inner) return Future(stamped(inner, stamp_completion()), [work, context] { wait_naming(work, context); });
  auto done = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
  auto once = std::make_shared<std::once_flag>();
  const bool stamp = stamp_completion();
  return Future(done, [work, done, once, stamp, context] {
    wait_naming(work, context);
    std::call_once(*once, [&] { done->markCompleted(stamp ? steady_now_ns() : int64_t{-1}); });
  });
}

// Process groups take real dtypes only (gloo refuses complex, as torch's own
// collectives know: they pass view_as_real). A complex tensor goes as its
// interleaved real and imaginary parts: the same bytes, and a sum of them is
// the complex sum.
static at::Tensor as_real(const at::Tensor& t) { return t.is_complex() ? at::view_as_real(t).view(-1) : t; }

Future ProcessGroupTransport::all_reduce(at::Tensor piece, double scale) {
  if (scale != 1.0) piece.mul_(scale);
  std::vector<at::Tensor> tensors{as_real(piece)};
  return track(process_group_->allreduce(tensors));
}

Future ProcessGroupTransport::reduce_scatter(at::Tensor input, at::Tensor output_shard, double scale) {
  TORCH_CHECK(input.numel() == output_shard.numel() * world_size(), "ProcessGroupTransport.reduce_scatter: input has ",
              input.numel(), " elements, world_size (", world_size(), ") x output_shard (", output_shard.numel(),
              ") expected");
  at::Tensor scaled = as_real(scale != 1.0 ? input * scale : input);
  output_shard = as_real(output_shard);
  try {
    return track(process_group_->_reduce_scatter_base(output_shard, scaled));
  } catch (const c10::Error&) {
    // A group written in Python (the mpi4py backend) overrides only the
    // coalesced form; it has no backend registered for the plain one.
    std::vector<at::Tensor> outputs{output_shard};
    std::vector<at::Tensor> inputs{scaled};
    return track(process_group_->reduce_scatter_tensor_coalesced(outputs, inputs));
  }
}

Future ProcessGroupTransport::all_gather(at::Tensor shard, at::Tensor output) {
  TORCH_CHECK(output.numel() == shard.numel() * world_size(), "ProcessGroupTransport.all_gather: output has ",
              output.numel(), " elements, world_size (", world_size(), ") x shard (", shard.numel(), ") expected");
  shard = as_real(shard);
  output = as_real(output);
  try {
    return track(process_group_->_allgather_base(output, shard));
  } catch (const c10::Error&) {
    std::vector<at::Tensor> outputs{output};
    std::vector<at::Tensor> inputs{shard};
    return track(process_group_->allgather_into_tensor_coalesced(outputs, inputs));
  }
}

#pragma GCC diagnostic pop

// --- CommHookTransport -------------------------------------------------------

CommHookTransport::CommHookTransport(std::unique_ptr<c10d::CommHookInterface> hook, int64_t rank, int64_t world_size)
    : hook_(std::move(hook)), rank_(rank), world_size_(world_size) {
  TORCH_CHECK(hook_, "CommHookTransport: the hook is None");
}

Future CommHookTransport::all_reduce_bucket(at::Tensor /*piece*/, double /*scale*/, c10d::GradBucket& bucket) {
  auto result = hook_->runHook(bucket);
  auto done = stamped(result, stamp_completion());
  return Future(std::move(done), {}, std::move(result));
}

at::Tensor CommHookTransport::result_of(const Future& future, const at::Tensor& piece) {
  at::Tensor result = hook_->parseHookResult(future.inner()->value()).view(-1);
  TORCH_CHECK(result.numel() == piece.numel(), "comm hook returned a tensor of ", result.numel(),
              " elements for a bucket of ", piece.numel());
  return result;
}

Future CommHookTransport::all_reduce(at::Tensor /*piece*/, double /*scale*/) {
  TORCH_CHECK(false, "CommHookTransport: a comm hook all-reduces whole buckets (all_reduce_bucket)");
}

Future CommHookTransport::reduce_scatter(at::Tensor /*input*/, at::Tensor /*output_shard*/, double /*scale*/) {
  TORCH_CHECK(false, "CommHookTransport: a DDP comm hook only all-reduces buckets, it cannot reduce-scatter");
}

Future CommHookTransport::all_gather(at::Tensor /*shard*/, at::Tensor /*output*/) {
  TORCH_CHECK(false, "CommHookTransport: a DDP comm hook only all-reduces buckets, it cannot all-gather");
}

Future CommHookTransport::all_gather_many(std::vector<at::Tensor> /*inputs*/,
                                          std::vector<std::vector<at::Tensor>> /*outputs*/) {
  TORCH_CHECK(false, "CommHookTransport: a DDP comm hook only all-reduces buckets, it cannot all-gather");
}

}  // namespace transport
}  // namespace pydist
