// Standalone: nvcc -std=c++17 -O3 -arch=sm_90 -c csrc/kernels/flatten_kernels.cu -o flatten_kernels.o
//
// Contracts in flatten_kernels.cuh; see [Note: one launch per call] and
// [Note: load width by alignment] there. No torch header here on purpose.
#include "kernels/flatten_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>

namespace pydist::kernels {
namespace {

constexpr int kThreads = 256;
// Each block owns between these many bytes of the flat buffer: enough blocks
// to fill every SM twice over, none so small that the segment search dominates.
constexpr int64_t kMinBlockBytes = 4 << 10;
constexpr int64_t kMaxBlockBytes = 64 << 10;
// Vectors each thread keeps in flight per loop trip (memory-level parallelism).
constexpr int kUnroll = 4;

// --- element types and their opmath -------------------------------------------

template <typename T> struct Opmath { using type = T; };
template <> struct Opmath<__half> { using type = float; };
template <> struct Opmath<__nv_bfloat16> { using type = float; };

__host__ __device__ inline float to_opmath(__half x) { return __half2float(x); }
__host__ __device__ inline float to_opmath(__nv_bfloat16 x) { return __bfloat162float(x); }
__host__ __device__ inline float to_opmath(float x) { return x; }
__host__ __device__ inline double to_opmath(double x) { return x; }

template <typename T> __host__ __device__ inline T from_opmath(typename Opmath<T>::type x);
template <> __host__ __device__ inline __half from_opmath<__half>(float x) { return __float2half_rn(x); }
template <> __host__ __device__ inline __nv_bfloat16 from_opmath<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __host__ __device__ inline float from_opmath<float>(float x) { return x; }
template <> __host__ __device__ inline double from_opmath<double>(double x) { return x; }

// dst = T(opmath(src) * scale); __fmul_rn/__dmul_rn keep the compiler from
// fusing anything into the product, so it rounds exactly as torch's mul_.
__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// --- the piece copies, run by a whole block -------------------------------------

// Bytes from the start of `p` to its next `align`-aligned address.
__device__ inline int64_t head_bytes(const void* p, int64_t align, int64_t n) {
  int64_t head = (align - static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) & (align - 1))) & (align - 1);
  return head < n ? head : n;
}

// Copies n bytes with W-byte words; dst and src agree modulo sizeof(W).
template <typename W>
__device__ void copy_words(char* __restrict__ dst, const char* __restrict__ src, int64_t n) {
  const int64_t head = head_bytes(dst, sizeof(W), n);
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
  const int64_t words = (n - head) / static_cast<int64_t>(sizeof(W));
  W* __restrict__ d = reinterpret_cast<W*>(dst + head);
  const W* __restrict__ s = reinterpret_cast<const W*>(src + head);
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  for (int64_t base = threadIdx.x; base < words; base += step) {
    W v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int64_t i = base + u * static_cast<int64_t>(blockDim.x);
      if (i < words) v[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int64_t i = base + u * static_cast<int64_t>(blockDim.x);
      if (i < words) d[i] = v[u];
    }
  }
  const int64_t done = head + words * static_cast<int64_t>(sizeof(W));
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// See [Note: load width by alignment].
__device__ void copy_piece(char* dst, const char* src, int64_t n) {
  const uintptr_t skew = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if ((skew & 15) == 0) return copy_words<uint4>(dst, src, n);
  if ((skew & 7) == 0) return copy_words<uint2>(dst, src, n);
  if ((skew & 3) == 0) return copy_words<uint32_t>(dst, src, n);
  if ((skew & 1) == 0) return copy_words<uint16_t>(dst, src, n);
  copy_words<uint8_t>(dst, src, n);
}

// 16 bytes of T, loaded and stored as one vector.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// dst[i] = T(opmath(src[i]) * scale) for n elements, 16-byte vectors when
// dst and src agree modulo 16.
template <typename T>
__device__ void scale_piece(T* __restrict__ dst, const T* __restrict__ src, int64_t n,
                            typename Opmath<T>::type scale) {
  using P = Pack<T>;
  const uintptr_t skew = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  int64_t head = n;
  if ((skew & 15) == 0) head = head_bytes(dst, 16, n * sizeof(T)) / sizeof(T);
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = from_opmath<T>(mul_rn(to_opmath(src[i]), scale));
  const int64_t packs = (n - head) / P::kSize;
  P* __restrict__ d = reinterpret_cast<P*>(dst + head);
  const P* __restrict__ s = reinterpret_cast<const P*>(src + head);
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    P p = s[i];
#pragma unroll
    for (int k = 0; k < P::kSize; ++k) p.v[k] = from_opmath<T>(mul_rn(to_opmath(p.v[k]), scale));
    d[i] = p;
  }
  for (int64_t i = head + packs * P::kSize + threadIdx.x; i < n; i += blockDim.x)
    dst[i] = from_opmath<T>(mul_rn(to_opmath(src[i]), scale));
}

// --- the kernel ----------------------------------------------------------------

// Index of the first segment that ends after byte `pos` of the flat buffer
// (segment ends are non-decreasing, so this is a binary search).
__device__ int64_t first_segment_after(const Segment* segs, int64_t n, int64_t pos) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    if (segs[mid].offset + segs[mid].bytes > pos) hi = mid; else lo = mid + 1;
  }
  return lo;
}

enum class Direction { kToFlat, kFromFlat };

// Calls piece(segment, first byte in segment, first flat byte, length) for the
// part of every segment in this block's range of the flat buffer.
template <typename Piece>
__device__ void for_block_pieces(const Segment* segs, int64_t n_segs, int64_t flat_bytes,
                                 int64_t block_bytes, Piece piece) {
  __shared__ int64_t first;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * block_bytes;
  const int64_t end = begin + block_bytes < flat_bytes ? begin + block_bytes : flat_bytes;
  if (threadIdx.x == 0) first = first_segment_after(segs, n_segs, begin);
  __syncthreads();
  for (int64_t k = first; k < n_segs && segs[k].offset < end; ++k) {
    const Segment seg = segs[k];
    const int64_t lo = begin > seg.offset ? begin : seg.offset;
    const int64_t hi = end < seg.offset + seg.bytes ? end : seg.offset + seg.bytes;
    if (lo < hi) piece(seg, lo - seg.offset, lo, hi - lo);
  }
}

template <Direction kDir>
__global__ void __launch_bounds__(kThreads)
copy_kernel(const Segment* segs, int64_t n_segs, char* flat, int64_t flat_bytes, int64_t block_bytes) {
  for_block_pieces(segs, n_segs, flat_bytes, block_bytes,
                   [&](const Segment& seg, int64_t at, int64_t flat_at, int64_t n) {
                     if (kDir == Direction::kToFlat) copy_piece(flat + flat_at, seg.tensor + at, n);
                     else copy_piece(seg.tensor + at, flat + flat_at, n);
                   });
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
scale_kernel(const Segment* segs, int64_t n_segs, const char* flat, int64_t flat_bytes,
             int64_t block_bytes, typename Opmath<T>::type scale) {
  for_block_pieces(segs, n_segs, flat_bytes, block_bytes,
                   [&](const Segment& seg, int64_t at, int64_t flat_at, int64_t n) {
                     scale_piece(reinterpret_cast<T*>(seg.tensor + at),
                                 reinterpret_cast<const T*>(flat + flat_at), n / static_cast<int64_t>(sizeof(T)), scale);
                   });
}

// --- launchers -------------------------------------------------------------------

struct Grid {
  int64_t block_bytes;
  unsigned blocks;
};

// Splits flat_bytes into per-block ranges: about two blocks per SM for small
// buffers, capped ranges (many blocks) for large ones; multiples of 16 bytes.
cudaError_t plan_grid(int64_t flat_bytes, Grid* grid) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  int64_t bytes = flat_bytes / (2 * static_cast<int64_t>(sms > 0 ? sms : 1));
  bytes = bytes < kMinBlockBytes ? kMinBlockBytes : (bytes > kMaxBlockBytes ? kMaxBlockBytes : bytes);
  bytes = (bytes + 15) / 16 * 16;
  const int64_t blocks = (flat_bytes + bytes - 1) / bytes;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  *grid = {bytes, static_cast<unsigned>(blocks)};
  return cudaSuccess;
}

// Validates the arguments and stages the table on the device; on success the
// caller launches. Returns cudaErrorInvalidValue for bad sizes or pointers.
cudaError_t stage(const Segment* segments, int64_t n_segments, const void* flat, int64_t flat_bytes,
                  void* device_table, cudaStream_t stream, Grid* grid) {
  if (n_segments < 0 || flat_bytes < 0) return cudaErrorInvalidValue;
  if (n_segments > 0 && (segments == nullptr || device_table == nullptr)) return cudaErrorInvalidValue;
  if (flat_bytes > 0 && flat == nullptr) return cudaErrorInvalidValue;
  cudaError_t err = plan_grid(flat_bytes, grid);
  if (err != cudaSuccess) return err;
  return cudaMemcpyAsync(device_table, segments, segment_table_bytes(n_segments), cudaMemcpyHostToDevice, stream);
}

template <typename T>
void reference_scale(const Segment* segments, int64_t n_segments, const char* flat, double scale) {
  using opmath_t = typename Opmath<T>::type;
  const opmath_t s = static_cast<opmath_t>(scale);
  for (int64_t k = 0; k < n_segments; ++k) {
    T* dst = reinterpret_cast<T*>(segments[k].tensor);
    const T* src = reinterpret_cast<const T*>(flat + segments[k].offset);
    for (int64_t i = 0; i < segments[k].bytes / static_cast<int64_t>(sizeof(T)); ++i)
      dst[i] = from_opmath<T>(to_opmath(src[i]) * s);
  }
}

}  // namespace

size_t segment_table_bytes(int64_t n_segments) {
  return n_segments > 0 ? static_cast<size_t>(n_segments) * sizeof(Segment) : 0;
}

int scaled_type_size(ScaledType type) {
  switch (type) {
    case ScaledType::kFloat32: return 4;
    case ScaledType::kFloat64: return 8;
    case ScaledType::kFloat16: return 2;
    case ScaledType::kBFloat16: return 2;
  }
  return 0;
}

cudaError_t launch_flatten(const Segment* segments, int64_t n_segments, void* flat, int64_t flat_bytes,
                           void* device_table, cudaStream_t stream) {
  if (n_segments == 0 || flat_bytes == 0) return cudaSuccess;
  Grid grid;
  cudaError_t err = stage(segments, n_segments, flat, flat_bytes, device_table, stream, &grid);
  if (err != cudaSuccess) return err;
  copy_kernel<Direction::kToFlat><<<grid.blocks, kThreads, 0, stream>>>(
      static_cast<const Segment*>(device_table), n_segments, static_cast<char*>(flat), flat_bytes, grid.block_bytes);
  return cudaGetLastError();
}

cudaError_t launch_unflatten(const Segment* segments, int64_t n_segments, const void* flat, int64_t flat_bytes,
                             void* device_table, cudaStream_t stream) {
  if (n_segments == 0 || flat_bytes == 0) return cudaSuccess;
  Grid grid;
  cudaError_t err = stage(segments, n_segments, flat, flat_bytes, device_table, stream, &grid);
  if (err != cudaSuccess) return err;
  // The kernel only reads `flat` in this direction; one kernel serves both.
  copy_kernel<Direction::kFromFlat><<<grid.blocks, kThreads, 0, stream>>>(
      static_cast<const Segment*>(device_table), n_segments, const_cast<char*>(static_cast<const char*>(flat)),
      flat_bytes, grid.block_bytes);
  return cudaGetLastError();
}

cudaError_t launch_unflatten_scaled(const Segment* segments, int64_t n_segments, const void* flat,
                                    int64_t flat_bytes, ScaledType type, double scale, void* device_table,
                                    cudaStream_t stream) {
  const int size = scaled_type_size(type);
  if (size == 0) return cudaErrorInvalidValue;
  for (int64_t k = 0; k < n_segments; ++k)
    if (segments[k].offset % size != 0 || segments[k].bytes % size != 0) return cudaErrorInvalidValue;
  if (n_segments == 0 || flat_bytes == 0) return cudaSuccess;
  Grid grid;
  cudaError_t err = stage(segments, n_segments, flat, flat_bytes, device_table, stream, &grid);
  if (err != cudaSuccess) return err;
  // Block ranges must not split an element: round them to whole 16 bytes (done
  // in plan_grid), a multiple of every element size.
  const Segment* table = static_cast<const Segment*>(device_table);
  const char* src = static_cast<const char*>(flat);
  switch (type) {
    case ScaledType::kFloat32:
      scale_kernel<float><<<grid.blocks, kThreads, 0, stream>>>(table, n_segments, src, flat_bytes, grid.block_bytes,
                                                                static_cast<float>(scale));
      break;
    case ScaledType::kFloat64:
      scale_kernel<double><<<grid.blocks, kThreads, 0, stream>>>(table, n_segments, src, flat_bytes, grid.block_bytes,
                                                                 scale);
      break;
    case ScaledType::kFloat16:
      scale_kernel<__half><<<grid.blocks, kThreads, 0, stream>>>(table, n_segments, src, flat_bytes, grid.block_bytes,
                                                                 static_cast<float>(scale));
      break;
    case ScaledType::kBFloat16:
      scale_kernel<__nv_bfloat16><<<grid.blocks, kThreads, 0, stream>>>(table, n_segments, src, flat_bytes,
                                                                        grid.block_bytes, static_cast<float>(scale));
      break;
  }
  return cudaGetLastError();
}

// --- CPU reference -----------------------------------------------------------------

void reference_flatten(const Segment* segments, int64_t n_segments, void* flat) {
  for (int64_t k = 0; k < n_segments; ++k)
    std::memcpy(static_cast<char*>(flat) + segments[k].offset, segments[k].tensor, segments[k].bytes);
}

void reference_unflatten_scaled(const Segment* segments, int64_t n_segments, const void* flat, ScaledType type,
                                double scale) {
  const char* src = static_cast<const char*>(flat);
  switch (type) {
    case ScaledType::kFloat32: return reference_scale<float>(segments, n_segments, src, scale);
    case ScaledType::kFloat64: return reference_scale<double>(segments, n_segments, src, scale);
    case ScaledType::kFloat16: return reference_scale<__half>(segments, n_segments, src, scale);
    case ScaledType::kBFloat16: return reference_scale<__nv_bfloat16>(segments, n_segments, src, scale);
  }
}

}  // namespace pydist::kernels
