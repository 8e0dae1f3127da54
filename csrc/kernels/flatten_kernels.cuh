// CUDA kernels of the flatten ops, with no torch header: raw pointers, sizes
// and a stream in, a cudaError_t out. Compiles standalone on any machine with
// a CUDA toolkit (no GPU needed):
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -c csrc/kernels/flatten_kernels.cu -o flatten_kernels.o
//
// Users: csrc/ops/flatten_cuda.cpp (the torch ops) and
// csrc/kernels/flatten_selftest.cu (the standalone self-test).
//
// [Note: one launch per call]
// A flatten is a list of segments {tensor pointer, byte offset in the flat
// buffer, byte length}. The launcher copies that table to the device with one
// cudaMemcpyAsync on the caller's stream, then launches one kernel, whatever
// the number of tensors. The flat buffer is cut into equal ranges, one per
// warp, as many as the GPU holds resident at once (none under 2 KiB): every
// warp copies the same number of bytes whatever the tensor sizes, so ten
// thousand tiny tensors and one huge one split equally well, no warp waits
// on another (no block barrier) and the grid ends in one wave. A warp finds
// its range's first segment by a 32-way search (each lane tests one probe),
// reads the following segments 32 at a time (one per lane, broadcast by
// shuffle) and copies the pieces of them that fall in its range. Ranges never
// share a byte, so no two warps write the same byte.
//
// [Note: load width by alignment]
// Every piece of 256 bytes or more is copied with 16-byte loads and 16-byte
// stores, both aligned, whatever the source's and destination's addresses
// are modulo 16: the destination is walked in aligned 16-byte vectors; when
// the source is off by r bytes, each lane loads the aligned source vector
// under its destination vector, takes the next one from its neighbour lane
// (a shuffle; the warp's last lane from the next group's first) and
// funnel-shifts the pair by r bytes. The few bytes before the first and
// after the last whole vector, and pieces under 256 bytes, take the widest
// of 16, 8, 4, 2, 1-byte words on which source and destination agree. Loads
// never leave a piece's source bytes. Without the shift, a float32 tensor
// whose flat offset is not a multiple of 16 (3 tensors in 4 when sizes are
// random) moved in 4- or 8-byte words: a quarter or half the bytes in flight
// per load, which held flatten to 0.74 of a device-to-device copy on an
// H200.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>

namespace pydist::kernels {

// One contiguous tensor's place in the flat buffer. The launchers require the
// segments in increasing `offset` order, back to back or with gaps, none
// overlapping; zero-byte segments are allowed but better left out.
struct Segment {
  char* tensor;    // the tensor's data (device memory, contiguous)
  int64_t offset;  // byte offset of its first byte in the flat buffer
  int64_t bytes;   // its length in bytes
};

// Element types the scaled copy supports. Scaling is done as torch's `mul_`
// by a Python scalar does it: in float for float16/bfloat16/float32 (the
// scale rounded to float), in double for float64, so results match bitwise.
enum class ScaledType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Bytes of device memory a launcher needs for a table of `n_segments`. The
// caller allocates it (the torch ops take it from the caching allocator) and
// keeps it until the stream has run the kernel.
size_t segment_table_bytes(int64_t n_segments);

// Copies every segment from its tensor into `flat` at its offset:
// flat[offset, offset+bytes) = tensor[0, bytes). `segments` is host memory and
// must be pageable (ordinary) memory: it is staged by cudaMemcpyAsync before
// this returns and may be freed right after, as a pageable source of
// torch's copy_ may. (Not capturable in a CUDA graph, for the same reason.)
// `device_table` holds segment_table_bytes(n_segments). One H2D copy and one
// kernel on `stream`, whatever n_segments; returns the first CUDA error.
cudaError_t launch_flatten(const Segment* segments, int64_t n_segments, void* flat,
                           int64_t flat_bytes, void* device_table, cudaStream_t stream);

// How the copy kernels split and copy the flat buffer (see [Note: one
// launch per call]). kProductionVariant, below, is what launch_flatten and
// launch_unflatten use; the others are kept for flatten_selftest's
// comparison (`--variant all`) on a GPU:
//   kBlockRanges  equal ranges per block of 8 warps (16 KiB trips), resident grid
//   kWarpChunks   16 KiB per warp, as many warps as that takes (several waves)
//   kWarpNarrow   kWarpRanges without the shifted 16-byte path: every piece
//                 in the widest word source and destination agree on, one
//                 word per lane per trip (what the shift buys)
//   kWarpRangesU8 kWarpRanges with 8 16-byte vectors in flight per lane per
//                 trip instead of 4 (4 KiB a warp trip), same register cap
//                 (__launch_bounds__ for 4 blocks of 256 threads an SM: 64
//                 registers a thread, 32 warps an SM; spills on sm_90)
//   kWarpRangesU8Lb3  the same capped for 3 blocks an SM (80 registers, 24
//                 warps an SM; spills less)
//   kWarpRangesU8Lb2  the same capped for 2 blocks an SM (128 registers, 16
//                 warps an SM; no spill, as many bytes in flight an SM as
//                 kWarpRanges)
// The grid of every warp-ranges variant is as many warps as the kernel's
// occupancy holds resident (cudaOccupancyMaxActiveBlocksPerMultiprocessor).
enum class FlattenVariant : int {
  kWarpRanges = 0,
  kBlockRanges = 1,
  kWarpChunks = 2,
  kWarpNarrow = 3,
  kWarpRangesU8 = 4,
  kWarpRangesU8Lb3 = 5,
  kWarpRangesU8Lb2 = 6,
};
constexpr int kFlattenVariants = 7;
// The plain copies' variant: 8 vectors a lane without spilling measured
// 0.86-0.88 of a device-to-device copy on an H200 where kWarpRanges measured
// 0.82-0.86 (benchmarks/RESULTS.md). The scaled copy keeps kWarpRanges' split.
constexpr FlattenVariant kProductionVariant = FlattenVariant::kWarpRangesU8Lb2;
const char* flatten_variant_name(FlattenVariant variant);

// launch_flatten with a chosen variant, of a table the caller has already put
// on the device (`device_table`, n_segments entries, as launch_flatten
// stages it): no H2D copy, the kernel alone. For flatten_selftest.
cudaError_t launch_flatten_staged(int64_t n_segments, void* flat, int64_t flat_bytes, const void* device_table,
                                  FlattenVariant variant, cudaStream_t stream);
// The same for unflatten.
cudaError_t launch_unflatten_staged(int64_t n_segments, const void* flat, int64_t flat_bytes,
                                    const void* device_table, FlattenVariant variant, cudaStream_t stream);

// The reverse: tensor[0, bytes) = flat[offset, offset+bytes), bytes as they are.
cudaError_t launch_unflatten(const Segment* segments, int64_t n_segments, const void* flat,
                             int64_t flat_bytes, void* device_table, cudaStream_t stream);

// As launch_unflatten, each element multiplied by `scale` (see ScaledType).
// Segment offsets and lengths must be multiples of the element size.
cudaError_t launch_unflatten_scaled(const Segment* segments, int64_t n_segments, const void* flat,
                                    int64_t flat_bytes, ScaledType type, double scale,
                                    void* device_table, cudaStream_t stream);

// --- CPU reference (the oracle the self-test compares against) --------------
// Same contracts, on host memory: memcpy per segment, and the scaled copy in
// the same opmath type as the kernel.
void reference_flatten(const Segment* segments, int64_t n_segments, void* flat);
void reference_unflatten_scaled(const Segment* segments, int64_t n_segments, const void* flat,
                                ScaledType type, double scale);

// The kernels' copy of one piece (n bytes, src to dst), run on the host: the
// same split into edges and 16-byte vectors, the same trips, neighbour
// exchange and shifts as a team of `warps` warps runs them, lanes emulated
// one by one. Checks the split as it goes (every byte copied once, no load
// outside the piece); returns the number of violations (0: dst now holds the
// piece). Lets a machine without a GPU test the shifted path. `unroll`: 16-byte
// vectors a lane per trip, 4 (production) or 8 (kWarpRangesU8*); any other
// value counts as a violation.
int64_t emulate_piece_copy(char* dst, const char* src, int64_t n, int warps, int unroll = 4);

// Size in bytes of one element of `type`.
int scaled_type_size(ScaledType type);

}  // namespace pydist::kernels

// Evaluates a cudaError_t expression; on failure prints it with file:line and
// the CUDA error name and returns `retval` from the enclosing function. For
// standalone C++ callers (the self-test); the torch ops use TORCH_CHECK.
#define PYDIST_CUDA_CHECK_RETURN(expr, retval)                                              \
  do {                                                                                      \
    cudaError_t pydist_err_ = (expr);                                                       \
    if (pydist_err_ != cudaSuccess) {                                                       \
      fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #expr,             \
              cudaGetErrorName(pydist_err_), cudaGetErrorString(pydist_err_));              \
      return (retval);                                                                      \
    }                                                                                       \
  } while (0)
