// The gradient reducer: see reducer.h for the pipeline and the contract.
#include "reducer/reducer.h"

#include "ops/flatten.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

namespace pydist {

using torch::autograd::variable_list;

// A .grad created during this backward (zero_grad(set_to_none=True)) moves
// into its slot only from this size up: below it the copy back costs less
// than giving the tensor a new storage. See [Note: resident gradients].
constexpr size_t kMoveNewGradMinBytes = size_t{64} << 10;

Reducer::Reducer(std::vector<at::Tensor> params,
                 std::vector<std::string> param_names,
                 std::vector<std::vector<int64_t>> bucket_indices,
                 c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                 ReducerOptions options,
                 std::shared_ptr<transport::Transport> transport)
    : params_(std::move(params)),
      param_names_(std::move(param_names)),
      process_group_(std::move(process_group)),
      transport_(std::move(transport)),
      options_(options) {
  TORCH_CHECK(process_group_, "Reducer: process_group is None");
  TORCH_CHECK(transport_, "Reducer: transport is None");
  TORCH_CHECK(transport_->rank() == process_group_->getRank() && transport_->world_size() == process_group_->getSize(),
              "Reducer: the transport (", transport_->name(), ") is rank ", transport_->rank(), " of ",
              transport_->world_size(), ", the process group rank ", process_group_->getRank(), " of ",
              process_group_->getSize());
  transport_->set_stamp_completion(options_.record_timing);
  records_.set_keep(options_.records_kept);
  TORCH_CHECK(params_.size() == param_names_.size(), "Reducer: got ", params_.size(),
              " parameters but ", param_names_.size(), " names");
  const auto n = static_cast<int64_t>(params_.size());
  average_scale_ = 1.0 / static_cast<double>(process_group_->getSize());
  local_used_ = at::zeros({n}, at::kInt);
  global_used_ = at::zeros({n}, at::kInt);
  ready_.assign(n, false);
  had_grad_.assign(n, false);
  zeros_.resize(n);
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
  initialize_buckets(std::move(bucket_indices));
}

Reducer::~Reducer() {
  for (size_t i = 0; i < grad_accumulators_.size(); ++i) {
    grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

// --- buckets ------------------------------------------------------------

void Reducer::check_bucket_indices(const std::vector<std::vector<int64_t>>& indices) const {
  std::vector<int> seen(params_.size(), 0);
  for (size_t b = 0; b < indices.size(); ++b) {
    TORCH_CHECK(!indices[b].empty(), "Reducer: bucket ", b, " is empty");
    const at::Tensor& first = params_.at(indices[b][0]);
    for (int64_t i : indices[b]) {
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(params_.size()), "Reducer: bucket ", b,
                  " names parameter index ", i, " of ", params_.size());
      TORCH_CHECK(seen[i]++ == 0, "Reducer: parameter ", param_names_[i], " is in more than one bucket");
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
  std::lock_guard<std::mutex> lock(mutex_);
  initialize_buckets_locked(std::move(bucket_indices));
}

void Reducer::rebuild_buckets(std::vector<std::vector<int64_t>> bucket_indices) {
  std::lock_guard<std::mutex> lock(mutex_);
  initialize_buckets_locked(std::move(bucket_indices));
  has_rebuilt_ = true;
  ready_order_.clear();
}

void Reducer::initialize_buckets_locked(std::vector<std::vector<int64_t>> bucket_indices) {
  TORCH_CHECK(!require_finalize_, "Reducer: buckets cannot change during backward");
  check_bucket_indices(bucket_indices);
  buckets_.clear();
  locators_.assign(params_.size(), Locator{});
  for (size_t b = 0; b < bucket_indices.size(); ++b) {
    Bucket bucket;
    size_t offset = 0;
    for (int64_t i : bucket_indices[b]) {
      const at::Tensor& p = params_[i];
      locators_[i] = Locator{b, bucket.param_indices.size()};
      bucket.param_indices.push_back(i);
      bucket.offsets.push_back(offset);
      bucket.lengths.push_back(static_cast<size_t>(p.numel()));
      bucket.sizes.push_back(p.sizes());
      offset += static_cast<size_t>(p.numel());
    }
    allocate_buffer(bucket);
    if (options_.gradient_as_bucket_view) {
      // A gradient that already exists moves into the bucket; one that does
      // not stays undefined (it may belong to a globally unused parameter).
      for (size_t slot = 0; slot < bucket.param_indices.size(); ++slot) {
        at::Tensor& grad = params_[bucket.param_indices[slot]].mutable_grad();
        if (grad.defined() && !grad.is_alias_of(bucket.views[slot])) {
          bucket.views[slot].copy_(grad);
          grad = bucket.views[slot];
        }
      }
    }
    bucket.record.index = static_cast<int64_t>(b);
    bucket.record.num_params = static_cast<int64_t>(bucket.param_indices.size());
    bucket.record.bytes = static_cast<int64_t>(offset) * bucket.buffer.element_size();
    split_into_chunks(bucket);
    buckets_.push_back(std::move(bucket));
  }
}

void Reducer::allocate_buffer(Bucket& bucket) const {
  const at::Tensor& first = params_[bucket.param_indices.at(0)];
  int64_t numel = 0;
  for (size_t length : bucket.lengths) numel += static_cast<int64_t>(length);
  bucket.buffer = at::empty({numel}, first.options().memory_format(at::MemoryFormat::Contiguous));
  bucket.views.clear();
  for (size_t slot = 0; slot < bucket.param_indices.size(); ++slot) {
    bucket.views.push_back(bucket.buffer.narrow(0, static_cast<int64_t>(bucket.offsets[slot]),
                                                static_cast<int64_t>(bucket.lengths[slot]))
                               .view(bucket.sizes[slot]));
  }
  bucket.resident.assign(bucket.param_indices.size(), std::nullopt);
}

void Reducer::split_into_chunks(Bucket& bucket) const {
  // Whole buckets for a comm hook (it owns the bucket) or when chunking is
  // off; otherwise cut after the parameter that brings a chunk to chunk_bytes.
  // See [Note: chunked launches].
  const int64_t itemsize = bucket.buffer.element_size();
  const bool whole = transport_->owns_buckets() || options_.chunk_bytes <= 0;
  bucket.chunks.clear();
  bucket.chunk_of_slot.assign(bucket.param_indices.size(), 0);
  Chunk chunk;
  for (size_t slot = 0; slot < bucket.param_indices.size(); ++slot) {
    bucket.chunk_of_slot[slot] = bucket.chunks.size();
    chunk.numel += static_cast<int64_t>(bucket.lengths[slot]);
    const bool last = slot + 1 == bucket.param_indices.size();
    if (last || (!whole && chunk.numel * itemsize >= options_.chunk_bytes)) {
      chunk.end_slot = slot + 1;
      chunk.pending = chunk.end_slot - chunk.first_slot;
      bucket.chunks.push_back(chunk);
      chunk = Chunk{};
      chunk.first_slot = slot + 1;
      chunk.offset = static_cast<int64_t>(bucket.offsets[slot] + bucket.lengths[slot]);
    }
  }
  bucket.record.chunks.clear();
  for (const Chunk& c : bucket.chunks) {
    bucket.record.chunks.push_back(ChunkRecord{c.offset, c.numel * itemsize, transport::Collective::kAllReduce});
  }
}

bool Reducer::should_rebuild_buckets_locked() const {
  return (options_.static_graph || !options_.find_unused_parameters) && !has_rebuilt_;
}

bool Reducer::should_rebuild_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  // Not after a backward that left buckets unreduced: prepare_for_backward
  // reports that, naming the parameters.
  return should_rebuild_buckets_locked() && !ready_order_.empty() && !require_finalize_;
}

std::vector<int64_t> Reducer::ready_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ready_order_;
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
  TORCH_CHECK(!require_finalize_,
              "Expected to have finished reduction in the prior iteration before starting a new one. "
              "Your module has parameters that were not used in producing the loss, so their "
              "gradients never arrived and their buckets were never reduced. Pass "
              "find_unused_parameters=True to DistributedDataParallel, or make sure every "
              "parameter takes part in the loss. ",
              describe_unready_params());
  reset_for_backward();
  if (resident_grads()) note_grads_before_backward();
  expect_hooks_ = true;
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
  recording_ = options_.record_timing;
  if (recording_) start_ns_ = transport::steady_now_ns();
  next_bucket_ = 0;
  marked_unused_ = false;
  std::fill(ready_.begin(), ready_.end(), false);
  for (Bucket& bucket : buckets_) {
    bucket.next_chunk = 0;
    for (Chunk& chunk : bucket.chunks) {
      chunk.pending = chunk.end_slot - chunk.first_slot;
      chunk.future = transport::Future();
    }
    bucket.record.first_grad_ns = bucket.record.last_grad_ns = -1;
    bucket.record.launch_ns = bucket.record.complete_ns = bucket.record.done_ns = -1;
    for (ChunkRecord& chunk : bucket.record.chunks) chunk.launch_ns = chunk.complete_ns = -1;
  }
  if (options_.static_graph) hook_calls_left_ = hook_calls_expected_;
  if (dynamic_find_unused()) unused_params_.clear();
}

// --- resident gradients: see [Note: resident gradients] -------------------

bool Reducer::resident_grads() const {
  return !options_.gradient_as_bucket_view && !transport_->owns_buckets() && !options_.find_unused_parameters &&
         !options_.static_graph && params_.front().is_cpu();
}

bool Reducer::in_slot(const Bucket& bucket, size_t slot, const at::Tensor& grad) const {
  return grad.defined() && grad.numel() > 0 && grad.const_data_ptr() == bucket.views[slot].const_data_ptr() &&
         grad.is_contiguous() && grad.scalar_type() == bucket.buffer.scalar_type();
}

void Reducer::note_grads_before_backward() {
  // Which parameters have a .grad outside its slot now, at the end of
  // forward: such a .grad may move in at finalize.
  for (Bucket& bucket : buckets_) {
    for (size_t slot = 0; slot < bucket.param_indices.size(); ++slot) {
      const int64_t i = bucket.param_indices[slot];
      const at::Tensor& grad = params_[i].grad();
      had_grad_[i] = grad.defined() && !in_slot(bucket, slot, grad);
    }
  }
}

void Reducer::make_bucket_writable(Bucket& bucket) {
  // Just before this backward's first write into the bucket (its first
  // chunk's copy in; autograd's own writes into a slot are writes to that
  // parameter's current .grad). A bucket whose memory a gradient still
  // holds that is no longer its parameter's .grad (dropped or replaced, but
  // kept by the user), or a .grad that points into another slot, gets a
  // fresh buffer, so that tensor is never written again.
  const auto begin = reinterpret_cast<uintptr_t>(bucket.buffer.const_data_ptr());
  const auto end = begin + bucket.buffer.nbytes();
  for (size_t slot = 0; slot < bucket.param_indices.size(); ++slot) {
    const at::Tensor& grad = params_[bucket.param_indices[slot]].grad();
    if (bucket.lengths[slot] == 0 || in_slot(bucket, slot, grad)) continue;
    const auto& storage = bucket.resident[slot];
    const auto data = grad.defined() ? reinterpret_cast<uintptr_t>(grad.const_data_ptr()) : 0;
    if ((storage && !storage->expired()) || (data >= begin && data < end)) {
      allocate_buffer(bucket);
      return;
    }
  }
}

bool Reducer::can_move_into_slot(const Bucket& bucket, size_t slot, const at::Tensor& grad) const {
  // The rules of [Note: resident gradients]: kept across steps (or large),
  // a plain dense tensor that nothing else shares, not yet in its slot.
  const int64_t i = bucket.param_indices[slot];
  return (had_grad_[i] || grad.nbytes() >= kMoveNewGradMinBytes) && grad.numel() > 0 && !grad.requires_grad() &&
         params_[i].is_contiguous() && grad.is_contiguous() && !grad.is_view() && grad.storage_offset() == 0 &&
         grad.storage().use_count() == 1 && grad.storage().nbytes() == grad.nbytes() && !in_slot(bucket, slot, grad);
}

void Reducer::move_into_slot(Bucket& bucket, size_t slot, at::Tensor& grad) {
  // The slot holds the reduced gradient. `grad` (the same tensor object)
  // gets a storage of its own over exactly the slot's bytes; that storage
  // keeps the bucket buffer alive for as long as anything holds the grad.
  c10::Storage keep = bucket.buffer.storage();
  at::Tensor resident = at::from_blob(bucket.views[slot].data_ptr(), bucket.sizes[slot], [keep](void*) {},
                                      bucket.buffer.options());
  bucket.resident[slot] = resident.storage().getWeakStorageImpl();
  grad.set_(resident);
}

// --- the per-gradient pipeline ------------------------------------------

void Reducer::autograd_hook(int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Usage is recorded even under no_sync, so a parameter used only in an
  // accumulation step still counts as used when the gradients are synced.
  if (dynamic_find_unused() || static_graph_first_iteration()) {
    if (params_[index].grad().defined()) local_used_.data_ptr<int>()[index] = 1;
  }
  if (!expect_hooks_) return;  // no_sync, or a backward DDP was not armed for
  if (static_graph_first_iteration()) {
    ++hook_calls_expected_[index];  // reduced all at once by delay_all_reduce
    return;
  }
  if (!marked_unused_) {
    marked_unused_ = true;
    for (int64_t unused : unused_params_) mark_param_ready(unused);
  }
  if (options_.static_graph) {
    TORCH_CHECK(hook_calls_left_[index] > 0, "static_graph=True, but parameter ", param_names_[index],
                " received a gradient it did not receive in the first iteration: the training graph "
                "changed, which static_graph does not allow");
    if (--hook_calls_left_[index] != 0) return;  // more calls to come this iteration
  }
  if (should_rebuild_buckets_locked()) ready_order_.push_back(index);
  mark_param_ready(index);
}

void Reducer::mark_param_ready(int64_t index) {
  TORCH_CHECK(!ready_[index], "Expected to mark a variable ready only once. Parameter ", param_names_[index],
              " received its gradient twice in one backward pass, for example because it is used in "
              "several reentrant backward passes (checkpointing) or outside forward. If the graph is "
              "the same every iteration, pass static_graph=True.");
  ready_[index] = true;
  require_finalize_ = true;
  const Locator where = locators_[index];
  Bucket& bucket = buckets_[where.bucket];
  if (recording_) {
    int64_t t = now_ns();
    if (bucket.record.first_grad_ns < 0) bucket.record.first_grad_ns = t;
    bucket.record.last_grad_ns = t;
  }
  if (--bucket.chunks[bucket.chunk_of_slot[where.slot]].pending == 0) launch_ready_chunks();
  if (next_bucket_ == buckets_.size()) {
    // Every bucket is in flight: the used-map reduction goes last (the same
    // order on every rank), then finalize once autograd is done.
    if (dynamic_find_unused()) launch_local_used_allreduce();
    torch::autograd::Engine::get_default_engine().queue_callback([this] {
      std::lock_guard<std::mutex> lock(mutex_);
      finalize_backward();
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

at::Tensor& Reducer::zeros_for(int64_t index) {
  if (!zeros_[index].defined()) {
    zeros_[index] = at::zeros(params_[index].sizes(), params_[index].options());
  }
  return zeros_[index];
}

void Reducer::launch_chunk(size_t bucket_index, size_t chunk_index) {
  RECORD_FUNCTION("pydist.Reducer.launch_chunk", std::vector<c10::IValue>());
  Bucket& bucket = buckets_[bucket_index];
  Chunk& chunk = bucket.chunks[chunk_index];
  if (chunk.first_slot == 0 && resident_grads()) make_bucket_writable(bucket);
  at::Tensor piece = bucket.buffer.narrow(0, chunk.offset, chunk.numel);
  // The average is taken here, on the way into the bucket, unless the
  // transport takes it: [Note: averaging], [Note: which transport].
  const bool transport_scales = transport_->applies_scale();
  const double scale_in = transport_scales ? 1.0 : average_scale_;
  if (options_.gradient_as_bucket_view) {
    // Gradients accumulate straight into the bucket once they are its views;
    // one that is not yet (first iteration, or set to None) moves in now.
    for (size_t slot = chunk.first_slot; slot < chunk.end_slot; ++slot) {
      at::Tensor& grad = params_[bucket.param_indices[slot]].mutable_grad();
      if (!grad.defined()) {
        bucket.views[slot].zero_();
      } else if (!grad.is_alias_of(bucket.views[slot])) {
        bucket.views[slot].copy_(grad);
        grad = bucket.views[slot];
      }
    }
    if (scale_in != 1.0) piece.mul_(scale_in);
  } else {
    std::vector<at::Tensor> grads;
    grads.reserve(chunk.end_slot - chunk.first_slot);
    for (size_t slot = chunk.first_slot; slot < chunk.end_slot; ++slot) {
      const int64_t i = bucket.param_indices[slot];
      const at::Tensor& grad = params_[i].grad();
      grads.push_back(grad.defined() ? grad : zeros_for(i));
    }
    ops::flatten_into(grads, piece, scale_in);
  }

  // Stamped before the collective starts: a transport's thread may run it to
  // completion before this thread gets the core back.
  if (recording_) {
    const int64_t t = now_ns();
    bucket.record.chunks[chunk_index].launch_ns = t;
    if (bucket.record.launch_ns < 0) bucket.record.launch_ns = t;
  }
  const double scale = transport_scales ? average_scale_ : 1.0;
  if (transport_->owns_buckets()) {  // its bucket is one chunk: see split_into_chunks
    c10d::GradBucket whole = grad_bucket(bucket_index, bucket.buffer);
    chunk.future = transport_->all_reduce_bucket(piece, scale, whole);
  } else {
    chunk.future = transport_->all_reduce(piece, scale);
  }
}

c10d::GradBucket Reducer::grad_bucket(size_t bucket_index, const at::Tensor& buffer) const {
  const Bucket& bucket = buckets_[bucket_index];
  std::vector<at::Tensor> bucket_params;
  bucket_params.reserve(bucket.param_indices.size());
  for (int64_t i : bucket.param_indices) bucket_params.push_back(params_[i]);
  return c10d::GradBucket(bucket_index, buckets_.size(), buffer, bucket.offsets, bucket.lengths, bucket.sizes,
                          std::move(bucket_params), std::nullopt);
}

void Reducer::launch_local_used_allreduce() {
  global_used_.copy_(local_used_);
  std::vector<at::Tensor> tensors{global_used_};
  local_used_work_ = process_group_->allreduce(tensors);
}

// --- the end of backward -------------------------------------------------

void Reducer::delay_all_reduce() {
  std::lock_guard<std::mutex> lock(mutex_);
  // static_graph, first iteration: the hooks only counted. Now that the graph
  // is known, record which parameters it leaves out and reduce everything.
  launch_local_used_allreduce();
  unused_params_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (hook_calls_expected_[i] == 0) unused_params_.push_back(static_cast<int64_t>(i));
  }
  std::fill(ready_.begin(), ready_.end(), true);
  require_finalize_ = true;
  for (Bucket& bucket : buckets_) {
    for (Chunk& chunk : bucket.chunks) chunk.pending = 0;
  }
  launch_ready_chunks();
  finalize_backward();
}

bool Reducer::globally_unused(int64_t index) const {
  return have_global_used_ && global_used_.data_ptr<int>()[index] == 0;
}

void Reducer::finalize_backward() {
  // Runs with mutex_ held, once per reduced iteration, after autograd is done.
  RECORD_FUNCTION("pydist.Reducer.finalize_backward", std::vector<c10::IValue>());
  TORCH_INTERNAL_ASSERT(next_bucket_ == buckets_.size(), "finalize_backward before every bucket launched");
  const bool timing = recording_;
  IterationRecord record;
  if (timing) record.backward_end_ns = now_ns();
  expect_hooks_ = false;
  require_finalize_ = false;
  if (local_used_work_) {
    local_used_work_->wait();
    local_used_work_.reset();
    have_global_used_ = true;
  }
  // Chunk by chunk: results of early chunks are written back while later
  // ones are still on the wire.
  for (Bucket& bucket : buckets_) {
    for (size_t c = 0; c < bucket.chunks.size(); ++c) {
      const Chunk& chunk = bucket.chunks[c];
      const int64_t completed = chunk.future.wait();
      if (timing && completed >= 0) {
        bucket.record.chunks[c].complete_ns = completed - start_ns_;
        bucket.record.complete_ns = std::max(bucket.record.complete_ns, completed - start_ns_);
      }
      // The reduced values: the bucket's own buffer, or what a comm hook returned.
      const at::Tensor result = transport_->owns_buckets() ? transport_->result_of(chunk.future, bucket.buffer)
                                                           : bucket.buffer;
      finalize_chunk(bucket, chunk, result);
    }
    if (timing) bucket.record.done_ns = now_ns();
  }
  if (dynamic_find_unused()) local_used_.zero_();
  if (options_.static_graph && num_iterations_ > 0 && should_rebuild_buckets_locked()) {
    for (int64_t unused : unused_params_) ready_order_.push_back(unused);
  }
  if (timing) {
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

void Reducer::finalize_chunk(Bucket& bucket, const Chunk& chunk, const at::Tensor& result) {
  // `result` is the reduced bucket (the bucket's own buffer, or what a comm
  // hook returned); this writes back the slots of one chunk.
  if (options_.gradient_as_bucket_view) {
    if (!result.is_alias_of(bucket.buffer)) {
      bucket.buffer.narrow(0, chunk.offset, chunk.numel).copy_(result.narrow(0, chunk.offset, chunk.numel));
    }
    for (size_t slot = chunk.first_slot; slot < chunk.end_slot; ++slot) {
      const int64_t i = bucket.param_indices[slot];
      if (globally_unused(i)) continue;  // its .grad stays as it was, like torch
      at::Tensor& grad = params_[i].mutable_grad();
      if (!grad.defined()) {
        grad = bucket.views[slot];
      } else {
        TORCH_CHECK(grad.is_alias_of(bucket.views[slot]), "gradient_as_bucket_view=True, but the .grad of ",
                    param_names_[i], " is no longer a view of its bucket (was it replaced during backward?)");
      }
    }
    return;
  }
  // Copy back (the average was taken on the way in: [Note: averaging]). A
  // resident .grad is its slot, so there is nothing to copy; one that may
  // become resident is moved into its slot instead.
  const bool resident = resident_grads();
  std::vector<at::Tensor> grads;
  std::vector<size_t> moving;
  grads.reserve(chunk.end_slot - chunk.first_slot);
  bool all_slots = true;
  for (size_t slot = chunk.first_slot; slot < chunk.end_slot; ++slot) {
    const int64_t i = bucket.param_indices[slot];
    if (globally_unused(i)) {
      all_slots = false;
      continue;
    }
    at::Tensor& grad = params_[i].mutable_grad();
    if (!grad.defined()) grad = at::empty_like(params_[i]);  // used elsewhere, not here
    const bool movable = resident && can_move_into_slot(bucket, slot, grad);
    if (movable) moving.push_back(slot);
    grads.push_back(movable ? bucket.views[slot] : grad);
  }
  if (all_slots) {
    ops::unflatten_into(result.narrow(0, chunk.offset, chunk.numel), grads, 1.0);
    for (size_t slot : moving) move_into_slot(bucket, slot, params_[bucket.param_indices[slot]].mutable_grad());
    return;
  }
  TORCH_INTERNAL_ASSERT(moving.empty(), "resident gradients with globally unused parameters");
  size_t next = 0;
  for (size_t slot = chunk.first_slot; slot < chunk.end_slot; ++slot) {
    if (globally_unused(bucket.param_indices[slot])) continue;
    at::Tensor& grad = grads[next++];
    grad.copy_(result.narrow(0, static_cast<int64_t>(bucket.offsets[slot]), static_cast<int64_t>(bucket.lengths[slot]))
                   .view(bucket.sizes[slot]));
  }
}

// --- join: the collectives of a rank that has run out of data -------------

void Reducer::match_all_reduce_for_bwd_pass() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<transport::Future> futures;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    at::Tensor zeros = at::zeros_like(buckets_[b].buffer);
    for (const Chunk& chunk : buckets_[b].chunks) {  // the same pieces, on the same transport, as active ranks
      at::Tensor piece = zeros.narrow(0, chunk.offset, chunk.numel);
      if (transport_->owns_buckets()) {
        c10d::GradBucket whole = grad_bucket(b, zeros);
        futures.push_back(transport_->all_reduce_bucket(piece, 1.0, whole));
      } else {
        futures.push_back(transport_->all_reduce(piece, 1.0));
      }
    }
  }
  for (const auto& future : futures) future.wait();
}

void Reducer::match_unused_params_allreduce() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> tensors{local_used_.clone()};
  process_group_->allreduce(tensors)->wait();
}

// --- comm hooks and records -----------------------------------------------

void Reducer::set_comm_hook(std::shared_ptr<transport::Transport> hook_transport) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!transport_replaced_, "register_comm_hook may only be called once");
  TORCH_CHECK(num_iterations_ == 0 && !require_finalize_,
              "register_comm_hook must be called before the first backward");
  TORCH_CHECK(hook_transport, "set_comm_hook: the hook's transport is None");
  transport_ = std::move(hook_transport);
  transport_->set_stamp_completion(options_.record_timing);
  transport_replaced_ = true;
  for (Bucket& bucket : buckets_) split_into_chunks(bucket);  // a hook gets whole buckets
}

std::shared_ptr<transport::Transport> Reducer::transport() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return transport_;
}

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
  options_.record_timing = on;
  transport_->set_stamp_completion(on);
}

}  // namespace pydist
