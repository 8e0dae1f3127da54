// The seam every collective pydist issues goes through.
//
// [Note: transports]
// A Transport moves tensors between the ranks of one group. It offers the
// three collectives data parallelism needs, each asynchronous:
//
//   all_reduce(piece, scale)                   piece := sum over ranks of piece × scale
//   reduce_scatter(input, output_shard, scale) output_shard := sum over ranks of
//                                              (shard `rank` of input) × scale,
//                                              input being world_size contiguous shards
//   all_gather(shard, output)                  output := every rank's shard, in rank order
//   all_gather_many(inputs, outputs)           outputs[q] := rank q's inputs, piece by piece
//
// all_gather_many is one all-gather whose shard is the concatenation of
// `inputs` and whose output is scattered: rank q's part lands in the views
// outputs[q][0], outputs[q][1], ... (sizes those of inputs[0], inputs[1], ...).
// It lets a caller gather several buffers (the shards of a batch of sharded
// units) into several places (each unit's unsharded buffer) without staging
// through a concatenated input and a rank-major output of its own. It is the
// same collective as all_gather of the concatenation, to the peers too: a
// rank may pair it with a peer's all_gather of the same total. The base
// class implements it as exactly that (concatenate, all_gather, copy out on
// completion); the shared-memory transport moves the pieces straight
// through its segment.
//
// Each returns a transport::Future that completes with the time the
// collective finished (see Future), so a caller keeps one handle per piece in
// flight whatever carries it. Implementations:
//
//   ProcessGroupTransport  a torch ProcessGroup (gloo, NCCL, the mpi4py backend)
//   ShmTransport           shared memory, ranks on one host (shm_transport.h)
//   CommHookTransport      a user's DDP comm hook (comm_hook_transport.h)
//
// and wrappers that sit in front of any of them (WrappingTransport below;
// one file each, registered by name: register_wrapper, e.g. the counting
// wrapper in counting_transport.cpp). Every rank must issue the same
// collectives in the same order with the same sizes, as with a process group.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace pydist {
namespace transport {

enum class Collective { kAllReduce, kReduceScatter, kAllGather };
const char* collective_name(Collective kind);

// Nanoseconds on the steady clock (CLOCK_MONOTONIC on Linux), the clock
// completion times are stamped on.
inline int64_t steady_ns(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
inline int64_t steady_now_ns() { return steady_ns(std::chrono::steady_clock::now()); }

// One collective in flight. `done` completes with an int: the steady-clock
// time in ns at which the collective finished, as seen by the thread that
// finished it, or -1 when the transport does not stamp times (see
// Transport::set_stamp_completion); or it holds the collective's error.
class Future {
 public:
  Future() = default;
  // `bounded_wait`, if given, is a wait that gives up after the transport's
  // own timeout (a process group's Work::wait); wait() runs it first.
  // `inner`, if given, is the future of the work the transport wrapped (a
  // comm hook's, holding its result tensor). `keep_alive`, if given, is
  // what the transport's thread uses while it runs (the collective's
  // tensors), held by this handle too: see [Note: who lets go of a
  // collective's tensors].
  explicit Future(c10::intrusive_ptr<c10::ivalue::Future> done, std::function<void()> bounded_wait = {},
                  c10::intrusive_ptr<c10::ivalue::Future> inner = {}, std::shared_ptr<const void> keep_alive = {})
      : done_(std::move(done)),
        bounded_wait_(std::move(bounded_wait)),
        inner_(std::move(inner)),
        keep_alive_(std::move(keep_alive)) {}

  bool defined() const { return static_cast<bool>(done_); }
  // Blocks until the collective is done; throws its error. Returns the
  // completion time (or -1).
  int64_t wait() const;
  bool completed() const { return done_->completed(); }
  const c10::intrusive_ptr<c10::ivalue::Future>& ivalue() const { return done_; }
  const c10::intrusive_ptr<c10::ivalue::Future>& inner() const { return inner_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> done_;
  std::function<void()> bounded_wait_;
  c10::intrusive_ptr<c10::ivalue::Future> inner_;
  std::shared_ptr<const void> keep_alive_;
};

// [Note: who lets go of a collective's tensors]
// A tensor that Python also holds has its Python object kept alive by the
// C++ references to it (torch's PyObject preservation): the C++ reference
// that drops the count back to Python's alone decrefs that object, and so
// takes the GIL. A transport thread that let go of a batch's tensors itself
// would take the GIL once per tensor, while the caller runs Python (a
// prefetched gather completes during the previous unit's compute), and each
// time wait for the interpreter to hand it over. So a transport that keeps
// the tensors on its own thread also puts them in the Future's keep_alive:
// the handle the caller holds (in Python, with the GIL) keeps them until it
// is dropped there, and the thread's own release is then only a count.

// [Note: transfer priority]
// A caller may say how urgently the collectives it launches are needed: the
// reducer, under deferred finalize, launches each chunk inside a
// PriorityScope whose value is chunk_priority (higher: needed sooner by the
// next forward). The priority travels with the calling thread, not through
// the collectives' signatures, so every transport and wrapper passes it on
// untouched; a transport whose link can reorder queued transfers (the
// simulated link, sim_net_transport.cpp) reads current_priority() at launch
// and is the one place that decides the order on the link. The others
// ignore it: gloo, NCCL, mpi4py and shared memory carry collectives in launch
// order, the same on every rank. Default 0; equal priorities go in launch order.
class PriorityScope {
 public:
  explicit PriorityScope(int64_t priority);
  ~PriorityScope();
  PriorityScope(const PriorityScope&) = delete;
  PriorityScope& operator=(const PriorityScope&) = delete;

 private:
  int64_t previous_;
};
// The priority of the innermost PriorityScope on this thread (0 outside any).
int64_t current_priority();

class Transport {
 public:
  virtual ~Transport() = default;

  // See [Note: transports]. `piece`, `input`, `output_shard`, `shard` and
  // `output` must stay alive and untouched until the future completes.
  virtual Future all_reduce(at::Tensor piece, double scale) = 0;
  virtual Future reduce_scatter(at::Tensor input, at::Tensor output_shard, double scale) = 0;
  virtual Future all_gather(at::Tensor shard, at::Tensor output) = 0;
  // See [Note: transports]. Requires inputs non-empty, contiguous, of one
  // dtype and device; outputs.size() == world_size(), each outputs[q] as
  // many contiguous tensors of that dtype and device as inputs, the i-th of
  // inputs[i].numel() elements (check_all_gather_many); the outputs must not
  // overlap each other or the inputs. The default concatenates the inputs
  // (a new buffer), all-gathers into another, and copies each rank's part
  // out (ops::unflatten_into, which bumps the outputs' version counters) on
  // the thread that completes the all-gather, before the future completes.
  virtual Future all_gather_many(std::vector<at::Tensor> inputs, std::vector<std::vector<at::Tensor>> outputs);

  // A transport that hands the whole bucket to user code (a comm hook) gets
  // the bucket with the piece (the piece is then the whole bucket): the
  // reducer does not chunk, leaves the averaging to the user code, and keeps
  // no gradient resident in a bucket that code may hold on to. Others ignore
  // `bucket`. The future's work may write its result into another tensor:
  // result_of(future) returns it (default: the piece itself).
  virtual bool owns_buckets() const { return false; }
  virtual Future all_reduce_bucket(at::Tensor piece, double scale, c10d::GradBucket& /*bucket*/) {
    return all_reduce(std::move(piece), scale);
  }
  virtual at::Tensor result_of(const Future& /*future*/, const at::Tensor& piece) { return piece; }

  // A new contiguous tensor of `numel` elements (uninitialized) for the
  // caller to all-reduce pieces of again and again (a gradient bucket). A
  // transport that can reduce a buffer where it lies returns one it can
  // reach from the other ranks (the shared-memory transport: [Note: buckets
  // in shared memory] in shm_transport.h); the default is at::empty. Any
  // tensor still works as a piece: this only makes the collectives cheaper.
  virtual at::Tensor empty_buffer(int64_t numel, const at::TensorOptions& options) {
    return at::empty({numel}, options);
  }

  // Whether all_reduce applies `scale` itself as it moves the data (the
  // shared-memory transport folds it into its copies). When false, the caller
  // should fold the scale into its own copy in and pass 1 (a process group
  // then sums exactly what it got); passing another scale still works, at
  // the cost of one more pass over the piece.
  virtual bool applies_scale() const { return false; }

  // Whether this transport decides the order of the collectives launched
  // through it from their priority (see [Note: transfer priority]): the
  // simulated link ([Note: the link's queue]) and the "ordered" wrapper
  // ([Note: ordering a real link]) do; gloo, NCCL, mpi4py and shared memory
  // carry them in launch order.
  virtual bool orders_by_priority() const { return false; }

  // Whether completion times are stamped (default on). Off, the transport
  // reads no clock: the reducer turns it off when records are off.
  // Set from the caller's thread, read on the transport's (relaxed: a flag).
  virtual void set_stamp_completion(bool on) { stamp_completion_.store(on, std::memory_order_relaxed); }
  bool stamp_completion() const { return stamp_completion_.load(std::memory_order_relaxed); }

  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  // What carries the data, for records and errors: "gloo", "shm", "comm_hook",
  // "counting(gloo)".
  virtual std::string name() const = 0;
  // Counters a wrapper keeps (calls, bytes); empty for the others.
  virtual std::map<std::string, int64_t> stats() const { return {}; }

  // This rank has failed (`why`, one line): a transport whose peers wait on
  // it through memory it shares (shared memory) makes their waits fail at
  // once repeating `why`, so a peer that would otherwise see only "rank 0
  // has shut its end down" names the cause. The first abort's `why` is kept;
  // later ones only wake. Others do nothing: a process group's peers learn of
  // the failure from their own collectives. A composite transport that fails
  // aborts its legs (hierarchical_transport.cpp).
  virtual void abort(const std::string& /*why*/) {}

 protected:
  int64_t completion_time() const { return stamp_completion() ? steady_now_ns() : -1; }

 private:
  std::atomic<bool> stamp_completion_{true};
};

// The checks of all_gather_many's arguments (see Transport::all_gather_many),
// raising with `who` (e.g. "ShmTransport.all_gather_many") and the index of
// the offending tensor. Returns the inputs' total number of elements: the
// all-gather's elements per rank.
int64_t check_all_gather_many(const char* who, const std::vector<at::Tensor>& inputs,
                              const std::vector<std::vector<at::Tensor>>& outputs, int64_t world_size);

// The bytes of the all-gather output all_gather_many stands for: world_size
// times its inputs' (what a wrapper counts or delays it as).
int64_t all_gather_many_bytes(const std::vector<at::Tensor>& inputs, int64_t world_size);

// A transport in front of another: forwards everything to `inner`. A
// subclass overrides the collectives it changes (a simulated network delays
// them, a counter counts them).
class WrappingTransport : public Transport {
 public:
  explicit WrappingTransport(std::shared_ptr<Transport> inner);
  Future all_reduce(at::Tensor piece, double scale) override { return inner_->all_reduce(std::move(piece), scale); }
  Future reduce_scatter(at::Tensor input, at::Tensor output_shard, double scale) override {
    return inner_->reduce_scatter(std::move(input), std::move(output_shard), scale);
  }
  Future all_gather(at::Tensor shard, at::Tensor output) override {
    return inner_->all_gather(std::move(shard), std::move(output));
  }
  Future all_gather_many(std::vector<at::Tensor> inputs, std::vector<std::vector<at::Tensor>> outputs) override {
    return inner_->all_gather_many(std::move(inputs), std::move(outputs));
  }
  bool owns_buckets() const override { return inner_->owns_buckets(); }
  Future all_reduce_bucket(at::Tensor piece, double scale, c10d::GradBucket& bucket) override {
    return inner_->all_reduce_bucket(std::move(piece), scale, bucket);
  }
  at::Tensor result_of(const Future& future, const at::Tensor& piece) override {
    return inner_->result_of(future, piece);
  }
  at::Tensor empty_buffer(int64_t numel, const at::TensorOptions& options) override {
    return inner_->empty_buffer(numel, options);
  }
  bool applies_scale() const override { return inner_->applies_scale(); }
  bool orders_by_priority() const override { return inner_->orders_by_priority(); }
  void set_stamp_completion(bool on) override {
    Transport::set_stamp_completion(on);
    inner_->set_stamp_completion(on);
  }
  int64_t rank() const override { return inner_->rank(); }
  int64_t world_size() const override { return inner_->world_size(); }
  std::string name() const override { return inner_->name(); }
  std::map<std::string, int64_t> stats() const override { return inner_->stats(); }
  void abort(const std::string& why) override { inner_->abort(why); }
  const std::shared_ptr<Transport>& inner() const { return inner_; }

 protected:
  std::shared_ptr<Transport> inner_;
};

// Wrappers by name, so Python (pydist.transport.wrap) and benchmarks can put
// one in front of any transport. A wrapper's file registers itself:
//   static const bool registered = register_wrapper("counting", [](auto inner, const auto& options) {...});
// `options` are the wrapper's numeric settings (a simulated network's
// bandwidth and latency), by name.
using WrapperOptions = std::map<std::string, double>;
using WrapperFactory = std::function<std::shared_ptr<Transport>(std::shared_ptr<Transport>, const WrapperOptions&)>;
bool register_wrapper(const std::string& name, WrapperFactory factory);
// Raises naming the registered wrappers when `name` is not one.
std::shared_ptr<Transport> wrap(const std::string& name, std::shared_ptr<Transport> inner, const WrapperOptions& options);
std::vector<std::string> registered_wrappers();

}  // namespace transport
}  // namespace pydist
