// The sharded wrapper's ops on a unit's tensors: contracts in unit_ops.h.
#include "fsdp/unit_ops.h"

#include "ops/scaled_copy.h"

#include <ATen/Dispatch.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <cstring>

namespace pydist {
namespace fsdp {

// --- a unit's gradients ----------------------------------------------------------

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

std::vector<at::Tensor> pieces_like(const at::Tensor& output, const std::vector<at::Tensor>& likes,
                                    const std::vector<int64_t>& offsets) {
  TORCH_CHECK(likes.size() == offsets.size(), "pieces_like: ", likes.size(), " tensors but ", offsets.size(),
              " offsets");
  TORCH_CHECK(output.dim() == 1 && output.is_contiguous(), "pieces_like: output must be 1-D and contiguous, got ",
              output.sizes());
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> pieces;
  pieces.reserve(likes.size());
  std::vector<int64_t> strides;
  for (size_t i = 0; i < likes.size(); ++i) {
    const at::Tensor& like = likes[i];
    TORCH_CHECK(like.scalar_type() == output.scalar_type() && offsets[i] >= 0 &&
                    offsets[i] + like.numel() <= output.numel(),
                "pieces_like: tensor ", i, " (", like.scalar_type(), like.sizes(), ") at offset ", offsets[i],
                " does not fit the output (", output.scalar_type(), ", ", output.numel(), " elements)");
    // One view per tensor, straight off the output: its shape, contiguous strides.
    const int64_t dims = like.dim();
    strides.assign(dims, 1);
    for (int64_t d = dims - 2; d >= 0; --d) strides[d] = strides[d + 1] * std::max<int64_t>(like.size(d + 1), 1);
    pieces.push_back(output.as_strided(like.sizes(), strides, output.storage_offset() + offsets[i]));
  }
  return pieces;
}

void hand_out_grads(const at::Tensor& output, const std::vector<at::Tensor>& params,
                    const std::vector<int64_t>& offsets) {
  std::vector<at::Tensor> pieces = pieces_like(output, params, offsets);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& grad = params[i].mutable_grad();
    if (grad.defined()) {
      grad.add_(pieces[i]);
    } else {
      grad = std::move(pieces[i]);
    }
  }
}

// --- a unit's unsharded buffer in a pool slot ----------------------------------------

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

}  // namespace fsdp
}  // namespace pydist
