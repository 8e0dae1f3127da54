// Bucket and Chunk: a group of tensors laid out in one flat buffer, and that
// buffer cut into pieces, one collective each. Nothing here knows autograd,
// hooks or transports' choice: the reducer (reducer.h) fills buckets with
// gradients and all-reduces their chunks; a flat parameter shard can use
// the same layout and chunking for its reduce-scatters and all-gathers.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "reducer/records.h"
#include "transport/transport.h"

namespace pydist {

// A piece of a bucket reduced by one collective: consecutive slots whose
// gradients launch as soon as they, and every chunk before, are ready.
// See [Note: chunked launches] in reducer.h.
struct Chunk {
  size_t first_slot = 0;  // the slots [first_slot, end_slot) of its bucket
  size_t end_slot = 0;
  int64_t offset = 0;     // element range of the bucket buffer it covers
  int64_t numel = 0;
  size_t pending = 0;     // its slots not yet ready this iteration
  transport::Future future;  // its collective in flight, from launch until waited on
};

// One group of tensors of one dtype and device, each a slot of `buffer`:
// the unit comm hooks and records see.
struct Bucket {
  // Layout, fixed when the bucket is made (make_bucket).
  std::vector<int64_t> param_indices;   // which tensors, in buffer order
  std::vector<size_t> offsets;          // element offset of each in buffer
  std::vector<size_t> lengths;          // numel of each
  std::vector<c10::IntArrayRef> sizes;  // shape of each (the tensors own them)
  at::Tensor buffer;                    // the flat data, reduced in place
  std::vector<at::Tensor> views;        // views of buffer shaped like the tensors
  std::vector<Chunk> chunks;            // launch units, in order (split_into_chunks)
  std::vector<size_t> chunk_of_slot;    // which chunk each slot belongs to
  // Per slot, the storage a gradient was moved onto, if any (ResidentPlacement
  // in grad_placement.h); alive while anything still holds that gradient.
  // Reset whenever the buffer is allocated.
  std::vector<std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>> resident;

  // Per iteration.
  size_t next_chunk = 0;  // next chunk to launch
  BucketRecord record;    // this iteration's, one ChunkRecord per chunk (records.h)

  int64_t numel() const { return buffer.numel(); }
  size_t num_slots() const { return param_indices.size(); }
  // The piece of buffer a chunk covers.
  at::Tensor piece(const Chunk& chunk) const { return buffer.narrow(0, chunk.offset, chunk.numel); }
  // The slot's element range of `flat` (the buffer, or a tensor laid out like it), shaped like its tensor.
  at::Tensor slot_of(const at::Tensor& flat, size_t slot) const {
    return flat.narrow(0, static_cast<int64_t>(offsets[slot]), static_cast<int64_t>(lengths[slot])).view(sizes[slot]);
  }
};

// A bucket of tensors[i] for i in `indices` (non-empty; one dtype and device,
// which the caller checked), laid out in that order in a new contiguous
// buffer, cut into chunks of about `chunk_bytes` (split_into_chunks); `index`
// numbers its record. `tensors` must outlive it (sizes point into them).
Bucket make_bucket(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& indices, int64_t index,
                   int64_t chunk_bytes);

// Gives the bucket a fresh buffer (same dtype, device and layout) and views;
// forgets resident slots. Old views and slots keep the old buffer alive.
void allocate_buffer(Bucket& bucket);

// Cuts the bucket into chunks of about `chunk_bytes`, each ending at the slot
// that brings it to chunk_bytes (or at the bucket's end); chunk_bytes <= 0:
// one chunk. The cut depends only on the layout, so it is the same on every
// rank. Sets each chunk's ChunkRecord (offset, bytes; an all-reduce).
void split_into_chunks(Bucket& bucket, int64_t chunk_bytes);

// Readies the bucket's chunks and record for another iteration.
void reset_for_iteration(Bucket& bucket);

// --- a sharded unit's gradients (pydist/fsdp) ----------------------------------
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

// For each i, output[offsets[i], offsets[i] + params[i].numel()), viewed in
// params[i]'s shape, becomes its .grad, or is added to the .grad it has (grad
// mode off). One view made per parameter, no copy. Called by pydist/fsdp's
// finalize, once per reduce-scatter, with the reduced output in the
// parameters' dtype.
void hand_out_grads(const at::Tensor& output, const std::vector<at::Tensor>& params,
                    const std::vector<int64_t>& offsets);

// --- a sharded unit's unsharded buffer in a pool slot (pydist/fsdp) --------------
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

}  // namespace pydist
