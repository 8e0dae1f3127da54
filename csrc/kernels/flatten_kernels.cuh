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
// the number of tensors. Each block owns a fixed byte range of the flat
// buffer (as each thread does on the CPU; see flatten_cpu.cpp), finds its
// first segment by binary search and copies the pieces of the segments that
// fall in its range. Ten thousand tiny tensors and one huge one split equally
// well, and blocks never write the same byte.
//
// [Note: load width by alignment]
// A piece is copied with 16-byte loads and stores when its source and
// destination addresses agree modulo 16 (a few head bytes first, a tail
// after); else with the widest of 8, 4, 2, 1 bytes on which they agree.
// Tensors from the caching allocator are 512-byte aligned, so the width is
// set by the byte offsets in the flat buffer: all 16 bytes for float32
// tensors whose sizes are multiples of 4, 4 bytes for a float32 tensor after
// an odd-sized one.
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
