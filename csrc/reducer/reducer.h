// The gradient reducer behind pydist.DistributedDataParallel.
//
// One Reducer per wrapped model. It hooks every parameter's gradient
// accumulator from C++, counts ready gradients per bucket, and launches each
// bucket's asynchronous all-reduce on a torch ProcessGroup as soon as the
// bucket (and every bucket before it) is complete. The pipeline, in call
// order within one iteration:
//
//   prepare_for_backward            (Python, after forward)
//   autograd_hook -> mark_param_ready -> launch_ready_chunks -> launch_chunk
//                                   (C++, per gradient, from autograd)
//   finalize_backward               (C++, autograd engine callback at the
//                                    end of backward: waits, writes back)
//
// or, with deferred finalize (DistributedDataParallel.overlap_optimizer):
//
//   end_backward                    (the same callback: waits for nothing)
//   finish_bucket(b), any order     (Python, the update worker or a forward
//                                    pre-hook: waits for bucket b, writes back)
//   complete_iteration              (when the last bucket is finished)
//
// finalize_backward is exactly end_backward + finish_bucket for every bucket
// in launch order + complete_iteration: one path either way.
//
// No Python runs per gradient. Every collective goes through one
// transport::Transport (csrc/transport/transport.h), which keeps one Future
// per piece in flight; a user's comm hook is a transport too (it runs once
// per bucket, inside launch_chunk). The levels below the pipeline live in
// files of their own: bucket.h (Bucket, Chunk: layout and chunking),
// grad_placement.h (how .grad meets its bucket slot: copy, bucket view or
// resident, chosen once), records.h (what an iteration measured).
//
// [Note: reducer state]
// The reducer is in one of three states (ReducerState):
//   Idle      no backward armed: hooks only note which parameters were used
//             (no_sync, or a backward DDP was not armed for).
//   Armed     prepare_for_backward ran; no gradient of this backward has
//             arrived yet (a forward may arm again, e.g. one whose output got
//             no backward).
//   Reducing  the first gradient arrived (or static_graph's first iteration
//             reduces everything at once): buckets launch; finalize_backward
//             must run before the next arming, and returns to Idle.
//   Finishing autograd ended with deferred finalize on (set_defer_finalize):
//             every bucket is in flight or done; finish_bucket(b) waits for
//             one and writes its gradients back; the last one returns to
//             Idle. Arming, rebuilding and join's matching are refused here.
// The bucket layout is Initial (the construction-time assignment) until the
// wrapper rebuilds it, once, from the order gradients became ready (Rebuilt).
// Whether that rebuild happens is the wrapper's decision
// (ReducerOptions::rebuild_buckets), made where the assignment is computed
// (pydist/ddp/buckets.py); whether the graph is walked for unused parameters
// is the reducer's (dynamic_find_unused()).
//
// [Note: averaging]
// Gradients are averaged by world size as torch does it: each gradient is
// multiplied by 1/world_size on its way into the bucket (the `scale` of
// pydist::ops::flatten_into, the same arithmetic as torch's at::mul_out),
// then the bucket is all-reduced as a sum, so results match torch's bitwise
// for any world size where the sums are taken in the same order. A resident
// gradient (below) is already in its slot, so its "copy" is that multiply in
// place, while it is still in cache from autograd's accumulate; with
// gradient_as_bucket_view the chunk is scaled in place the same way. A comm
// hook gets raw gradients to divide as it sees fit (torch's contract for
// GradBucket hooks).
//
// [Note: chunked launches]
// Buckets follow torch's layout (25 MB cap, 1 MB first bucket), so comm hooks
// and checkpoints see the same buckets. But a 25 MB bucket whose gradients
// trickle in over most of backward would, all-reduced whole, start only when
// its last gradient arrives, leaving its whole transfer exposed after
// backward. So without a comm hook each bucket is all-reduced in chunks of
// about `chunk_bytes` (cut at parameter boundaries fixed when the bucket is
// made, identical on every rank): a chunk launches as soon as its gradients,
// and every chunk before it, are ready. Chunks launch in one global order on
// every rank. An element's sum is the same two-rank sum either way; with more
// ranks the ring's summation order may differ from one whole all-reduce at
// rounding level. A comm hook receives whole buckets (one chunk each).
//
// [Note: resident gradients]
// Torch's DDP copies every gradient into its bucket before the all-reduce and
// back into .grad after it: two passes over each gradient byte, every step.
// gradient_as_bucket_view=True saves both by making .grad a *view* of the
// bucket, which users can see (views: one storage shared by all grads,
// detach_() raises). pydist saves them by default without that: a .grad that
// lives on across iterations (zero_grad(set_to_none=False), accumulation) is
// moved into its bucket slot once, by Tensor::set_ on the same tensor, onto a
// storage of its own (exactly its bytes, not a view) carved out of the bucket
// buffer. From then on autograd accumulates straight into the bucket,
// flatten_into finds the gradient already in place and copies nothing, and
// the write-back is the in-place 1/world_size scale. What keeps torch's
// semantics:
//   - Only a .grad that existed at the end of forward (the user may hold
//     it), is contiguous, not empty, not part of a graph (create_graph), and
//     shares its storage with nothing (no views of it, not a view itself, no
//     Python storage object: a conservative test) is moved. The tensor object
//     stays the same, so references to it stay valid; only its data_ptr
//     changes. A .grad created during this backward (set_to_none=True) moves
//     too when it is large (kMoveNewGradMinBytes), which saves the copy back
//     though not the copy in; a small one gets the usual copy back.
//   - A bucket's memory is reused only while no old resident gradient outlives
//     its parameter's .grad: if the user dropped .grad but still holds the old
//     tensor, the bucket gets a fresh buffer just before this backward first
//     writes into it (make_bucket_writable), so the held tensor is never
//     written again (as in torch).
//   - Off where .grad of a globally unused parameter must stay untouched
//     (find_unused_parameters, static_graph), with a comm hook (it owns the
//     bucket), with gradient_as_bucket_view (views instead), and on CUDA: the
//     caching allocator ignores record_stream on a storage it did not
//     allocate, and the CUDA flatten does not skip segments already in place,
//     so there it would cost safety and gain nothing.
//
// [Note: which transport]
// A chunk is all-reduced on the reducer's transport: the process group's
// (the default), one the Python wrapper chose (shared memory where every
// rank of a CPU group shares a host), or a comm hook's adapter once one is
// registered. A transport that applies the scale
// itself as it copies (applies_scale()) gets the 1/world_size of [Note:
// averaging] with the piece, so a resident gradient is not touched at all
// before its chunk launches; otherwise the scale is folded into the copy in.
// Everything else (the unused-parameter map) stays on the process group;
// each keeps its own order, the same on every rank.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "reducer/bucket.h"
#include "reducer/grad_placement.h"
#include "reducer/records.h"
#include "transport/transport.h"

namespace pydist {

// Constructor options; each mirrors a DistributedDataParallel argument.
struct ReducerOptions {
  bool gradient_as_bucket_view = false;
  bool find_unused_parameters = false;
  bool static_graph = false;
  // Record the order gradients become ready, so the wrapper can rebuild the
  // buckets from it once (pending_rebuild_order). See [Note: reducer state].
  bool rebuild_buckets = false;
  bool record_timing = false;  // keep records (off: no clock reads); see records.h
  int64_t records_kept = kDefaultRecordsKept;  // how many iterations' records to keep
  int64_t chunk_bytes = int64_t{4} << 20;  // all-reduce pieces; 0: whole buckets. See [Note: chunked launches]
};

// See [Note: reducer state].
enum class ReducerState { kIdle, kArmed, kReducing, kFinishing };
enum class BucketLayout { kInitial, kRebuilt };
const char* state_name(ReducerState state);

// The handle torch gives for a parameter's gradient accumulator: an
// intrusive pointer in torch 2.13, a shared pointer in older releases.
using AccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

class Reducer {
 public:
  // Takes the model's parameters (those that require grad, in model order),
  // their names (for error messages), the initial bucket assignment (lists of
  // parameter indices, in launch order; every parameter exactly once; one
  // dtype and device per bucket), the group (its rank and size, and the
  // unused-parameter map) and the transport that carries the chunks: it must
  // span the same ranks and carry every parameter's dtype and device (see
  // [Note: which transport]). Registers a post-hook on each parameter's
  // gradient accumulator. Starts Idle, layout Initial.
  Reducer(std::vector<at::Tensor> params,
          std::vector<std::string> param_names,
          std::vector<std::vector<int64_t>> bucket_indices,
          c10::intrusive_ptr<c10d::ProcessGroup> process_group,
          ReducerOptions options,
          std::shared_ptr<transport::Transport> transport);

  // Removes the hooks, so a dropped wrapper leaves the parameters clean.
  ~Reducer();

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // The ready order to rebuild the buckets from, when a rebuild is due:
  // rebuild_buckets was asked for, the layout is still Initial, an iteration
  // recorded the order, and the reducer is not Reducing (a backward that
  // left buckets unreduced is reported by prepare_for_backward instead).
  // Otherwise nullopt. Called by the wrapper before each forward.
  std::optional<std::vector<int64_t>> pending_rebuild_order() const;

  // Replaces the bucket assignment (the constructor's contract) with the
  // one rank 0 derived from pending_rebuild_order(); the layout becomes
  // Rebuilt for good. Not while Reducing.
  void rebuild_buckets(std::vector<std::vector<int64_t>> bucket_indices);

  // Idle or Armed -> Armed: arms the reducer for the backward of the forward
  // that just ran. Raises if Reducing (the previous backward left buckets
  // unreduced: parameters that got no gradient without
  // find_unused_parameters), naming them. With dynamic find-unused, walks
  // the autograd graph from `outputs` to find the parameters this backward
  // will not reach; otherwise ignores them. Called from Python after
  // forward, only when gradients are to be synchronized (not under no_sync).
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);
  // Whether prepare_for_backward reads `outputs` (it walks the graph from
  // them to find unused parameters); otherwise callers may pass none.
  bool walks_outputs() const { return dynamic_find_unused(); }

  // Armed -> Reducing -> Idle, static_graph's first iteration only: reduces
  // every bucket at once at the end of backward (the graph is not known
  // yet). Queued by the wrapper as an autograd engine callback from the
  // backward of its output sink.
  void delay_all_reduce();

  // Replaces the transport, Idle and before the first backward: the comm
  // hook's adapter (transport/comm_hook_transport.h: `hook(state, bucket) ->
  // Future[Tensor]` runs once per bucket; only one comm hook per reducer)
  // or a wrapper in front of the current transport. Re-chunks the buckets
  // and chooses the gradient placement again for it.
  void set_comm_hook(std::shared_ptr<transport::Transport> hook_transport);
  // The same before the first backward; later, between iterations (Idle),
  // only a transport that hands buckets to user code exactly when the
  // current one does, keeping the placement, chunks and buffers
  // (DistributedDataParallel.overlap_optimizer puts the "ordered" wrapper
  // in front then).
  void set_transport(std::shared_ptr<transport::Transport> transport);

  // The transport the chunks go through.
  std::shared_ptr<transport::Transport> transport() const;

  // Joined rank of torch.distributed.algorithms.join: launches the same
  // collectives, in the same bucket order, as a rank still training, on
  // zero buckets, and waits for them.
  void match_all_reduce_for_bwd_pass();

  // Joined rank, after match_all_reduce_for_bwd_pass: matches the
  // all-reduce of the "parameter used" map that active ranks launch with
  // dynamic find-unused; does nothing otherwise.
  void match_unused_params_allreduce();

  // Deferred finalize (see [Note: reducer state], the file comment): when on,
  // the end of backward waits for no bucket and leaves the reducer
  // Finishing. Idle only. Called by DistributedDataParallel.overlap_optimizer.
  void set_defer_finalize(bool on);
  bool defer_finalize() const;

  // Finishing only: waits for bucket `bucket_index`'s collectives (and, the
  // first time, the unused-parameter map) and writes its gradients back to
  // .grad; the last bucket finished completes the iteration (its record,
  // Idle). Returns false, doing nothing, when the reducer is not Finishing or
  // the bucket is already finished. Thread-safe; Python calls it without the
  // GIL, from the update worker or a forward pre-hook.
  bool finish_bucket(int64_t bucket_index);

  // Finishing only: the buckets not yet finished whose collectives have all
  // completed (finish_bucket would not wait), in launch order; empty
  // otherwise. Does not wait.
  std::vector<int64_t> landed_buckets() const;

  // Finishes every bucket not yet finished, in launch order. No-op unless Finishing.
  void finish_all();

  // The state's name ("Idle", "Armed", "Reducing", "Finishing").
  std::string state() const;

  // Current bucket assignment, in launch order.
  std::vector<std::vector<int64_t>> bucket_indices() const;

  // Whether the buckets were rebuilt (layout Rebuilt).
  bool has_rebuilt_buckets() const;

  // Average over `divisor` ranks instead of the world size from now on.
  // join(divide_by_initial_world_size=False) sets it every iteration to the
  // number of ranks still training.
  void set_average_divisor(int64_t divisor);

  // Records (see records.h, [Note: record clocks]). With record_timing on,
  // each reduced iteration leaves one IterationRecord; the last
  // `records_kept` are kept. last_record(): the newest (iteration -1 when
  // there is none); iteration_records(): all kept, oldest first.
  IterationRecord last_record() const;
  std::vector<IterationRecord> iteration_records() const;
  void clear_records();
  // Turns records on or off from the next prepare_for_backward on, and keeps
  // the last `keep` (>= 1) iterations' records. Off, no clock is read.
  void set_record_timing(bool on, int64_t keep);

 private:
  // Where a parameter's gradient lives.
  struct Locator {
    size_t bucket = 0;
    size_t slot = 0;  // position within the bucket
  };

  // --- the per-gradient pipeline (see the file comment) ---
  void autograd_hook(int64_t index);
  void mark_param_ready(int64_t index);
  void launch_ready_chunks();
  void launch_chunk(size_t bucket_index, size_t chunk_index);
  // How soon the next forward needs the chunk (higher: sooner); the one
  // place stating it. See [Note: transfer priority] in transport.h.
  int64_t chunk_priority(size_t bucket_index, size_t chunk_index) const;
  void finalize_backward();
  void end_backward();
  void finish_bucket_locked(size_t bucket_index);
  void complete_iteration();

  // --- helpers ---
  void check_bucket_indices(const std::vector<std::vector<int64_t>>& indices) const;
  void initialize_buckets(std::vector<std::vector<int64_t>> bucket_indices);
  void adopt_transport(std::shared_ptr<transport::Transport> transport);
  // Raises unless `transport` is one (not None) of this reducer's group's rank and size.
  void check_transport(const std::shared_ptr<transport::Transport>& transport) const;
  // Bucket buffers from the current transport (Transport::empty_buffer).
  BufferAllocator bucket_allocator() const;
  void check_state(ReducerState expected, const char* where) const;
  void check_before_first_backward(const char* what) const;
  void reset_for_backward();
  at::Tensor used_map_for_collective() const;
  void launch_local_used_allreduce();
  transport::Future all_reduce(size_t bucket_index, const at::Tensor& buffer, const Chunk& chunk, double scale);
  std::string describe_unready_params() const;
  int64_t now_ns() const;  // ns since start_ns_; only while recording_
  bool static_graph_first_iteration() const { return options_.static_graph && num_iterations_ == 0; }
  bool dynamic_find_unused() const { return options_.find_unused_parameters && !options_.static_graph; }
  bool records_ready_order() const { return options_.rebuild_buckets && layout_ == BucketLayout::kInitial; }

  // Fixed at construction.
  std::vector<at::Tensor> params_;
  std::vector<std::string> param_names_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  ReducerOptions options_;
  double average_scale_;  // 1 / world size; see [Note: averaging]
  std::vector<AccumulatorPtr> grad_accumulators_;  // kept alive: hooks live on them
  std::vector<uintptr_t> hook_keys_;  // to remove our post-hooks in ~Reducer
  std::unordered_map<torch::autograd::Node*, int64_t> accumulator_index_;  // for the unused-parameter graph walk

  // Chosen with the transport (construction, set_transport / set_comm_hook).
  std::shared_ptr<transport::Transport> transport_;  // carries every chunk: [Note: which transport]
  std::unique_ptr<GradPlacement> placement_;         // how .grad meets its slot: grad_placement.h

  // Replaced by rebuild_buckets.
  std::vector<Bucket> buckets_;
  std::vector<Locator> locators_;
  BucketLayout layout_ = BucketLayout::kInitial;

  // Per-iteration state, reset by prepare_for_backward.
  mutable std::mutex mutex_;
  ReducerState state_ = ReducerState::kIdle;  // [Note: reducer state]
  size_t next_bucket_ = 0;             // next bucket to launch (buckets launch in order)
  std::vector<bool> ready_;            // param marked ready this iteration
  std::vector<int64_t> unused_params_; // found by the graph walk / static first iteration
  std::vector<int64_t> ready_order_;   // order gradients became ready (while records_ready_order())

  // find_unused_parameters / static_graph: which params got a gradient.
  // Accumulates across no_sync iterations; reset after each reduction.
  // The map lives on the CPU (the hooks write it); its copy is all-reduced
  // on the parameters' device, which is where the group runs collectives
  // (NCCL takes no CPU tensors), and comes back to the CPU when done.
  at::Tensor local_used_;               // int32 [num params] on CPU
  at::Tensor used_in_flight_;           // its copy being all-reduced, on the parameters' device, with:
  c10::intrusive_ptr<c10d::Work> local_used_work_;
  at::Tensor global_used_;              // the last reduced map, on CPU; undefined until there is one

  // static_graph: gradient hook calls per parameter, counted in the first
  // iteration (a parameter used twice, or checkpointed reentrantly, fires
  // more than once) and counted down every iteration after.
  std::vector<int64_t> hook_calls_expected_;
  std::vector<int64_t> hook_calls_left_;

  int64_t num_iterations_ = 0;  // reduced iterations so far

  // Deferred finalize: set_defer_finalize. While Finishing, which buckets
  // were finished (written back) and how many are left; the record being
  // filled (backward_end_ns set by end_backward).
  bool defer_finalize_ = false;
  std::vector<bool> finished_;
  size_t buckets_left_ = 0;
  IterationRecord pending_record_;

  // Records: see records.h. recording_ is options_.record_timing as it was
  // when this iteration was armed, so turning records on or off between
  // forward and backward takes effect at the next iteration.
  bool recording_ = false;
  int64_t start_ns_ = -1;  // steady-clock time this iteration was armed (recording_ only)
  RecordRing records_;
};

}  // namespace pydist
