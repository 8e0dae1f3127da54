// x * scale as torch computes it: the one element-wise scale loop of the CPU
// copies (the flatten kernels; meant for every CPU loop that multiplies
// gradients by the averaging factor, so they all round alike).
//
// torch's `mul_` by a Python scalar computes in the dtype's opmath type
// (float for float16/bfloat16/float32, double for float64) with the scale
// rounded to it, then rounds the product back; doing the same here makes the
// results bitwise torch's.
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>

namespace pydist::ops {

// One element: T(opmath(x) * s).
template <typename T>
inline T scaled(T x, at::opmath_type<T> s) {
  return static_cast<T>(static_cast<at::opmath_type<T>>(x) * s);
}

// The float32 loop, compiled for the widest vector unit the CPU has (chosen
// when the library loads); defined in flatten_cpu.cpp.
void scaled_copy_float(float* dst, const float* src, int64_t n, float s);

// dst[i] = scaled(src[i], scale) for n elements. dst may be src (an in-place
// scale); otherwise the ranges must not overlap.
template <typename T>
void scaled_copy(T* dst, const T* src, int64_t n, double scale) {
  const auto s = static_cast<at::opmath_type<T>>(scale);
  for (int64_t i = 0; i < n; ++i) dst[i] = scaled(src[i], s);
}

template <>
inline void scaled_copy<float>(float* dst, const float* src, int64_t n, double scale) {
  scaled_copy_float(dst, src, n, static_cast<float>(scale));
}

}  // namespace pydist::ops
