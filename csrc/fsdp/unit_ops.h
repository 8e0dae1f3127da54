// The sharded wrapper's (pydist/fsdp) C++ ops on a unit's tensors, beside its
// output gates (output_gate.h): packing a unit's gradients into a
// reduce-scatter input, handing the reduced shard out as .grads, and pointing
// a unit's unsharded buffer into a pool slot. Bound in csrc/module.cpp; the
// DDP reducer (csrc/reducer) uses none of them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace pydist {
namespace fsdp {

// --- a unit's gradients ----------------------------------------------------------
//
// [Note: packing a unit into a rank-major reduce-scatter input]
// A sharded unit's gradients form its flat layout: grads[i] (numels[i]
// elements; undefined: zeros) end to end, then zeros up to
// world_size * shard_numel. Shard q of that layout, [q * shard_numel,
// (q + 1) * shard_numel), is what rank q receives the sum of. Several units
// reduce-scattered as one collective put their shards side by side in each
// rank's row of one rank-major input: row q = [unit a's shard q, unit b's
// shard q, ...]. pack_rank_major writes one unit's layout straight into its
// column of those rows (a gradient that straddles a shard boundary is cut
// there: at most world_size pieces), times `scale`: one pass over each
// gradient byte, where packing the unit alone and then interleaving the
// units would be two. A lone unit is the case of one column (row length
// shard_numel: the padded flat layout itself); NO_SHARD's all-reduce input
// is world_size 1. Each element is scaled by ops::scaled_copy, as
// flatten_into scales it, so the bits are those of flatten_into(scale).

// Writes the unit's flat layout times `scale` into `out` (contiguous 1-D CPU,
// world_size rows of out.numel() / world_size): flat element e lands at
// out[(e / shard_numel) * row + column + e % shard_numel]. Requires every
// defined grad to be contiguous, on the CPU, of out's dtype and numels[i]
// elements, sum(numels) <= world_size * shard_numel and the column inside a
// row. Called by pydist/fsdp's post-backward, once per unit and backward.
void pack_rank_major(const std::vector<std::optional<at::Tensor>>& grads, const std::vector<int64_t>& numels,
                     const at::Tensor& out, int64_t world_size, int64_t column, int64_t shard_numel, double scale);

// pack_rank_major of the gradients `params` hold (their .grad; none: zeros),
// each first made contiguous in out's dtype where it is not, then the
// .grads are cleared (the input holds them now). Returns, per parameter,
// whether it had a .grad. What a unit's post-backward does with its
// unsharded parameters in one call, once per unit and backward: see [Note:
// the per-gradient seam] in pydist/fsdp/_fsdp_param_group.py.
std::vector<bool> pack_param_grads(const std::vector<at::Tensor>& params, const std::vector<int64_t>& numels,
                                   const at::Tensor& out, int64_t world_size, int64_t column, int64_t shard_numel,
                                   double scale);

// For each i, output[offsets[i], offsets[i] + likes[i].numel()) viewed in
// likes[i]'s shape with contiguous strides: one view per tensor, no copy.
// Where a gradient is not the parameter's own type (FSDP2's DTensor
// gradients), pydist/fsdp hands these pieces out itself.
std::vector<at::Tensor> pieces_like(const at::Tensor& output, const std::vector<at::Tensor>& likes,
                                    const std::vector<int64_t>& offsets);

// For each i, output[offsets[i], offsets[i] + params[i].numel()), viewed in
// params[i]'s shape (pieces_like), becomes its .grad, or is added to the .grad
// it has (grad mode off). Called by pydist/fsdp's
// finalize, once per reduce-scatter, with the reduced output in the
// parameters' dtype.
void hand_out_grads(const at::Tensor& output, const std::vector<at::Tensor>& params,
                    const std::vector<int64_t>& offsets);

// --- a unit's unsharded buffer in a pool slot ----------------------------------------
//
// See [Note: the unsharded buffer's memory] in pydist/fsdp/_fsdp_param_group.py.
// The unit keeps one storage object for its unsharded buffer for good (the
// tensors autograd saved are views of it); while unsharded its memory may be
// borrowed from a pool slot, the storage pointing into the slot without
// owning it, and is given back on reshard.

// Points `buffer`'s storage at slot's bytes [offset_bytes, offset_bytes +
// buffer's bytes), without owning them: the caller keeps `slot` alive and
// unchanged until point_storage_at_nothing. Requires `buffer` contiguous at
// storage offset 0 on the CPU, its storage holding no memory (0 bytes: a
// storage is never re-pointed while it points somewhere, so a slot cannot be
// handed to a unit that still uses other memory), `slot` a contiguous CPU
// tensor the range lies inside, and offset_bytes aligned to buffer's element
// size. Called by pydist/fsdp's unshard, once per pooled unit and unshard.
void point_storage_into(const at::Tensor& buffer, const at::Tensor& slot, int64_t offset_bytes);

// point_storage_into of each buffers[i] at offsets_bytes[i]: a batch of
// units gathered into one slot, in one call.
void point_storages_into(const std::vector<at::Tensor>& buffers, const at::Tensor& slot,
                         const std::vector<int64_t>& offsets_bytes);

// Leaves `buffer`'s storage with no memory (a null pointer, 0 bytes), freeing
// what it owned (a non-owning pointer into a slot frees nothing); returns the
// address it held (0: none), which the pool checks. Called by pydist/fsdp's
// reshard.
int64_t point_storage_at_nothing(const at::Tensor& buffer);

}  // namespace fsdp
}  // namespace pydist
