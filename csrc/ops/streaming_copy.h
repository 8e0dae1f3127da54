// A memcpy for large destinations that bypasses the cache on the way out.
//
// [Note: why flatten streams its stores]
// Flattening 2000 gradients into a 256 MB bucket is 2000 memcpys of 1-256 KB.
// Each is below glibc's non-temporal threshold (about 3/4 of the last-level
// cache share), so glibc copies it with ordinary stores, and an ordinary
// store first reads the destination line into the cache (read-for-ownership):
// 3 bytes of memory traffic per byte copied. One memcpy of the same 256 MB is
// above the threshold and uses streaming stores (2 bytes of traffic per byte),
// which is why it ran ~1.6x faster on our 2-core Ice Lake VM (20 vs 12 GB/s,
// read+write). A bucket that large does not stay in cache before the
// all-reduce reads it anyway, so flatten decides once, from the *total* size,
// and streams every segment. Small buckets keep ordinary stores: they fit in
// cache and the collective that follows reads them from there.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pydist::ops {

// Flat buffers at least this large are written with streaming stores. Measured
// on the 2-core VM (L2 1.25 MB/core, L3 share 48 MB): at 4 MB ordinary stores
// win (the data stays in cache), at 16 MB streaming wins by ~1.5x.
constexpr int64_t kStreamingMinBytes = int64_t{8} << 20;

// Copies n bytes from src to dst, like std::memcpy: the ranges must not
// overlap, except that dst == src is allowed and copies nothing (a gradient
// that already lives in its bucket slot; see [Note: resident gradients] in
// reducer/reducer.h). With
// `streaming`, uses non-temporal stores where the CPU has them (x86-64 with
// AVX or AVX-512, chosen at run time) and ends with a store fence, so the
// bytes are visible to other threads once it returns; elsewhere it is memcpy.
// Called by the CPU flatten kernels for every contiguous segment.
void copy_bytes(void* dst, const void* src, size_t n, bool streaming);

// The instruction set copy_bytes streams with on this CPU: "avx512", "avx" or
// "none" (memcpy). For benchmarks and logs.
const char* streaming_isa();

}  // namespace pydist::ops
