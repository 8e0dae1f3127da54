// The gradient reducer: see reducer.h for the pipeline and the contract.
#include "reducer/reducer.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

namespace pydist {

using torch::autograd::variable_list;

const char* state_name(ReducerState state) {
  switch (state) {
    case ReducerState::kIdle: return "Idle";
    case ReducerState::kArmed: return "Armed";
    case ReducerState::kReducing: return "Reducing";
    case ReducerState::kFinishing: return "Finishing";
  }
  return "unknown";
}

Reducer::Reducer(std::vector<at::Tensor> params,
                 std::vector<std::string> param_names,
                 std::vector<std::vector<int64_t>> bucket_indices,
                 c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                 ReducerOptions options,
                 std::shared_ptr<transport::Transport> transport)
    : params_(std::move(params)),
      param_names_(std::move(param_names)),
      process_group_(std::move(process_group)),
      options_(options) {
  TORCH_CHECK(process_group_, "Reducer: process_group is None");
  TORCH_CHECK(params_.size() == param_names_.size(), "Reducer: got ", params_.size(),
              " parameters but ", param_names_.size(), " names");
  TORCH_CHECK(!params_.empty(), "Reducer: no parameters");
  records_.set_keep(options_.records_kept);
  const auto n = static_cast<int64_t>(params_.size());
  average_scale_ = 1.0 / static_cast<double>(process_group_->getSize());
  local_used_ = at::zeros({n}, at::kInt);
  ready_.assign(n, false);
  hook_calls_expected_.assign(n, 0);
  hook_calls_left_.assign(n, 0);

  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK(p.requires_grad(), "Reducer: parameter ", param_names_[i], " does not require grad");
    AccumulatorPtr accumulator = torch::autograd::impl::grad_accumulator(p);
    TORCH_CHECK(accumulator, "Reducer: parameter ", param_names_[i],
                " has no gradient accumulator (it is not a leaf tensor)");
    accumulator_index_[accumulator.get()] = i;
    hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const variable_list& outputs, const variable_list& /*inputs*/) {
          autograd_hook(i);
          return outputs;
        })));
    grad_accumulators_.push_back(std::move(accumulator));
  }
  adopt_transport(std::move(transport));
  initialize_buckets(std::move(bucket_indices));
}

Reducer::~Reducer() {
  for (size_t i = 0; i < grad_accumulators_.size(); ++i) {
    grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

void Reducer::check_state(ReducerState expected, const char* where) const {
  TORCH_CHECK(state_ == expected, "Reducer.", where, ": expected state ", state_name(expected), ", but it is ",
              state_name(state_), " (see [Note: reducer state] in csrc/reducer/reducer.h)");
}

// --- the transport and the gradient placement ---------------------------------

void Reducer::check_transport(const std::shared_ptr<transport::Transport>& transport) const {
  TORCH_CHECK(transport, "Reducer: transport is None");
  TORCH_CHECK(transport->rank() == process_group_->getRank() && transport->world_size() == process_group_->getSize(),
              "Reducer: the transport (", transport->name(), ") is rank ", transport->rank(), " of ",
              transport->world_size(), ", the process group rank ", process_group_->getRank(), " of ",
              process_group_->getSize());
}

void Reducer::adopt_transport(std::shared_ptr<transport::Transport> transport) {
  check_transport(transport);
  transport_ = std::move(transport);
  // [Note: resident gradients]: where they are allowed.
  const bool resident_allowed = !transport_->owns_buckets() && !options_.find_unused_parameters &&
                                !options_.static_graph && params_.front().is_cpu();
  placement_ = choose_grad_placement(params_, param_names_, options_.gradient_as_bucket_view, resident_allowed);
  // A transport that owns buckets (a comm hook) gets them whole.
  const int64_t chunk_bytes = transport_->owns_buckets() ? 0 : options_.chunk_bytes;
  for (Bucket& bucket : buckets_) {
    split_into_chunks(bucket, chunk_bytes);
    // Buffers made from now on (a rebuild, a fresh buffer) come from this
    // transport; the current ones stay, and still work as pieces anywhere.
    bucket.allocate = bucket_allocator();
  }
}

BufferAllocator Reducer::bucket_allocator() const {
  // The transport, not the reducer, is kept alive by the buckets' buffers;
  // the allocator is replaced whenever the transport is.
  std::weak_ptr<transport::Transport> weak = transport_;
  return [weak](int64_t numel, const at::TensorOptions& options) {
    const auto transport = weak.lock();
    return transport ? transport->empty_buffer(numel, options) : at::empty({numel}, options);
  };
}

void Reducer::set_comm_hook(std::shared_ptr<transport::Transport> hook_transport) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!transport_->owns_buckets(), "register_comm_hook may only be called once");
  check_before_first_backward("register_comm_hook");
  adopt_transport(std::move(hook_transport));
}

void Reducer::set_transport(std::shared_ptr<transport::Transport> transport) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (num_iterations_ == 0) {
    check_before_first_backward("Reducer.set_transport");
    adopt_transport(std::move(transport));
    return;
  }
  // Later, between iterations: the gradient placement and the chunks stay
  // as they are (they depend on the transport only through owns_buckets),
  // and so do the buckets' buffers, which work as pieces on any transport.
  check_transport(transport);
  TORCH_CHECK(state_ == ReducerState::kIdle, "Reducer.set_transport: call it between iterations (the reducer is ",
              state_name(state_), ")");
  TORCH_CHECK(transport->owns_buckets() == transport_->owns_buckets(), "Reducer.set_transport: ", transport->name(),
              transport->owns_buckets() ? " hands" : " does not hand", " whole buckets to user code and ",
              transport_->name(), transport_->owns_buckets() ? " does" : " does not",
              "; after the first backward the buckets' layout stays, so the new transport must match");
  transport_ = std::move(transport);  // its completion stamps follow the records at the next arming
  for (Bucket& bucket : buckets_) bucket.allocate = bucket_allocator();
}

void Reducer::check_before_first_backward(const char* what) const {
  TORCH_CHECK(num_iterations_ == 0 && state_ != ReducerState::kReducing && state_ != ReducerState::kFinishing, what,
              " must be called before the first backward (", num_iterations_, " reduced so far; the reducer is ",
              state_name(state_), ")");
}

std::shared_ptr<transport::Transport> Reducer::transport() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return transport_;
}

// --- buckets ------------------------------------------------------------

void Reducer::check_bucket_indices(const std::vector<std::vector<int64_t>>& indices) const {
  std::vector<int> seen(params_.size(), 0);
  for (size_t b = 0; b < indices.size(); ++b) {
    TORCH_CHECK(!indices[b].empty(), "Reducer: bucket ", b, " is empty");
    for (int64_t i : indices[b]) {
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(params_.size()), "Reducer: bucket ", b,
                  " names parameter index ", i, " of ", params_.size());
      TORCH_CHECK(seen[i]++ == 0, "Reducer: parameter ", param_names_[i], " is in more than one bucket");
      const at::Tensor& first = params_[indices[b][0]];
      TORCH_CHECK(params_[i].scalar_type() == first.scalar_type() && params_[i].device() == first.device(),
                  "Reducer: bucket ", b, " mixes ", first.scalar_type(), " on ", first.device(), " with ",
                  param_names_[i], " (", params_[i].scalar_type(), " on ", params_[i].device(), ")");
    }
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    TORCH_CHECK(seen[i] == 1, "Reducer: parameter ", param_names_[i], " is in no bucket");
  }
}

void Reducer::initialize_buckets(std::vector<std::vector<int64_t>> bucket_indices) {
  TORCH_CHECK(state_ != ReducerState::kReducing && state_ != ReducerState::kFinishing, "Reducer: buckets cannot change while ", state_name(state_),
              " (during backward)");
  check_bucket_indices(bucket_indices);
  buckets_.clear();
  locators_.assign(params_.size(), Locator{});
  const int64_t chunk_bytes = transport_->owns_buckets() ? 0 : options_.chunk_bytes;
  for (size_t b = 0; b < bucket_indices.size(); ++b) {
    Bucket bucket = make_bucket(params_, bucket_indices[b], static_cast<int64_t>(b), chunk_bytes, bucket_allocator());
    for (size_t slot = 0; slot < bucket.num_slots(); ++slot) locators_[bucket.param_indices[slot]] = Locator{b, slot};
    placement_->adopt(bucket);
    buckets_.push_back(std::move(bucket));
  }
}

void Reducer::rebuild_buckets(std::vector<std::vector<int64_t>> bucket_indices) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(layout_ == BucketLayout::kInitial, "Reducer.rebuild_buckets: the buckets were rebuilt already");
  initialize_buckets(std::move(bucket_indices));
  layout_ = BucketLayout::kRebuilt;
  ready_order_.clear();
}

std::optional<std::vector<int64_t>> Reducer::pending_rebuild_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!records_ready_order() || ready_order_.empty() || state_ == ReducerState::kReducing) return std::nullopt;
  TORCH_CHECK(state_ != ReducerState::kFinishing, "Reducer.pending_rebuild_order: a rebuild is due but buckets are "
              "still being finished (deferred finalize); finish them first");
  return ready_order_;
}

bool Reducer::has_rebuilt_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layout_ == BucketLayout::kRebuilt;
}

std::vector<std::vector<int64_t>> Reducer::bucket_indices() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<int64_t>> out;
  for (const Bucket& bucket : buckets_) out.push_back(bucket.param_indices);
  return out;
}

// --- arming for a backward ----------------------------------------------

std::string Reducer::describe_unready_params() const {
  std::ostringstream names;
  int64_t rank = process_group_->getRank();
  bool first = true;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) {
      names << (first ? "" : ", ") << param_names_[i];
      first = false;
    }
  }
  return c10::str("Parameters which did not receive grad for rank ", rank, ": ", names.str());
}

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(state_ != ReducerState::kFinishing, "Reducer.prepare_for_backward: ", buckets_left_,
              " bucket(s) of the previous backward are not finished yet (deferred finalize: "
              "overlap_optimizer's updates must land before the next backward is armed)");
  TORCH_CHECK(state_ != ReducerState::kReducing,
              "Expected to have finished reduction in the prior iteration before starting a new one. "
              "Your module has parameters that were not used in producing the loss, so their "
              "gradients never arrived and their buckets were never reduced. Pass "
              "find_unused_parameters=True to DistributedDataParallel, or make sure every "
              "parameter takes part in the loss. ",
              describe_unready_params());
  reset_for_backward();
  placement_->before_backward(buckets_);
  state_ = ReducerState::kArmed;
  if (!dynamic_find_unused()) return;

  // Walk the autograd graph from the outputs; accumulators not reached
  // belong to parameters this backward will not give a gradient.
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const at::Tensor& out : outputs) {
    if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* fn = stack.back();
    stack.pop_back();
    for (const auto& edge : fn->next_edges()) {
      torch::autograd::Node* next = edge.function.get();
      if (next && seen.insert(next).second) stack.push_back(next);
    }
  }
  for (const auto& [node, index] : accumulator_index_) {
    if (!seen.count(node)) unused_params_.push_back(index);
  }
  std::sort(unused_params_.begin(), unused_params_.end());
}

void Reducer::reset_for_backward() {
  // Records and the transport's completion stamps switch together, here,
  // where no collective of this reducer is in flight.
  recording_ = options_.record_timing;
  if (transport_->stamp_completion() != recording_) transport_->set_stamp_completion(recording_);
  if (recording_) start_ns_ = transport::steady_now_ns();
  next_bucket_ = 0;
  std::fill(ready_.begin(), ready_.end(), false);
  for (Bucket& bucket : buckets_) reset_for_iteration(bucket);
  if (options_.static_graph) hook_calls_left_ = hook_calls_expected_;
  if (dynamic_find_unused()) unused_params_.clear();
}

// --- the per-gradient pipeline ------------------------------------------

void Reducer::autograd_hook(int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Usage is recorded even under no_sync, so a parameter used only in an
  // accumulation step still counts as used when the gradients are synced.
  if (dynamic_find_unused() || static_graph_first_iteration()) {
    if (params_[index].grad().defined()) local_used_.data_ptr<int>()[index] = 1;
  }
  // no_sync, or a backward DDP was not armed for
  if (state_ == ReducerState::kIdle || state_ == ReducerState::kFinishing) return;
  if (static_graph_first_iteration()) {
    ++hook_calls_expected_[index];  // reduced all at once by delay_all_reduce
    return;
  }
  if (state_ == ReducerState::kArmed) {
    // This backward's first gradient: the parameters it will not reach are
    // ready now (their slots hold zeros).
    state_ = ReducerState::kReducing;
    for (int64_t unused : unused_params_) mark_param_ready(unused);
  }
  if (options_.static_graph) {
    TORCH_CHECK(hook_calls_left_[index] > 0, "static_graph=True, but parameter ", param_names_[index],
                " received a gradient it did not receive in the first iteration: the training graph "
                "changed, which static_graph does not allow");
    if (--hook_calls_left_[index] != 0) return;  // more calls to come this iteration
  }
  if (records_ready_order()) ready_order_.push_back(index);
  mark_param_ready(index);
}

void Reducer::mark_param_ready(int64_t index) {
  TORCH_INTERNAL_ASSERT(state_ == ReducerState::kReducing, "mark_param_ready while ", state_name(state_));
  TORCH_CHECK(!ready_[index], "Expected to mark a variable ready only once. Parameter ", param_names_[index],
              " received its gradient twice in one backward pass, for example because it is used in "
              "several reentrant backward passes (checkpointing) or outside forward. If the graph is "
              "the same every iteration, pass static_graph=True.");
  ready_[index] = true;
  const Locator where = locators_[index];
  Bucket& bucket = buckets_[where.bucket];
  if (recording_) {
    int64_t t = now_ns();
    if (bucket.record.first_grad_ns < 0) bucket.record.first_grad_ns = t;
    bucket.record.last_grad_ns = t;
    bucket.record.grad_ns[where.slot] = t;
  }
  if (--bucket.chunks[bucket.chunk_of_slot[where.slot]].pending == 0) launch_ready_chunks();
  if (next_bucket_ == buckets_.size()) {
    // Every bucket is in flight: the used-map reduction goes last (the same
    // order on every rank), then finalize once autograd is done.
    if (dynamic_find_unused()) launch_local_used_allreduce();
    torch::autograd::Engine::get_default_engine().queue_callback([this] {
      std::lock_guard<std::mutex> lock(mutex_);
      if (defer_finalize_) {
        end_backward();
      } else {
        finalize_backward();
      }
    });
  }
}

void Reducer::launch_ready_chunks() {
  // Chunks launch in one global order (bucket by bucket, chunk by chunk), so
  // every rank issues the same collectives in the same sequence; a chunk
  // completing early waits for those before it.
  while (next_bucket_ < buckets_.size()) {
    Bucket& bucket = buckets_[next_bucket_];
    while (bucket.next_chunk < bucket.chunks.size() && bucket.chunks[bucket.next_chunk].pending == 0) {
      launch_chunk(next_bucket_, bucket.next_chunk);
      ++bucket.next_chunk;
    }
    if (bucket.next_chunk < bucket.chunks.size()) return;
    ++next_bucket_;
  }
}

void Reducer::launch_chunk(size_t bucket_index, size_t chunk_index) {
  RECORD_FUNCTION("pydist.Reducer.launch_chunk", std::vector<c10::IValue>());
  Bucket& bucket = buckets_[bucket_index];
  Chunk& chunk = bucket.chunks[chunk_index];
  // The average is taken here, on the way into the bucket, unless the
  // transport takes it: [Note: averaging], [Note: which transport].
  const bool transport_scales = transport_->applies_scale();
  placement_->fill_chunk(bucket, chunk, transport_scales ? 1.0 : average_scale_);
  // Stamped before the collective starts: a transport's thread may run it to
  // completion before this thread gets the core back.
  if (recording_) {
    const int64_t t = now_ns();
    bucket.record.chunks[chunk_index].launch_ns = t;
    if (bucket.record.launch_ns < 0) bucket.record.launch_ns = t;
  }
  // Under deferred finalize the next forward may start while chunks are
  // still queued: tell the transport how soon it needs this one ([Note:
  // transfer priority]). Without it, nothing reads a bucket before all are
  // finished, and every chunk keeps priority 0 (launch order).
  transport::PriorityScope priority(defer_finalize_ ? chunk_priority(bucket_index, chunk_index) : 0);
  chunk.future = all_reduce(bucket_index, bucket.buffer, chunk, transport_scales ? average_scale_ : 1.0);
}

int64_t Reducer::chunk_priority(size_t bucket_index, size_t chunk_index) const {
  // The chunk's place in the launch order. Buckets are laid out (rebuilt)
  // in the order gradients become ready, which is the reverse of the order
  // the forward uses the parameters: the later a chunk launches, the sooner
  // the next forward needs it.
  int64_t ordinal = static_cast<int64_t>(chunk_index);
  for (size_t b = 0; b < bucket_index; ++b) ordinal += static_cast<int64_t>(buckets_[b].chunks.size());
  return ordinal;
}

transport::Future Reducer::all_reduce(size_t bucket_index, const at::Tensor& buffer, const Chunk& chunk,
                                      double scale) {
  // `buffer` is the bucket's, or zeros laid out like it (join).
  at::Tensor piece = buffer.narrow(0, chunk.offset, chunk.numel);
  if (!transport_->owns_buckets()) return transport_->all_reduce(piece, scale);
  // Its bucket is one chunk (see adopt_transport): the hook sees the whole bucket.
  const Bucket& bucket = buckets_[bucket_index];
  std::vector<at::Tensor> bucket_params;
  bucket_params.reserve(bucket.num_slots());
  for (int64_t i : bucket.param_indices) bucket_params.push_back(params_[i]);
  c10d::GradBucket whole(bucket_index, buckets_.size(), buffer, bucket.offsets, bucket.lengths, bucket.sizes,
                         std::move(bucket_params), std::nullopt);
  return transport_->all_reduce_bucket(piece, scale, whole);
}

at::Tensor Reducer::used_map_for_collective() const {
  return local_used_.to(params_.front().device(), /*non_blocking=*/false, /*copy=*/true);
}

void Reducer::launch_local_used_allreduce() {
  used_in_flight_ = used_map_for_collective();
  std::vector<at::Tensor> tensors{used_in_flight_};
  local_used_work_ = process_group_->allreduce(tensors);
}

// --- the end of backward -------------------------------------------------

void Reducer::delay_all_reduce() {
  std::lock_guard<std::mutex> lock(mutex_);
  check_state(ReducerState::kArmed, "delay_all_reduce");
  // static_graph, first iteration: the hooks only counted. Now that the graph
  // is known, record which parameters it leaves out and reduce everything.
  state_ = ReducerState::kReducing;
  launch_local_used_allreduce();
  unused_params_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (hook_calls_expected_[i] == 0) unused_params_.push_back(static_cast<int64_t>(i));
  }
  std::fill(ready_.begin(), ready_.end(), true);
  for (Bucket& bucket : buckets_) {
    for (Chunk& chunk : bucket.chunks) chunk.pending = 0;
  }
  launch_ready_chunks();
  finalize_backward();
}

void Reducer::finalize_backward() {
  // Runs with mutex_ held, once per reduced iteration, after autograd is done.
  RECORD_FUNCTION("pydist.Reducer.finalize_backward", std::vector<c10::IValue>());
  end_backward();
  // Bucket by bucket, chunk by chunk: results of early chunks are written
  // back while later ones are still on the wire.
  for (size_t b = 0; b < buckets_.size(); ++b) finish_bucket_locked(b);
}

void Reducer::end_backward() {
  // mutex_ held. Autograd is done and every bucket launched.
  TORCH_INTERNAL_ASSERT(state_ == ReducerState::kReducing, "end_backward while ", state_name(state_));
  TORCH_INTERNAL_ASSERT(next_bucket_ == buckets_.size(), "end_backward before every bucket launched");
  pending_record_ = IterationRecord{};
  if (recording_) pending_record_.backward_end_ns = now_ns();
  state_ = ReducerState::kFinishing;
  finished_.assign(buckets_.size(), false);
  buckets_left_ = buckets_.size();
}

void Reducer::finish_bucket_locked(size_t bucket_index) {
  // mutex_ held, Finishing, bucket not finished yet.
  const bool timing = recording_;
  if (local_used_work_) {
    // The used map goes with every bucket's write-back (unused slots keep .grad).
    local_used_work_->wait();
    local_used_work_.reset();
    global_used_ = used_in_flight_.to(at::kCPU);
    used_in_flight_.reset();
  }
  Bucket& bucket = buckets_[bucket_index];
  for (size_t c = 0; c < bucket.chunks.size(); ++c) {
    const Chunk& chunk = bucket.chunks[c];
    const int64_t completed = chunk.future.wait();
    if (timing && completed >= 0) {
      bucket.record.chunks[c].complete_ns = completed - start_ns_;
      bucket.record.complete_ns = std::max(bucket.record.complete_ns, completed - start_ns_);
    }
    // The reduced values: the bucket's own buffer, or what a comm hook returned.
    placement_->write_back(bucket, chunk, transport_->result_of(chunk.future, bucket.buffer), global_used_);
  }
  if (timing) bucket.record.done_ns = now_ns();
  finished_[bucket_index] = true;
  if (--buckets_left_ == 0) complete_iteration();
}

void Reducer::complete_iteration() {
  // mutex_ held; every bucket written back.
  state_ = ReducerState::kIdle;
  if (dynamic_find_unused()) local_used_.zero_();
  if (options_.static_graph && num_iterations_ > 0 && records_ready_order()) {
    for (int64_t unused : unused_params_) ready_order_.push_back(unused);
  }
  if (recording_) {
    IterationRecord record = std::move(pending_record_);
    record.iteration = num_iterations_;
    record.rank = process_group_->getRank();
    record.transport = transport_->name();
    record.start_ns = start_ns_;
    for (const Bucket& bucket : buckets_) record.buckets.push_back(bucket.record);
    record.finalize_end_ns = now_ns();
    records_.push(std::move(record));
  }
  ++num_iterations_;
}

void Reducer::set_defer_finalize(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_state(ReducerState::kIdle, "set_defer_finalize");
  defer_finalize_ = on;
}

bool Reducer::defer_finalize() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return defer_finalize_;
}

bool Reducer::finish_bucket(int64_t bucket_index) {
  // The wait for the wire happens without mutex_, so that the main thread's
  // calls (records, state) are not held up by a bucket still in flight; the
  // bucket layout cannot change while Finishing, and the write-back (where
  // the futures are waited again, at once) takes the lock.
  std::vector<transport::Future> in_flight;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(bucket_index >= 0 && static_cast<size_t>(bucket_index) < buckets_.size(),
                "Reducer.finish_bucket: bucket ", bucket_index, " out of range (", buckets_.size(), " buckets)");
    if (state_ != ReducerState::kFinishing || finished_[bucket_index]) return false;
    for (const Chunk& chunk : buckets_[bucket_index].chunks) in_flight.push_back(chunk.future);
  }
  for (const transport::Future& future : in_flight) future.wait();
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(bucket_index >= 0 && static_cast<size_t>(bucket_index) < buckets_.size(),
              "Reducer.finish_bucket: bucket ", bucket_index, " out of range (", buckets_.size(), " buckets)");
  if (state_ != ReducerState::kFinishing || finished_[bucket_index]) return false;
  RECORD_FUNCTION("pydist.Reducer.finish_bucket", std::vector<c10::IValue>());
  finish_bucket_locked(static_cast<size_t>(bucket_index));
  return true;
}

std::vector<int64_t> Reducer::landed_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int64_t> landed;
  if (state_ != ReducerState::kFinishing) return landed;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (finished_[b]) continue;
    const auto& chunks = buckets_[b].chunks;
    if (std::all_of(chunks.begin(), chunks.end(), [](const Chunk& c) { return c.future.completed(); })) {
      landed.push_back(static_cast<int64_t>(b));
    }
  }
  return landed;
}

void Reducer::finish_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t b = 0; b < buckets_.size() && state_ == ReducerState::kFinishing; ++b) {
    if (!finished_[b]) finish_bucket_locked(b);
  }
}

std::string Reducer::state() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_name(state_);
}

// --- join: the collectives of a rank that has run out of data -------------

void Reducer::match_all_reduce_for_bwd_pass() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(state_ != ReducerState::kReducing && state_ != ReducerState::kFinishing,
              "Reducer.match_all_reduce_for_bwd_pass: a joined rank is ",
              state_name(state_));
  std::vector<transport::Future> futures;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    at::Tensor zeros = at::zeros_like(buckets_[b].buffer);
    for (const Chunk& chunk : buckets_[b].chunks) {  // the same pieces, on the same transport, as active ranks
      futures.push_back(all_reduce(b, zeros, chunk, 1.0));
    }
  }
  for (const auto& future : futures) future.wait();
}

void Reducer::match_unused_params_allreduce() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!dynamic_find_unused()) return;  // active ranks launch no used-map reduction then
  std::vector<at::Tensor> tensors{used_map_for_collective()};
  process_group_->allreduce(tensors)->wait();
}

// --- averaging and records --------------------------------------------------

void Reducer::set_average_divisor(int64_t divisor) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(divisor > 0, "set_average_divisor: divisor must be positive, got ", divisor);
  average_scale_ = 1.0 / static_cast<double>(divisor);
}

int64_t Reducer::now_ns() const { return transport::steady_now_ns() - start_ns_; }

IterationRecord Reducer::last_record() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return records_.last();
}

std::vector<IterationRecord> Reducer::iteration_records() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return records_.all();
}

void Reducer::clear_records() {
  std::lock_guard<std::mutex> lock(mutex_);
  records_.clear();
}

void Reducer::set_record_timing(bool on, int64_t keep) {
  std::lock_guard<std::mutex> lock(mutex_);
  records_.set_keep(keep);
  options_.record_timing = on;  // from the next prepare_for_backward (reset_for_backward)
}

}  // namespace pydist
