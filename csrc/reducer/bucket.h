// Bucket and Chunk: a group of tensors laid out in one flat buffer, and that
// buffer cut into pieces, one collective each. Nothing here knows autograd,
// hooks or transports' choice: the reducer (reducer.h) fills buckets with
// gradients and all-reduces their chunks; a flat parameter shard can use
// the same layout and chunking for its reduce-scatters and all-gathers.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <functional>
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

// Where a bucket's buffer comes from: `numel` uninitialized elements of
// `options`. The reducer passes its transport's empty_buffer, so a transport
// that reduces buffers in place (shared memory) gets buckets it can reach.
using BufferAllocator = std::function<at::Tensor(int64_t numel, const at::TensorOptions& options)>;

// One group of tensors of one dtype and device, each a slot of `buffer`:
// the unit comm hooks and records see.
struct Bucket {
  // Layout, fixed when the bucket is made (make_bucket).
  std::vector<int64_t> param_indices;   // which tensors, in buffer order
  std::vector<size_t> offsets;          // element offset of each in buffer
  std::vector<size_t> lengths;          // numel of each
  std::vector<c10::IntArrayRef> sizes;  // shape of each (the tensors own them)
  at::Tensor buffer;                    // the flat data, reduced in place
  BufferAllocator allocate;             // makes `buffer` (and any fresh one)
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
// buffer from `allocate`, cut into chunks of about `chunk_bytes`
// (split_into_chunks); `index` numbers its record. `tensors` must outlive it
// (sizes point into them).
Bucket make_bucket(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& indices, int64_t index,
                   int64_t chunk_bytes, BufferAllocator allocate);

// Gives the bucket a fresh buffer (same dtype, device and layout, from its
// allocator) and views; forgets resident slots. Old views and slots keep the
// old buffer alive.
void allocate_buffer(Bucket& bucket);

// Cuts the bucket into chunks of about `chunk_bytes`, each ending at the slot
// that brings it to chunk_bytes (or at the bucket's end); chunk_bytes <= 0:
// one chunk. The cut depends only on the layout, so it is the same on every
// rank. Sets each chunk's ChunkRecord (offset, bytes; an all-reduce).
void split_into_chunks(Bucket& bucket, int64_t chunk_bytes);

// Readies the bucket's chunks and record for another iteration.
void reset_for_iteration(Bucket& bucket);

}  // namespace pydist
