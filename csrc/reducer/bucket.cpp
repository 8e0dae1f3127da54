// Bucket layout and chunking (bucket.h), and the gradient placements
// (grad_placement.h). One translation unit for both: the placements are the
// only code that reads a bucket's slots besides the reducer.
#include "reducer/bucket.h"
#include "reducer/grad_placement.h"

#include "ops/flatten.h"

#include <torch/csrc/autograd/variable.h>

#include <algorithm>

namespace pydist {

// --- layout and chunking ------------------------------------------------------

namespace {

void allocate_buffer(Bucket& bucket, const at::TensorOptions& options) {
  int64_t numel = 0;
  for (size_t length : bucket.lengths) numel += static_cast<int64_t>(length);
  bucket.buffer = bucket.allocate(numel, options);
  TORCH_INTERNAL_ASSERT(bucket.buffer.is_contiguous() && bucket.buffer.numel() == numel);
  bucket.views.clear();
  for (size_t slot = 0; slot < bucket.num_slots(); ++slot) bucket.views.push_back(bucket.slot_of(bucket.buffer, slot));
  bucket.resident.assign(bucket.num_slots(), std::nullopt);
}

}  // namespace

Bucket make_bucket(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& indices, int64_t index,
                   int64_t chunk_bytes, BufferAllocator allocate) {
  TORCH_CHECK(!indices.empty(), "make_bucket: bucket ", index, " is empty");
  Bucket bucket;
  bucket.allocate = std::move(allocate);
  size_t offset = 0;
  for (int64_t i : indices) {
    const at::Tensor& t = tensors.at(i);
    bucket.param_indices.push_back(i);
    bucket.offsets.push_back(offset);
    bucket.lengths.push_back(static_cast<size_t>(t.numel()));
    bucket.sizes.push_back(t.sizes());
    offset += static_cast<size_t>(t.numel());
  }
  const at::Tensor& first = tensors[indices[0]];
  allocate_buffer(bucket, at::TensorOptions().dtype(first.scalar_type()).device(first.device()));
  bucket.record.index = index;
  bucket.record.num_params = static_cast<int64_t>(bucket.num_slots());
  bucket.record.bytes = static_cast<int64_t>(bucket.buffer.nbytes());
  bucket.record.param_indices = bucket.param_indices;
  bucket.record.grad_ns.assign(bucket.num_slots(), -1);
  split_into_chunks(bucket, chunk_bytes);
  return bucket;
}

void allocate_buffer(Bucket& bucket) {
  allocate_buffer(bucket, at::TensorOptions().dtype(bucket.buffer.scalar_type()).device(bucket.buffer.device()));
}

void split_into_chunks(Bucket& bucket, int64_t chunk_bytes) {
  const int64_t itemsize = bucket.buffer.element_size();
  bucket.chunks.clear();
  bucket.chunk_of_slot.assign(bucket.num_slots(), 0);
  Chunk chunk;
  for (size_t slot = 0; slot < bucket.num_slots(); ++slot) {
    bucket.chunk_of_slot[slot] = bucket.chunks.size();
    chunk.numel += static_cast<int64_t>(bucket.lengths[slot]);
    const bool last = slot + 1 == bucket.num_slots();
    if (last || (chunk_bytes > 0 && chunk.numel * itemsize >= chunk_bytes)) {
      chunk.end_slot = slot + 1;
      chunk.pending = chunk.end_slot - chunk.first_slot;
      bucket.chunks.push_back(chunk);
      chunk = Chunk{};
      chunk.first_slot = slot + 1;
      chunk.offset = static_cast<int64_t>(bucket.offsets[slot] + bucket.lengths[slot]);
    }
  }
  bucket.record.chunks.clear();
  for (const Chunk& c : bucket.chunks) bucket.record.chunks.push_back(ChunkRecord{c.offset, c.numel * itemsize, transport::Collective::kAllReduce});
}

void reset_for_iteration(Bucket& bucket) {
  bucket.next_chunk = 0;
  for (Chunk& chunk : bucket.chunks) {
    chunk.pending = chunk.end_slot - chunk.first_slot;
    chunk.future = transport::Future();
  }
  BucketRecord& record = bucket.record;
  record.first_grad_ns = record.last_grad_ns = record.launch_ns = record.complete_ns = record.done_ns = -1;
  for (ChunkRecord& chunk : record.chunks) chunk.launch_ns = chunk.complete_ns = -1;
  std::fill(record.grad_ns.begin(), record.grad_ns.end(), -1);
}

// --- gradient placements --------------------------------------------------------

const at::Tensor& GradPlacement::zeros_for(int64_t index) {
  if (zeros_.empty()) zeros_.resize(params_.size());
  if (!zeros_[index].defined()) zeros_[index] = at::zeros(params_[index].sizes(), params_[index].options());
  return zeros_[index];
}

namespace {

class CopyPlacement : public GradPlacement {
 public:
  using GradPlacement::GradPlacement;
  const char* name() const override { return "copy"; }

  void fill_chunk(Bucket& bucket, const Chunk& chunk, double scale) override {
    std::vector<at::Tensor> grads;
    grads.reserve(chunk.end_slot - chunk.first_slot);
    for (size_t slot = chunk.first_slot; slot < chunk.end_slot; ++slot) {
      const int64_t i = bucket.param_indices[slot];
      const at::Tensor& grad = params_[i].grad();
      grads.push_back(grad.defined() ? grad : zeros_for(i));
    }
    ops::flatten_into(grads, bucket.piece(chunk), scale);
  }

  void write_back(Bucket& bucket, const Chunk& chunk, const at::Tensor& result,
                  const at::Tensor& global_used) override {
    // The average was taken on the way in ([Note: averaging]). A gradient
    // that may become resident is written into its slot and moved there.
    std::vector<at::Tensor> grads;
    std::vector<size_t> moving;
    grads.reserve(chunk.end_slot - chunk.first_slot);
    bool all_slots = true;
    for (size_t slot = chunk.first_slot; slot < chunk.end_slot; ++slot) {
      const int64_t i = bucket.param_indices[slot];
      if (globally_unused(global_used, i)) {
        all_slots = false;
        continue;
      }
      at::Tensor& grad = params_[i].mutable_grad();
      if (!grad.defined()) grad = at::empty_like(params_[i]);  // used elsewhere, not here
      const bool movable = can_move_into_slot(bucket, slot, grad);
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
      if (globally_unused(global_used, bucket.param_indices[slot])) continue;
      grads[next++].copy_(bucket.slot_of(result, slot));
    }
  }

 protected:
  virtual bool can_move_into_slot(const Bucket& /*bucket*/, size_t /*slot*/, const at::Tensor& /*grad*/) const {
    return false;
  }
  virtual void move_into_slot(Bucket& /*bucket*/, size_t /*slot*/, at::Tensor& /*grad*/) {}
};

// A .grad created during this backward (zero_grad(set_to_none=True)) moves
// into its slot only from this size up: below it the copy back costs less
// than giving the tensor a new storage. See [Note: resident gradients].
constexpr size_t kMoveNewGradMinBytes = size_t{64} << 10;

class ResidentPlacement : public CopyPlacement {
 public:
  ResidentPlacement(const std::vector<at::Tensor>& params, const std::vector<std::string>& names)
      : CopyPlacement(params, names), had_grad_(params.size(), false) {}
  const char* name() const override { return "resident"; }

  void before_backward(std::vector<Bucket>& buckets) override {
    // Which parameters have a .grad outside its slot now, at the end of
    // forward: such a .grad may move in at finalize.
    for (Bucket& bucket : buckets) {
      for (size_t slot = 0; slot < bucket.num_slots(); ++slot) {
        const int64_t i = bucket.param_indices[slot];
        const at::Tensor& grad = params_[i].grad();
        had_grad_[i] = grad.defined() && !in_slot(bucket, slot, grad);
      }
    }
  }

  void fill_chunk(Bucket& bucket, const Chunk& chunk, double scale) override {
    if (chunk.first_slot == 0) make_bucket_writable(bucket);
    // Every gradient in its slot and no scale to apply (the transport takes
    // it): nothing to copy, so no segment plan either. The steady state of
    // resident gradients, per parameter per step.
    if (scale == 1.0 && all_in_slot(bucket, chunk, at::Tensor())) return;
    CopyPlacement::fill_chunk(bucket, chunk, scale);  // flatten_into skips what is in place already
  }

  void write_back(Bucket& bucket, const Chunk& chunk, const at::Tensor& result,
                  const at::Tensor& global_used) override {
    // The reduced values already lie where every gradient lives: only the
    // version counters are left of what unflatten_into would do.
    if (result.const_data_ptr() == bucket.buffer.const_data_ptr() && all_in_slot(bucket, chunk, global_used)) {
      for (size_t slot = chunk.first_slot; slot < chunk.end_slot; ++slot) {
        torch::autograd::impl::bump_version(params_[bucket.param_indices[slot]].grad());
      }
      return;
    }
    CopyPlacement::write_back(bucket, chunk, result, global_used);
  }

 protected:
  bool can_move_into_slot(const Bucket& bucket, size_t slot, const at::Tensor& grad) const override {
    // The rules of [Note: resident gradients]: kept across steps (or large),
    // a plain dense tensor that nothing else shares, not yet in its slot.
    const int64_t i = bucket.param_indices[slot];
    return (had_grad_[i] || grad.nbytes() >= kMoveNewGradMinBytes) && grad.numel() > 0 && !grad.requires_grad() &&
           params_[i].is_contiguous() && grad.is_contiguous() && !grad.is_view() && grad.storage_offset() == 0 &&
           grad.storage().use_count() == 1 && grad.storage().nbytes() == grad.nbytes() && !in_slot(bucket, slot, grad);
  }

  void move_into_slot(Bucket& bucket, size_t slot, at::Tensor& grad) override {
    // The slot holds the reduced gradient. `grad` (the same tensor object)
    // gets a storage of its own over exactly the slot's bytes; that storage
    // keeps the bucket buffer alive for as long as anything holds the grad.
    c10::Storage keep = bucket.buffer.storage();
    at::Tensor resident = at::from_blob(bucket.views[slot].data_ptr(), bucket.sizes[slot], [keep](void*) {},
                                        bucket.buffer.options());
    bucket.resident[slot] = resident.storage().getWeakStorageImpl();
    grad.set_(resident);
  }

 private:
  // Whether every gradient of the chunk is in its slot (and, given the
  // reduced used map, every parameter was used somewhere).
  bool all_in_slot(const Bucket& bucket, const Chunk& chunk, const at::Tensor& global_used) const {
    for (size_t slot = chunk.first_slot; slot < chunk.end_slot; ++slot) {
      const int64_t i = bucket.param_indices[slot];
      if (globally_unused(global_used, i) || !in_slot(bucket, slot, params_[i].grad())) return false;
    }
    return true;
  }

  static bool in_slot(const Bucket& bucket, size_t slot, const at::Tensor& grad) {
    return grad.defined() && grad.numel() > 0 && grad.const_data_ptr() == bucket.views[slot].const_data_ptr() &&
           grad.is_contiguous() && grad.scalar_type() == bucket.buffer.scalar_type();
  }

  void make_bucket_writable(Bucket& bucket) const {
    // Just before this backward's first write into the bucket (its first
    // chunk's copy in; autograd's own writes into a slot are writes to that
    // parameter's current .grad). A bucket whose memory a gradient still
    // holds that is no longer its parameter's .grad (dropped or replaced, but
    // kept by the user), or a .grad that points into another slot, gets a
    // fresh buffer, so that tensor is never written again.
    const auto begin = reinterpret_cast<uintptr_t>(bucket.buffer.const_data_ptr());
    const auto end = begin + bucket.buffer.nbytes();
    for (size_t slot = 0; slot < bucket.num_slots(); ++slot) {
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

  std::vector<bool> had_grad_;  // per parameter: .grad existed outside its slot when armed
};

class BucketViewPlacement : public GradPlacement {
 public:
  using GradPlacement::GradPlacement;
  const char* name() const override { return "bucket_view"; }

  void adopt(Bucket& bucket) override {
    // A gradient that already exists moves into the bucket; one that does
    // not stays undefined (it may belong to a globally unused parameter).
    for (size_t slot = 0; slot < bucket.num_slots(); ++slot) {
      at::Tensor& grad = params_[bucket.param_indices[slot]].mutable_grad();
      if (grad.defined() && !grad.is_alias_of(bucket.views[slot])) {
        bucket.views[slot].copy_(grad);
        grad = bucket.views[slot];
      }
    }
  }

  void fill_chunk(Bucket& bucket, const Chunk& chunk, double scale) override {
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
    if (scale != 1.0) bucket.piece(chunk).mul_(scale);
  }

  void write_back(Bucket& bucket, const Chunk& chunk, const at::Tensor& result,
                  const at::Tensor& global_used) override {
    if (!result.is_alias_of(bucket.buffer)) bucket.piece(chunk).copy_(result.narrow(0, chunk.offset, chunk.numel));
    for (size_t slot = chunk.first_slot; slot < chunk.end_slot; ++slot) {
      const int64_t i = bucket.param_indices[slot];
      if (globally_unused(global_used, i)) continue;  // its .grad stays as it was, like torch
      at::Tensor& grad = params_[i].mutable_grad();
      if (!grad.defined()) {
        grad = bucket.views[slot];
      } else {
        TORCH_CHECK(grad.is_alias_of(bucket.views[slot]), "gradient_as_bucket_view=True, but the .grad of ",
                    names_[i], " is no longer a view of its bucket (was it replaced during backward?)");
      }
    }
  }
};

}  // namespace

std::unique_ptr<GradPlacement> choose_grad_placement(const std::vector<at::Tensor>& params,
                                                     const std::vector<std::string>& names,
                                                     bool gradient_as_bucket_view, bool resident_allowed) {
  if (gradient_as_bucket_view) return std::make_unique<BucketViewPlacement>(params, names);
  if (resident_allowed) return std::make_unique<ResidentPlacement>(params, names);
  return std::make_unique<CopyPlacement>(params, names);
}

}  // namespace pydist
