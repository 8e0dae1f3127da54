// See [Note: why flatten streams its stores] in streaming_copy.h.
#include "ops/streaming_copy.h"

#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PYDIST_X86_STREAMING 1
#include <immintrin.h>
#endif

namespace pydist::ops {
namespace {

#ifdef PYDIST_X86_STREAMING

// Copies the bytes before the first `align`-aligned destination address with
// memcpy, so the loop's streaming stores are aligned (they must be).
inline size_t align_head(char*& d, const char*& s, size_t n, size_t align) {
  size_t head = (align - (reinterpret_cast<uintptr_t>(d) & (align - 1))) & (align - 1);
  if (head > n) head = n;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  return n - head;
}

// Compiled for AVX-512 whatever the build flags; only called when the CPU has it.
__attribute__((target("avx512f"))) void stream_avx512(char* d, const char* s, size_t n) {
  n = align_head(d, s, n, 64);
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m512i a = _mm512_loadu_si512(s + i);
    __m512i b = _mm512_loadu_si512(s + i + 64);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();
}

__attribute__((target("avx"))) void stream_avx(char* d, const char* s, size_t n) {
  n = align_head(d, s, n, 32);
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();
}

enum class Isa { kNone, kAvx, kAvx512 };

Isa detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx")) return Isa::kAvx;
  return Isa::kNone;
}

const Isa kIsa = detect_isa();

#endif  // PYDIST_X86_STREAMING

}  // namespace

void copy_bytes(void* dst, const void* src, size_t n, bool streaming) {
  if (dst == src) return;  // already in place: see copy_bytes in streaming_copy.h
#ifdef PYDIST_X86_STREAMING
  if (streaming && kIsa == Isa::kAvx512) return stream_avx512(static_cast<char*>(dst), static_cast<const char*>(src), n);
  if (streaming && kIsa == Isa::kAvx) return stream_avx(static_cast<char*>(dst), static_cast<const char*>(src), n);
#endif
  (void)streaming;
  std::memcpy(dst, src, n);
}

const char* streaming_isa() {
#ifdef PYDIST_X86_STREAMING
  switch (kIsa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx: return "avx";
    case Isa::kNone: break;
  }
#endif
  return "none";
}

}  // namespace pydist::ops
