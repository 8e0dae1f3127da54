// CPU kernels of the flatten ops: one pass over the bytes, split across
// ATen's intra-op threads when the copy is large enough to pay for them.
//
// [Note: one pass over segments]
// A flatten is a list of (source, destination, length) segments laid end to
// end in the flat buffer. We parallelise over *elements of the flat buffer*,
// not over tensors: each thread takes a contiguous range of the buffer and
// copies the pieces of whichever segments fall in it. A list of 2000 small
// tensors and one huge tensor split equally well, and no thread touches a
// cache line another writes, except at range edges.
//
// Large buffers are written with streaming stores; see [Note: why flatten
// streams its stores] in streaming_copy.h.
#include "ops/flatten.h"
#include "ops/scaled_copy.h"
#include "ops/streaming_copy.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace pydist::ops {

// float32, the gradients that matter most, gets the loop compiled for the
// widest vector unit the CPU has; the baseline build is SSE only. One
// multiply per element either way, so the bytes are the same.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void scaled_copy_float(float* dst, const float* src, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * s;
}

namespace {

using detail::Segment;
using detail::SegmentPlan;

// Below this many bytes a copy runs on the calling thread: waking the pool
// costs more than it saves.
constexpr int64_t kParallelGrainBytes = 1 << 20;

// Calls copy(segment, first, count) for every piece of a segment that lies in
// the flat range [begin, end); `first` is relative to the segment's start.
template <typename Copy>
void for_pieces(const std::vector<Segment>& segs, int64_t begin, int64_t end, Copy copy) {
  auto it = std::upper_bound(segs.begin(), segs.end(), begin,
                             [](int64_t pos, const Segment& s) { return pos < s.offset; });
  if (it != segs.begin()) --it;
  for (; it != segs.end() && it->offset < end; ++it) {
    int64_t lo = std::max(begin, it->offset);
    int64_t hi = std::min(end, it->offset + it->numel);
    if (lo < hi) copy(*it, lo - it->offset, hi - lo);
  }
}

// Runs body(begin, end) over [0, total) elements, in parallel when large.
template <typename Body>
void over_elements(int64_t total, int64_t itemsize, Body body) {
  if (total * itemsize < kParallelGrainBytes) {
    body(0, total);
  } else {
    at::parallel_for(0, total, kParallelGrainBytes / itemsize, body);
  }
}

// Runs copy(segment, first, count) for every piece of every segment, the
// flat buffer split across threads (see [Note: one pass over segments]).
template <typename Copy>
void over_segments(const SegmentPlan& plan, int64_t total, int64_t itemsize, Copy copy) {
  over_elements(total, itemsize, [&](int64_t begin, int64_t end) { for_pieces(plan.segments, begin, end, copy); });
}

// Arguments are checked before this runs: see [Note: the layers of a flatten
// op] in flatten.cpp.
void flatten_into_cpu(at::TensorList tensors, const at::Tensor& out, double scale) {
  const int64_t total = out.numel();
  if (total == 0) return;
  const int64_t itemsize = out.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  const SegmentPlan plan = detail::plan_segments(tensors, /*stage_strided=*/false);
  if (scale == 1.0) {
    const bool streaming = total * itemsize >= kStreamingMinBytes;
    over_segments(plan, total, itemsize, [&](const Segment& s, int64_t first, int64_t count) {
      copy_bytes(dst + (s.offset + first) * itemsize, s.data + first * itemsize, count * itemsize, streaming);
    });
    detail::copy_strided_into(plan, tensors, out);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "flatten_into", [&] {
    scalar_t* typed_dst = reinterpret_cast<scalar_t*>(dst);
    over_segments(plan, total, itemsize, [&](const Segment& s, int64_t first, int64_t count) {
      scaled_copy(typed_dst + s.offset + first, reinterpret_cast<const scalar_t*>(s.data) + first, count, scale);
    });
    // Strided tensors: copied into place, then the same arithmetic in place.
    detail::copy_strided_into(plan, tensors, out);
    for (auto [index, offset] : plan.strided) {
      scaled_copy(typed_dst + offset, typed_dst + offset, tensors[index].numel(), scale);
    }
  });
}

at::Tensor flatten_cpu(at::TensorList tensors) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors) total += t.numel();
  at::Tensor out = at::empty({total}, tensors[0].options().memory_format(at::MemoryFormat::Contiguous));
  flatten_into_cpu(tensors, out, 1.0);
  return out;
}

void unflatten_into_cpu(const at::Tensor& flat, at::TensorList tensors, double scale) {
  const int64_t total = flat.numel();
  if (total == 0) return;
  const int64_t itemsize = flat.element_size();
  const char* src = static_cast<const char*>(flat.data_ptr());
  // [Note: strided targets are staged]
  // A strided target gets the same kernel as the others, into a contiguous
  // staging buffer, then ATen's strided copy, so every element is scaled by
  // the same arithmetic. Copying, then Tensor::mul_(Scalar) from C++, did not
  // match: on a strided float16 tensor it came out one ulp off Python's
  // `t.mul_(1/3)` (the reference), as if the scale were rounded to float16
  // first (found by tests/test_ops.py).
  const SegmentPlan plan = detail::plan_segments(tensors, /*stage_strided=*/true);
  if (scale == 1.0) {
    const bool streaming = total * itemsize >= kStreamingMinBytes;
    over_segments(plan, total, itemsize, [&](const Segment& s, int64_t first, int64_t count) {
      copy_bytes(s.data + first * itemsize, src + (s.offset + first) * itemsize, count * itemsize, streaming);
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "unflatten_into", [&] {
      const scalar_t* typed_src = reinterpret_cast<const scalar_t*>(src);
      over_segments(plan, total, itemsize, [&](const Segment& s, int64_t first, int64_t count) {
        scaled_copy(reinterpret_cast<scalar_t*>(s.data) + first, typed_src + s.offset + first, count, scale);
      });
    });
  }
  detail::write_back_staged(plan, tensors);
}

}  // namespace

TORCH_LIBRARY_IMPL(pydist, CPU, m) {
  m.impl("flatten", &flatten_cpu);
  m.impl("flatten_into", &flatten_into_cpu);
  m.impl("unflatten_into", &unflatten_into_cpu);
}

}  // namespace pydist::ops
