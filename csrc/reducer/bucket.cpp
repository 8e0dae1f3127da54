// Bucket layout and chunking (bucket.h), and the gradient placements
// (grad_placement.h). One translation unit for both: the placements are the
// only code that reads a bucket's slots besides the reducer.
#include "reducer/bucket.h"
#include "reducer/grad_placement.h"

#include "ops/flatten.h"
#include "ops/scaled_copy.h"

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cstring>

namespace pydist {

// --- layout and chunking ------------------------------------------------------

namespace {

void allocate_buffer(Bucket& bucket, const at::TensorOptions& options) {
  int64_t numel = 0;
  for (size_t length : bucket.lengths) numel += static_cast<int64_t>(length);
  bucket.buffer = at::empty({numel}, options.memory_format(at::MemoryFormat::Contiguous));
  bucket.views.clear();
  for (size_t slot = 0; slot < bucket.num_slots(); ++slot) bucket.views.push_back(bucket.slot_of(bucket.buffer, slot));
  bucket.resident.assign(bucket.num_slots(), std::nullopt);
}

}  // namespace

Bucket make_bucket(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& indices, int64_t index,
                   int64_t chunk_bytes) {
  TORCH_CHECK(!indices.empty(), "make_bucket: bucket ", index, " is empty");
  Bucket bucket;
  size_t offset = 0;
  for (int64_t i : indices) {
    const at::Tensor& t = tensors.at(i);
    bucket.param_indices.push_back(i);
    bucket.offsets.push_back(offset);
    bucket.lengths.push_back(static_cast<size_t>(t.numel()));
    bucket.sizes.push_back(t.sizes());
    offset += static_cast<size_t>(t.numel());
  }
  allocate_buffer(bucket, tensors[indices[0]].options());
  bucket.record.index = index;
  bucket.record.num_params = static_cast<int64_t>(bucket.num_slots());
  bucket.record.bytes = static_cast<int64_t>(bucket.buffer.nbytes());
  bucket.record.param_indices = bucket.param_indices;
  bucket.record.grad_ns.assign(bucket.num_slots(), -1);
  split_into_chunks(bucket, chunk_bytes);
  return bucket;
}

void allocate_buffer(Bucket& bucket) { allocate_buffer(bucket, bucket.buffer.options()); }

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

// --- a sharded unit's gradients ------------------------------------------------

namespace {

// pack_rank_major off the CPU (a CUDA unit): the same cuts of the layout, each
// piece one ATen op on the caller's current stream. The scaled pieces are
// torch's `mul` by a Python scalar, which rounds as ops::scaled_copy does
// (opmath product, rounded back), so a CUDA pack is bitwise the CPU one.
void pack_rank_major_on_device(const std::vector<std::optional<at::Tensor>>& grads,
                               const std::vector<int64_t>& numels, const at::Tensor& out, int64_t world_size,
                               int64_t column, int64_t shard_numel, double scale) {
  at::NoGradGuard no_grad;
  const int64_t row = out.numel() / world_size;
  auto emit = [&](int64_t start, int64_t n, const at::Tensor* src) {
    int64_t taken = 0;
    while (n > 0) {
      const int64_t len = std::min(n, shard_numel - start % shard_numel);
      at::Tensor dst = out.narrow(0, (start / shard_numel) * row + column + start % shard_numel, len);
      if (src == nullptr) {
        dst.zero_();
      } else if (scale == 1.0) {
        dst.copy_(src->narrow(0, taken, len));
      } else {
        at::mul_out(dst, src->narrow(0, taken, len), at::scalar_tensor(scale, at::kDouble));
      }
      start += len;
      n -= len;
      taken += len;
    }
  };
  int64_t at_element = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const bool present = grads[i].has_value() && grads[i]->defined();
    const at::Tensor flat = present ? grads[i]->view(-1) : at::Tensor();
    emit(at_element, numels[i], present ? &flat : nullptr);
    at_element += numels[i];
  }
  emit(at_element, world_size * shard_numel - at_element, nullptr);
}

}  // namespace

void pack_rank_major(const std::vector<std::optional<at::Tensor>>& grads, const std::vector<int64_t>& numels,
                     const at::Tensor& out, int64_t world_size, int64_t column, int64_t shard_numel, double scale) {
  // Checked before the complex branch, which builds one numel per gradient.
  TORCH_CHECK(grads.size() == numels.size(), "pack_rank_major: ", grads.size(), " grads but ", numels.size(), " numels");
  if (out.is_complex()) {
    // As interleaved real and imaginary parts: every length doubles, and
    // scaling each part by a real scale is the complex product.
    std::vector<std::optional<at::Tensor>> parts;
    std::vector<int64_t> part_numels;
    for (size_t i = 0; i < grads.size(); ++i) {
      const bool present = grads[i].has_value() && grads[i]->defined();
      parts.emplace_back(present && grads[i]->is_complex() ? std::optional<at::Tensor>(at::view_as_real(*grads[i]).view(-1))
                                                           : grads[i]);
      part_numels.push_back(2 * numels[i]);
    }
    pack_rank_major(parts, part_numels, at::view_as_real(out).view(-1), world_size, 2 * column, 2 * shard_numel, scale);
    return;
  }
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), "pack_rank_major: out must be a contiguous 1-D tensor, got ",
              out.sizes(), " on ", out.device());
  TORCH_CHECK(world_size >= 1 && out.numel() % world_size == 0, "pack_rank_major: out has ", out.numel(),
              " elements, not world_size (", world_size, ") rows");
  const int64_t row = out.numel() / world_size;
  TORCH_CHECK(shard_numel >= 0 && column >= 0 && column + shard_numel <= row, "pack_rank_major: column ", column,
              " + shard_numel ", shard_numel, " does not fit a row of ", row);
  int64_t total = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    TORCH_CHECK(numels[i] >= 0, "pack_rank_major: numels[", i, "] is ", numels[i]);
    total += numels[i];
    if (!grads[i].has_value() || !grads[i]->defined()) continue;
    const at::Tensor& g = *grads[i];
    TORCH_CHECK(g.device() == out.device() && g.is_contiguous() && g.scalar_type() == out.scalar_type() &&
                    g.numel() == numels[i],
                "pack_rank_major: grads[", i, "] is ", g.scalar_type(), g.sizes(), " on ", g.device(),
                g.is_contiguous() ? "" : " (not contiguous)", "; a contiguous ", out.scalar_type(), " tensor of ",
                numels[i], " elements on ", out.device(), " expected");
  }
  TORCH_CHECK(total <= world_size * shard_numel, "pack_rank_major: ", total, " elements do not fit ", world_size,
              " shards of ", shard_numel);
  if (shard_numel == 0) return;
  if (!out.is_cpu()) {
    pack_rank_major_on_device(grads, numels, out, world_size, column, shard_numel, scale);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "pack_rank_major", [&] {
    scalar_t* base = out.data_ptr<scalar_t>();
    // Elements [start, start + n) of the layout from `src` (nullptr: zeros),
    // cut at shard boundaries.
    auto emit = [&](int64_t start, int64_t n, const scalar_t* src) {
      while (n > 0) {
        const int64_t len = std::min(n, shard_numel - start % shard_numel);
        scalar_t* dst = base + (start / shard_numel) * row + column + start % shard_numel;
        if (src == nullptr) {
          std::memset(dst, 0, static_cast<size_t>(len) * sizeof(scalar_t));
        } else if (scale == 1.0) {
          std::memcpy(dst, src, static_cast<size_t>(len) * sizeof(scalar_t));
        } else {
          ops::scaled_copy(dst, src, len, scale);
        }
        start += len;
        n -= len;
        if (src != nullptr) src += len;
      }
    };
    int64_t at_element = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      const bool present = grads[i].has_value() && grads[i]->defined();
      emit(at_element, numels[i], present ? grads[i]->const_data_ptr<scalar_t>() : nullptr);
      at_element += numels[i];
    }
    emit(at_element, world_size * shard_numel - at_element, nullptr);
  });
}

std::vector<bool> pack_param_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& numels,
                                   const at::Tensor& out, int64_t world_size, int64_t column, int64_t shard_numel,
                                   double scale) {
  std::vector<std::optional<at::Tensor>> grads;
  grads.reserve(params.size());
  std::vector<bool> had(params.size(), false);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& grad = params[i].grad();
      if (!grad.defined()) {
        grads.emplace_back(std::nullopt);
        continue;
      }
      had[i] = true;
      const bool as_is = grad.scalar_type() == out.scalar_type() && grad.is_contiguous();
      grads.emplace_back(as_is ? grad : grad.to(out.scalar_type()).contiguous());
    }
  }
  pack_rank_major(grads, numels, out, world_size, column, shard_numel, scale);
  for (const at::Tensor& param : params) param.mutable_grad() = at::Tensor();
  return had;
}

void hand_out_grads(const at::Tensor& output, const std::vector<at::Tensor>& params,
                    const std::vector<int64_t>& offsets) {
  TORCH_CHECK(params.size() == offsets.size(), "hand_out_grads: ", params.size(), " params but ", offsets.size(),
              " offsets");
  TORCH_CHECK(output.dim() == 1 && output.is_contiguous(), "hand_out_grads: output must be 1-D and contiguous, got ",
              output.sizes());
  at::NoGradGuard no_grad;
  std::vector<int64_t> strides;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& param = params[i];
    TORCH_CHECK(param.scalar_type() == output.scalar_type() && offsets[i] >= 0 &&
                    offsets[i] + param.numel() <= output.numel(),
                "hand_out_grads: params[", i, "] (", param.scalar_type(), param.sizes(), ") at offset ", offsets[i],
                " does not fit the output (", output.scalar_type(), ", ", output.numel(), " elements)");
    // One view per parameter, straight off the output: its contiguous strides.
    const int64_t dims = param.dim();
    strides.assign(dims, 1);
    for (int64_t d = dims - 2; d >= 0; --d) strides[d] = strides[d + 1] * std::max<int64_t>(param.size(d + 1), 1);
    at::Tensor piece = output.as_strided(param.sizes(), strides, output.storage_offset() + offsets[i]);
    at::Tensor& grad = param.mutable_grad();
    if (grad.defined()) {
      grad.add_(piece);
    } else {
      grad = std::move(piece);
    }
  }
}

// --- a sharded unit's unsharded buffer in a pool slot ------------------------------

void point_storage_into(const at::Tensor& buffer, const at::Tensor& slot, int64_t offset_bytes) {
  TORCH_CHECK(buffer.device() == slot.device(), "point_storage_into: buffer on ", buffer.device(), ", slot on ",
              slot.device(), "; a unit's pool is on its parameters' device");
  TORCH_CHECK(buffer.is_contiguous() && buffer.storage_offset() == 0 && slot.is_contiguous(),
              "point_storage_into: buffer and slot must be contiguous, the buffer at storage offset 0 (it is at ",
              buffer.storage_offset(), ")");
  c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
  TORCH_CHECK(storage->nbytes() == 0 && storage->data() == nullptr, "point_storage_into: the buffer's storage holds ",
              storage->nbytes(), " bytes at ", storage->data(), "; a storage is pointed into a slot only while it holds "
              "no memory (reshard first)");
  const int64_t nbytes = buffer.numel() * static_cast<int64_t>(buffer.element_size());
  const int64_t slot_bytes = slot.numel() * static_cast<int64_t>(slot.element_size());
  TORCH_CHECK(offset_bytes >= 0 && offset_bytes % static_cast<int64_t>(buffer.element_size()) == 0 &&
                  offset_bytes + nbytes <= slot_bytes,
              "point_storage_into: bytes [", offset_bytes, ", ", offset_bytes + nbytes, ") do not lie aligned in the slot's ",
              slot_bytes);
  auto* data = static_cast<char*>(slot.data_ptr()) + offset_bytes;
  storage->set_data_ptr_noswap(at::DataPtr(data, buffer.device()));  // no deleter: the slot owns the memory
  storage->set_nbytes(static_cast<size_t>(nbytes));
}

void point_storages_into(const std::vector<at::Tensor>& buffers, const at::Tensor& slot,
                         const std::vector<int64_t>& offsets_bytes) {
  TORCH_CHECK(buffers.size() == offsets_bytes.size(), "point_storages_into: ", buffers.size(), " buffers but ",
              offsets_bytes.size(), " offsets");
  for (size_t i = 0; i < buffers.size(); ++i) point_storage_into(buffers[i], slot, offsets_bytes[i]);
}

int64_t point_storage_at_nothing(const at::Tensor& buffer) {
  c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
  const auto held = reinterpret_cast<int64_t>(storage->data());
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, buffer.device()));  // frees what it owned, if it owned it
  storage->set_nbytes(0);
  return held;
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
    CopyPlacement::fill_chunk(bucket, chunk, scale);  // flatten_into skips what is in place already
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
