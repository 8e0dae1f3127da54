// Standalone: nvcc -std=c++17 -O3 -arch=sm_90 -c csrc/kernels/flatten_kernels.cu -o flatten_kernels.o
//
// Contracts in flatten_kernels.cuh; see [Note: one launch per call] and
// [Note: load width by alignment] there. No torch header here on purpose.
#include "kernels/flatten_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <mutex>
#include <vector>

namespace pydist::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
// 16-byte vectors each thread keeps in flight per loop trip: a warp moves
// 2 KiB per trip. kUnrollDeep: the kWarpRangesU8* variants' 4 KiB trips.
constexpr int kUnroll = 4;
constexpr int kUnrollDeep = 8;
// The smallest range a warp owns (one trip of `unroll` vectors a lane), and
// kWarpChunks' fixed range.
constexpr int64_t min_warp_range_bytes(int unroll) { return 32 * static_cast<int64_t>(unroll) * 16; }
constexpr int64_t kChunkBytes = 16 << 10;
// Blocks per SM the copy kernel's registers must allow (64 registers a
// thread): 32 warps, 64 KiB in flight per SM.
constexpr int kMinBlocksPerSm = 4;
// Pieces this long or longer take the 16-byte path of [Note: load width by
// alignment]; shorter ones the narrow words (their edges would dominate).
constexpr int64_t kWidePieceBytes = 256;

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

// --- who copies a range ----------------------------------------------------------

// The warps that share one range of the flat buffer: `warps` warps (1, or a
// whole block for kBlockRanges), this thread lane `lane` of warp `warp`.
struct Team {
  int lane;
  int warp;
  int warps;
  __device__ int rank() const { return warp * 32 + lane; }
  __device__ int size() const { return warps * 32; }
};

// --- the narrow copy: the widest word source and destination agree on ------------

// Bytes from the start of `p` to its next `align`-aligned address.
__device__ inline int64_t head_bytes(const void* p, int64_t align, int64_t n) {
  int64_t head = (align - static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) & (align - 1))) & (align - 1);
  return head < n ? head : n;
}

// Copies n bytes with W-byte words; dst and src agree modulo sizeof(W). One
// word per lane per trip: this copy moves only pieces under 256 bytes and
// the edges of longer ones (and everything for kWarpNarrow), so it is kept
// small rather than fast; it shares the kernel's registers with the wide
// loops.
template <typename W>
__device__ void copy_words(char* __restrict__ dst, const char* __restrict__ src, int64_t n, const Team& t) {
  const int64_t rank = t.rank(), size = t.size();
  const int64_t head = head_bytes(dst, sizeof(W), n);
  for (int64_t i = rank; i < head; i += size) dst[i] = src[i];
  const int64_t words = (n - head) / static_cast<int64_t>(sizeof(W));
  W* __restrict__ d = reinterpret_cast<W*>(dst + head);
  const W* __restrict__ s = reinterpret_cast<const W*>(src + head);
  for (int64_t i = rank; i < words; i += size) d[i] = s[i];
  const int64_t done = head + words * static_cast<int64_t>(sizeof(W));
  for (int64_t i = done + rank; i < n; i += size) dst[i] = src[i];
}

__device__ void copy_narrow(char* dst, const char* src, int64_t n, const Team& t) {
  if (n <= 0) return;
  const uintptr_t skew = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if ((skew & 15) == 0) return copy_words<uint4>(dst, src, n, t);
  if ((skew & 7) == 0) return copy_words<uint2>(dst, src, n, t);
  if ((skew & 3) == 0) return copy_words<uint32_t>(dst, src, n, t);
  if ((skew & 1) == 0) return copy_words<uint16_t>(dst, src, n, t);
  copy_words<uint8_t>(dst, src, n, t);
}

// --- the wide copy: aligned 16-byte loads and stores at any skew ---------------------
// See [Note: load width by alignment]. The plan, the trip's steps and the
// shift are __host__ __device__ so emulate_piece_copy runs them on the CPU.

// How a piece of n bytes from src to dst splits: bytes [0, head) and
// [head + 16 * vectors, n) by the narrow copy; between them `vectors`
// destination vectors, dst + head 16-byte aligned. Destination vector j holds
// source bytes [src + head + 16 j, +16), which start `shift` bytes into the
// aligned source vector j of `aligned` = src + head - shift; with a shift it
// also needs vector j + 1, so `vectors` stops where vector `vectors` (the
// last one read) still lies inside the piece, and `head` grows by 16 where
// aligned vector 0 would begin before it.
struct PiecePlan {
  int64_t head;
  int64_t vectors;
  int shift;
};

__host__ __device__ inline PiecePlan plan_piece(uintptr_t dst, uintptr_t src, int64_t n) {
  if (n < kWidePieceBytes) return {n, 0, 0};
  int64_t head = static_cast<int64_t>((16 - (dst & 15)) & 15);
  const int shift = static_cast<int>((src + head) & 15);
  if (shift == 0) return {head, (n - head) / 16, 0};
  if (((src + head) & ~uintptr_t{15}) < src) head += 16;
  const uintptr_t aligned = (src + head) & ~uintptr_t{15};
  const int64_t by_dst = (n - head) / 16;
  const int64_t by_src = static_cast<int64_t>((src + n - aligned) / 16) - 1;
  return {head, by_dst < by_src ? by_dst : by_src, shift};
}

// The 4-byte word at byte `sh` (0, 8, 16, 24 bits) of the pair hi:lo.
__host__ __device__ inline uint32_t funnel(uint32_t lo, uint32_t hi, int sh) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, sh);
#else
  return static_cast<uint32_t>(((static_cast<uint64_t>(hi) << 32) | lo) >> sh);
#endif
}

// Bytes [4 Q + sh / 8, +16) of the 32 bytes a then b (little-endian).
template <int Q>
__host__ __device__ inline uint4 shifted(const uint4& a, const uint4& b, int sh) {
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  return make_uint4(funnel(w[Q], w[Q + 1], sh), funnel(w[Q + 1], w[Q + 2], sh), funnel(w[Q + 2], w[Q + 3], sh),
                    funnel(w[Q + 3], w[Q + 4], sh));
}

// One warp's trip over destination vectors [base, base + 32 U) (U = kUnroll in production): lane
// `lane` owns vectors base + 32 u + lane. It loads its aligned source
// vectors (those up to `vectors`, the last one read), lane 0 also vector
// base + 32 U; then for each u the lane takes vector j + 1 from the
// next lane (lane 31 from lane 0, which sends its vector of group u + 1, or
// `extra`), and stores the shifted pair. `s` points at the lane's first
// source vector (base + lane), `left` = vectors - base - lane: vector
// base + 32 u + lane is read when 32 u <= left, stored when 32 u < left.
template <int U>
struct ShiftTrip {
  uint4 v[U];
  uint4 extra;
};

// A source vector: through the read-only data path on the device (the
// source is never written during a copy).
__host__ __device__ inline uint4 load_vector(const uint4* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

template <int U>
__host__ __device__ inline void load_trip(ShiftTrip<U>& t, const uint4* s, int64_t left, int lane) {
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int u = 0; u < U; ++u) t.v[u] = 32 * u <= left ? load_vector(s + 32 * u) : make_uint4(0, 0, 0, 0);
  t.extra = lane == 0 && 32 * U <= left ? load_vector(s + 32 * U) : make_uint4(0, 0, 0, 0);
}

// What lane `lane` sends its left neighbour for group u.
template <int U>
__host__ __device__ inline uint4 trip_send(const ShiftTrip<U>& t, int u, int lane) {
  if (lane != 0) return t.v[u];
  return u + 1 < U ? t.v[u + 1 < U ? u + 1 : u] : t.extra;
}

__device__ inline uint4 shfl_vec(const uint4& v, int from) {
  return make_uint4(__shfl_sync(0xffffffffu, v.x, from), __shfl_sync(0xffffffffu, v.y, from),
                    __shfl_sync(0xffffffffu, v.z, from), __shfl_sync(0xffffffffu, v.w, from));
}

template <int U, int Q>
__device__ void copy_vectors_shifted(uint4* __restrict__ d, const uint4* __restrict__ s, int sh, int64_t vectors,
                                     const Team& t) {
  const int64_t trip = static_cast<int64_t>(t.warps) * 32 * U;
  const int from = (t.lane + 1) & 31;
  // `base` is the same on every lane: the shuffles need the whole warp.
  for (int64_t base = static_cast<int64_t>(t.warp) * 32 * U; base < vectors; base += trip) {
    const int64_t left = vectors - base - t.lane;
    ShiftTrip<U> trip_values;
    load_trip(trip_values, s + base + t.lane, left, t.lane);
    uint4* out = d + base + t.lane;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint4 next = shfl_vec(trip_send(trip_values, u, t.lane), from);
      if (32 * u < left) out[32 * u] = shifted<Q>(trip_values.v[u], next, sh);
    }
  }
}

template <int U>
__device__ void copy_vectors(uint4* __restrict__ d, const uint4* __restrict__ s, int64_t vectors, const Team& t) {
  const int64_t trip = static_cast<int64_t>(t.warps) * 32 * U;
  for (int64_t base = static_cast<int64_t>(t.warp) * 32 * U + t.lane; base < vectors; base += trip) {
    const int64_t left = vectors - base;
    const uint4* in = s + base;
    uint4* out = d + base;
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (32 * u < left) v[u] = load_vector(in + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (32 * u < left) out[32 * u] = v[u];
  }
}

// Copies one piece, run by the whole team, U 16-byte vectors a lane per
// trip. `wide` false: the narrow copy alone (kWarpNarrow).
template <int U>
__device__ void copy_piece(char* dst, const char* src, int64_t n, const Team& t, bool wide) {
  const PiecePlan p = wide ? plan_piece(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src), n)
                           : PiecePlan{n, 0, 0};
  copy_narrow(dst, src, p.head, t);
  if (p.vectors > 0) {
    uint4* d = reinterpret_cast<uint4*>(dst + p.head);
    const uint4* s = reinterpret_cast<const uint4*>(src + p.head - p.shift);
    const int sh = (p.shift & 3) * 8;
    switch (p.shift >> 2) {
      case 0:
        if (p.shift == 0) copy_vectors<U>(d, s, p.vectors, t);
        else copy_vectors_shifted<U, 0>(d, s, sh, p.vectors, t);
        break;
      case 1: copy_vectors_shifted<U, 1>(d, s, sh, p.vectors, t); break;
      case 2: copy_vectors_shifted<U, 2>(d, s, sh, p.vectors, t); break;
      default: copy_vectors_shifted<U, 3>(d, s, sh, p.vectors, t); break;
    }
  }
  const int64_t done = p.head + 16 * p.vectors;
  copy_narrow(dst + done, src + done, n - done, t);
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
                            typename Opmath<T>::type scale, const Team& t) {
  using P = Pack<T>;
  const int64_t rank = t.rank(), size = t.size();
  const uintptr_t skew = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  int64_t head = n;
  if ((skew & 15) == 0) head = head_bytes(dst, 16, n * sizeof(T)) / sizeof(T);
  for (int64_t i = rank; i < head; i += size) dst[i] = from_opmath<T>(mul_rn(to_opmath(src[i]), scale));
  const int64_t packs = (n - head) / P::kSize;
  P* __restrict__ d = reinterpret_cast<P*>(dst + head);
  const P* __restrict__ s = reinterpret_cast<const P*>(src + head);
  for (int64_t i = rank; i < packs; i += size) {
    P p = s[i];
#pragma unroll
    for (int k = 0; k < P::kSize; ++k) p.v[k] = from_opmath<T>(mul_rn(to_opmath(p.v[k]), scale));
    d[i] = p;
  }
  for (int64_t i = head + packs * P::kSize + rank; i < n; i += size)
    dst[i] = from_opmath<T>(mul_rn(to_opmath(src[i]), scale));
}

// --- the kernels ------------------------------------------------------------------

// Index of the first segment that ends after byte `pos` of the flat buffer
// (segment ends are non-decreasing), found by the whole warp: each step the
// 32 lanes test 32 evenly spaced probes and the interval shrinks 32-fold.
__device__ int64_t warp_first_segment_after(const Segment* segs, int64_t n, int64_t pos, int lane) {
  // The answer lies in [lo, hi]: segments before lo end at or before pos,
  // segment hi (if hi < n) ends after it.
  int64_t lo = 0, hi = n;
  while (hi - lo > 32) {
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t probe = lo + (lane + 1) * step - 1;
    const bool before = probe < hi && segs[probe].offset + segs[probe].bytes <= pos;
    const int below = __popc(__ballot_sync(0xffffffffu, before));  // probes 0 .. below-1 end at or before pos
    const int64_t first_after = lo + (below + 1) * step - 1;
    if (first_after < hi) hi = first_after;
    lo += below * step;
  }
  const int64_t k = lo + lane;
  const bool before = k < hi && segs[k].offset + segs[k].bytes <= pos;
  return lo + __popc(__ballot_sync(0xffffffffu, before));
}

// Calls piece(tensor, first byte in the tensor, first flat byte, length) for
// the part of every segment inside flat bytes [begin, end), run by one whole
// warp. Segments are read 32 at a time, one per lane, into the warp's slab
// of shared memory (`slab`, 32 entries), then read back one by one: kept in
// registers instead, they would crowd out the copy's loads.
template <typename Piece>
__device__ void for_range_pieces(const Segment* segs, int64_t n_segs, int64_t begin, int64_t end, int lane,
                                 Segment* slab, Piece piece) {
  for (int64_t k = warp_first_segment_after(segs, n_segs, begin, lane); k < n_segs; k += 32) {
    __syncwarp();  // the warp is done with the slab's previous 32
    if (k + lane < n_segs) slab[lane] = segs[k + lane];
    __syncwarp();
    const int count = n_segs - k < 32 ? static_cast<int>(n_segs - k) : 32;
    for (int i = 0; i < count; ++i) {
      const Segment seg = slab[i];
      if (seg.offset >= end) return;
      const int64_t lo = begin > seg.offset ? begin : seg.offset;
      const int64_t hi = end < seg.offset + seg.bytes ? end : seg.offset + seg.bytes;
      if (lo < hi) piece(seg.tensor, lo - seg.offset, lo, hi - lo);
    }
  }
}

// The launch shape of one call: range r of the flat buffer is bytes
// [r * range_bytes, (r + 1) * range_bytes), owned by warps
// [r * warps_per_range, (r + 1) * warps_per_range) of the grid.
struct Grid {
  int64_t range_bytes;
  unsigned blocks;
  int warps_per_range;
  bool wide;
};

// This thread's team and range; false when its warp has no range (the last
// block's spare warps).
__device__ inline bool my_range(const Grid& g, int64_t flat_bytes, Team* team, int64_t* begin, int64_t* end) {
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  *team = Team{static_cast<int>(threadIdx.x & 31), static_cast<int>(warp % g.warps_per_range), g.warps_per_range};
  *begin = (warp / g.warps_per_range) * g.range_bytes;
  *end = *begin + g.range_bytes < flat_bytes ? *begin + g.range_bytes : flat_bytes;
  return *begin < flat_bytes;
}

enum class Direction { kToFlat, kFromFlat };

// U: 16-byte vectors a lane per trip; kMinBlocks: blocks per SM the
// registers must allow (kMinBlocksPerSm for production; fewer lets the
// kWarpRangesU8Lb3/Lb2 variants hold a deeper unroll in registers).
template <Direction kDir, int U = kUnroll, int kMinBlocks = kMinBlocksPerSm>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
copy_kernel(const Segment* segs, int64_t n_segs, char* flat, int64_t flat_bytes, Grid grid) {
  Team team;
  int64_t begin, end;
  if (!my_range(grid, flat_bytes, &team, &begin, &end)) return;
  __shared__ Segment slabs[kWarpsPerBlock][32];
  for_range_pieces(segs, n_segs, begin, end, team.lane, slabs[threadIdx.x >> 5], [&](char* tensor, int64_t at, int64_t flat_at, int64_t n) {
    if (kDir == Direction::kToFlat) copy_piece<U>(flat + flat_at, tensor + at, n, team, grid.wide);
    else copy_piece<U>(tensor + at, flat + flat_at, n, team, grid.wide);
  });
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
scale_kernel(const Segment* segs, int64_t n_segs, const char* flat, int64_t flat_bytes, Grid grid,
             typename Opmath<T>::type scale) {
  Team team;
  int64_t begin, end;
  if (!my_range(grid, flat_bytes, &team, &begin, &end)) return;
  __shared__ Segment slabs[kWarpsPerBlock][32];
  for_range_pieces(segs, n_segs, begin, end, team.lane, slabs[threadIdx.x >> 5], [&](char* tensor, int64_t at, int64_t flat_at, int64_t n) {
    scale_piece(reinterpret_cast<T*>(tensor + at), reinterpret_cast<const T*>(flat + flat_at),
                n / static_cast<int64_t>(sizeof(T)), scale, team);
  });
}

// --- launchers -------------------------------------------------------------------

// Blocks of `kernel` the current device holds resident at once (SMs times
// blocks per SM), asked once per device and kernel.
cudaError_t resident_blocks(const void* kernel, int* blocks) {
  struct Entry {
    const void* kernel;
    int device;
    int blocks;
  };
  static std::mutex mutex;
  static std::vector<Entry> cache;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const Entry& e : cache)
      if (e.kernel == kernel && e.device == device) return (*blocks = e.blocks), cudaSuccess;
  }
  int sms = 0, per_sm = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
  if (err != cudaSuccess) return err;
  *blocks = (sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
  std::lock_guard<std::mutex> lock(mutex);
  cache.push_back({kernel, device, *blocks});
  return cudaSuccess;
}

// 16-byte vectors a lane per trip in `variant`'s copy kernel.
constexpr int variant_unroll(FlattenVariant variant) {
  return variant == FlattenVariant::kWarpRangesU8 || variant == FlattenVariant::kWarpRangesU8Lb3 ||
                 variant == FlattenVariant::kWarpRangesU8Lb2
             ? kUnrollDeep
             : kUnroll;
}

// The grid of `variant` for flat_bytes (> 0); ranges are multiples of 16
// bytes, so no range splits an element of the scaled copy.
cudaError_t plan_grid(int64_t flat_bytes, FlattenVariant variant, const void* kernel, Grid* grid) {
  const int per_range = variant == FlattenVariant::kBlockRanges ? kWarpsPerBlock : 1;
  int64_t range = kChunkBytes;
  if (variant != FlattenVariant::kWarpChunks) {
    int blocks = 0;
    cudaError_t err = resident_blocks(kernel, &blocks);
    if (err != cudaSuccess) return err;
    const int64_t ranges = static_cast<int64_t>(blocks) * kWarpsPerBlock / per_range;
    range = (flat_bytes + ranges - 1) / ranges;
    const int64_t min_range = per_range * min_warp_range_bytes(variant_unroll(variant));
    if (range < min_range) range = min_range;
  }
  range = (range + 15) / 16 * 16;
  const int64_t warps = (flat_bytes + range - 1) / range * per_range;
  const int64_t blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  *grid = {range, static_cast<unsigned>(blocks), per_range, variant != FlattenVariant::kWarpNarrow};
  return cudaSuccess;
}

bool valid_variant(FlattenVariant variant) {
  return static_cast<int>(variant) >= 0 && static_cast<int>(variant) < kFlattenVariants;
}

// Validates the arguments and stages the table on the device; on success the
// caller launches. Returns cudaErrorInvalidValue for bad sizes or pointers.
cudaError_t stage(const Segment* segments, int64_t n_segments, const void* flat, int64_t flat_bytes,
                  void* device_table, cudaStream_t stream) {
  if (n_segments < 0 || flat_bytes < 0) return cudaErrorInvalidValue;
  if (n_segments > 0 && (segments == nullptr || device_table == nullptr)) return cudaErrorInvalidValue;
  if (flat_bytes > 0 && flat == nullptr) return cudaErrorInvalidValue;
  return cudaMemcpyAsync(device_table, segments, segment_table_bytes(n_segments), cudaMemcpyHostToDevice, stream);
}

template <Direction kDir>
cudaError_t launch_copy(int64_t n_segments, const void* flat, int64_t flat_bytes, const void* device_table,
                        FlattenVariant variant, cudaStream_t stream) {
  if (n_segments < 0 || flat_bytes < 0 || !valid_variant(variant)) return cudaErrorInvalidValue;
  if (n_segments == 0 || flat_bytes == 0) return cudaSuccess;
  if (flat == nullptr || device_table == nullptr) return cudaErrorInvalidValue;
  using Kernel = void (*)(const Segment*, int64_t, char*, int64_t, Grid);
  Kernel kernel = &copy_kernel<kDir>;
  if (variant == FlattenVariant::kWarpRangesU8) kernel = &copy_kernel<kDir, kUnrollDeep, kMinBlocksPerSm>;
  if (variant == FlattenVariant::kWarpRangesU8Lb3) kernel = &copy_kernel<kDir, kUnrollDeep, 3>;
  if (variant == FlattenVariant::kWarpRangesU8Lb2) kernel = &copy_kernel<kDir, kUnrollDeep, 2>;
  Grid grid;
  cudaError_t err = plan_grid(flat_bytes, variant, reinterpret_cast<const void*>(kernel), &grid);
  if (err != cudaSuccess) return err;
  // The kernel only reads `flat` when copying from it; one kernel serves both.
  kernel<<<grid.blocks, kThreads, 0, stream>>>(static_cast<const Segment*>(device_table), n_segments,
                                               const_cast<char*>(static_cast<const char*>(flat)), flat_bytes, grid);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_scale(const Segment* table, int64_t n_segments, const char* flat, int64_t flat_bytes,
                         double scale, cudaStream_t stream) {
  Grid grid;
  cudaError_t err =
      plan_grid(flat_bytes, FlattenVariant::kWarpRanges, reinterpret_cast<const void*>(&scale_kernel<T>), &grid);
  if (err != cudaSuccess) return err;
  scale_kernel<T><<<grid.blocks, kThreads, 0, stream>>>(table, n_segments, flat, flat_bytes, grid,
                                                        static_cast<typename Opmath<T>::type>(scale));
  return cudaGetLastError();
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

template <int U, int Q>
void emulate_shifted(uint4* d, const uint4* s, int sh, int64_t vectors, int warps) {
  const int64_t trip = static_cast<int64_t>(warps) * 32 * U;
  for (int w = 0; w < warps; ++w) {
    for (int64_t base = static_cast<int64_t>(w) * 32 * U; base < vectors; base += trip) {
      ShiftTrip<U> lanes[32];
      for (int lane = 0; lane < 32; ++lane) load_trip(lanes[lane], s + base + lane, vectors - base - lane, lane);
      for (int u = 0; u < U; ++u)
        for (int lane = 0; lane < 32; ++lane) {
          const int from = (lane + 1) & 31;
          const uint4 next = trip_send(lanes[from], u, from);
          if (32 * u < vectors - base - lane) d[base + lane + 32 * u] = shifted<Q>(lanes[lane].v[u], next, sh);
        }
    }
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

const char* flatten_variant_name(FlattenVariant variant) {
  switch (variant) {
    case FlattenVariant::kWarpRanges: return "warp-ranges";
    case FlattenVariant::kBlockRanges: return "block-ranges";
    case FlattenVariant::kWarpChunks: return "warp-chunks";
    case FlattenVariant::kWarpNarrow: return "warp-narrow";
    case FlattenVariant::kWarpRangesU8: return "warp-ranges-u8";
    case FlattenVariant::kWarpRangesU8Lb3: return "warp-ranges-u8-lb3";
    case FlattenVariant::kWarpRangesU8Lb2: return "warp-ranges-u8-lb2";
  }
  return "?";
}

cudaError_t launch_flatten_staged(int64_t n_segments, void* flat, int64_t flat_bytes, const void* device_table,
                                  FlattenVariant variant, cudaStream_t stream) {
  return launch_copy<Direction::kToFlat>(n_segments, flat, flat_bytes, device_table, variant, stream);
}

cudaError_t launch_unflatten_staged(int64_t n_segments, const void* flat, int64_t flat_bytes,
                                    const void* device_table, FlattenVariant variant, cudaStream_t stream) {
  return launch_copy<Direction::kFromFlat>(n_segments, flat, flat_bytes, device_table, variant, stream);
}

cudaError_t launch_flatten(const Segment* segments, int64_t n_segments, void* flat, int64_t flat_bytes,
                           void* device_table, cudaStream_t stream) {
  if (n_segments == 0 || flat_bytes == 0) return cudaSuccess;
  cudaError_t err = stage(segments, n_segments, flat, flat_bytes, device_table, stream);
  if (err != cudaSuccess) return err;
  return launch_flatten_staged(n_segments, flat, flat_bytes, device_table, kProductionVariant, stream);
}

cudaError_t launch_unflatten(const Segment* segments, int64_t n_segments, const void* flat, int64_t flat_bytes,
                             void* device_table, cudaStream_t stream) {
  if (n_segments == 0 || flat_bytes == 0) return cudaSuccess;
  cudaError_t err = stage(segments, n_segments, flat, flat_bytes, device_table, stream);
  if (err != cudaSuccess) return err;
  return launch_unflatten_staged(n_segments, flat, flat_bytes, device_table, kProductionVariant, stream);
}

cudaError_t launch_unflatten_scaled(const Segment* segments, int64_t n_segments, const void* flat,
                                    int64_t flat_bytes, ScaledType type, double scale, void* device_table,
                                    cudaStream_t stream) {
  const int size = scaled_type_size(type);
  if (size == 0) return cudaErrorInvalidValue;
  for (int64_t k = 0; k < n_segments; ++k)
    if (segments[k].offset % size != 0 || segments[k].bytes % size != 0) return cudaErrorInvalidValue;
  if (n_segments == 0 || flat_bytes == 0) return cudaSuccess;
  cudaError_t err = stage(segments, n_segments, flat, flat_bytes, device_table, stream);
  if (err != cudaSuccess) return err;
  // Ranges are whole 16 bytes (plan_grid), a multiple of every element size,
  // so none splits an element.
  const Segment* table = static_cast<const Segment*>(device_table);
  const char* src = static_cast<const char*>(flat);
  switch (type) {
    case ScaledType::kFloat32: return launch_scale<float>(table, n_segments, src, flat_bytes, scale, stream);
    case ScaledType::kFloat64: return launch_scale<double>(table, n_segments, src, flat_bytes, scale, stream);
    case ScaledType::kFloat16: return launch_scale<__half>(table, n_segments, src, flat_bytes, scale, stream);
    case ScaledType::kBFloat16: return launch_scale<__nv_bfloat16>(table, n_segments, src, flat_bytes, scale, stream);
  }
  return cudaErrorInvalidValue;
}

template <int U>
void emulate_vectors(uint4* d, const uint4* s, int shift, int64_t vectors, int warps) {
  const int sh = (shift & 3) * 8;
  switch (shift >> 2) {
    case 0:
      if (shift == 0) std::memcpy(d, s, static_cast<size_t>(16 * vectors));
      else emulate_shifted<U, 0>(d, s, sh, vectors, warps);
      break;
    case 1: emulate_shifted<U, 1>(d, s, sh, vectors, warps); break;
    case 2: emulate_shifted<U, 2>(d, s, sh, vectors, warps); break;
    default: emulate_shifted<U, 3>(d, s, sh, vectors, warps); break;
  }
}

int64_t emulate_piece_copy(char* dst, const char* src, int64_t n, int warps, int unroll) {
  const PiecePlan p = plan_piece(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src), n);
  int64_t violations = 0;
  // Every byte in exactly one part; every source vector read inside the piece.
  const int64_t done = p.head + 16 * p.vectors;
  violations += p.head < 0 || p.vectors < 0 || done > n;
  violations += p.vectors > 0 && (reinterpret_cast<uintptr_t>(dst + p.head) & 15) != 0;
  if (p.vectors > 0 && p.shift > 0) {
    const char* aligned = src + p.head - p.shift;
    violations += aligned < src || aligned + 16 * (p.vectors + 1) > src + n;
  }
  const bool bad_args = warps < 1 || (unroll != kUnroll && unroll != kUnrollDeep);
  if (violations > 0 || bad_args) return violations + bad_args;
  std::memcpy(dst, src, static_cast<size_t>(p.head));
  if (p.vectors > 0) {
    uint4* d = reinterpret_cast<uint4*>(dst + p.head);
    const uint4* s = reinterpret_cast<const uint4*>(src + p.head - p.shift);
    if (unroll == kUnrollDeep) emulate_vectors<kUnrollDeep>(d, s, p.shift, p.vectors, warps);
    else emulate_vectors<kUnroll>(d, s, p.shift, p.vectors, warps);
  }
  std::memcpy(dst + done, src + done, static_cast<size_t>(n - done));
  return 0;
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
