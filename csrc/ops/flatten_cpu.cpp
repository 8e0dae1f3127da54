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
#include "ops/streaming_copy.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace pydist::ops {
namespace {

// Below this many bytes a copy runs on the calling thread: waking the pool
// costs more than it saves.
constexpr int64_t kParallelGrainBytes = 1 << 20;

// One contiguous tensor's place in the flat buffer, in elements.
struct Segment {
  char* tensor;    // the tensor's data
  int64_t offset;  // its first element's index in the flat buffer
  int64_t numel;
};

// Contiguous tensors become segments. Strided ones are listed apart with
// their offsets; with `staging`, each also gets a contiguous buffer that
// stands in for it as a segment (unflatten_into writes there, then copies it
// into the strided tensor; see [Note: strided targets are staged]).
struct SegmentPlan {
  std::vector<Segment> segments;
  std::vector<std::pair<size_t, int64_t>> strided;  // (index in list, offset)
  std::vector<at::Tensor> staging;                  // per strided tensor, when staged
};

SegmentPlan plan_segments(at::TensorList tensors, bool stage_strided = false) {
  SegmentPlan plan;
  plan.segments.reserve(tensors.size());
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() > 0) {
      if (t.is_contiguous()) {
        plan.segments.push_back({static_cast<char*>(t.data_ptr()), offset, t.numel()});
      } else {
        plan.strided.emplace_back(i, offset);
        if (stage_strided) {
          plan.staging.push_back(at::empty({t.numel()}, t.options().memory_format(at::MemoryFormat::Contiguous)));
          plan.segments.push_back({static_cast<char*>(plan.staging.back().data_ptr()), offset, t.numel()});
        }
      }
    }
    offset += t.numel();
  }
  return plan;
}

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

// dst[i] = src[i] * scale, computed as torch's `mul_` by a Python scalar
// computes it (in the dtype's opmath type), so results match bitwise. dst may
// be src (an in-place scale).
template <typename T>
void scaled_copy(T* dst, const T* src, int64_t n, double scale) {
  using opmath_t = at::opmath_type<T>;
  const opmath_t s = static_cast<opmath_t>(scale);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<opmath_t>(src[i]) * s);
}

// float32, the gradients that matter most, gets the loop compiled for the
// widest vector unit the CPU has (chosen when the library loads); the
// baseline build is SSE only. One multiply per element either way, so the
// bytes are the same.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void scaled_copy_float(float* dst, const float* src, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * s;
}

template <>
void scaled_copy<float>(float* dst, const float* src, int64_t n, double scale) {
  scaled_copy_float(dst, src, n, static_cast<float>(scale));
}

void flatten_into_cpu(at::TensorList tensors, const at::Tensor& out, double scale) {
  int64_t total = detail::check_tensor_list("flatten_into", tensors, "tensors");
  detail::check_flat("flatten_into", "out", out, tensors, total);
  TORCH_CHECK(out.device().is_cpu(), "flatten_into: `out` is on ", out.device(), ", expected cpu");
  detail::check_scale("flatten_into", out, scale);
  if (total == 0) return;
  const int64_t itemsize = out.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  const bool streaming = total * itemsize >= kStreamingMinBytes;
  SegmentPlan plan = plan_segments(tensors);
  // Strided tensors are copied into place by ATen.
  auto copy_strided = [&](auto scale_in_place) {
    for (auto [index, offset] : plan.strided) {
      const at::Tensor& t = tensors[index];
      out.narrow(0, offset, t.numel()).view(t.sizes()).copy_(t);
      scale_in_place(offset, t.numel());
    }
  };
  if (scale == 1.0) {
    over_elements(total, itemsize, [&](int64_t begin, int64_t end) {
      for_pieces(plan.segments, begin, end, [&](const Segment& s, int64_t first, int64_t count) {
        copy_bytes(dst + (s.offset + first) * itemsize, s.tensor + first * itemsize, count * itemsize, streaming);
      });
    });
    copy_strided([](int64_t, int64_t) {});
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "flatten_into", [&] {
    scalar_t* typed_dst = reinterpret_cast<scalar_t*>(dst);
    over_elements(total, itemsize, [&](int64_t begin, int64_t end) {
      for_pieces(plan.segments, begin, end, [&](const Segment& s, int64_t first, int64_t count) {
        scaled_copy(typed_dst + s.offset + first, reinterpret_cast<const scalar_t*>(s.tensor) + first, count, scale);
      });
    });
    // The same arithmetic as the others, in place.
    copy_strided([&](int64_t offset, int64_t n) { scaled_copy(typed_dst + offset, typed_dst + offset, n, scale); });
  });
}

at::Tensor flatten_cpu(at::TensorList tensors) {
  int64_t total = detail::check_tensor_list("flatten", tensors, "tensors");
  TORCH_CHECK(!tensors.empty(), "flatten: `tensors` is empty (the Python wrapper handles this)");
  at::Tensor out = at::empty({total}, tensors[0].options().memory_format(at::MemoryFormat::Contiguous));
  flatten_into_cpu(tensors, out, 1.0);
  return out;
}

void unflatten_into_cpu(const at::Tensor& flat, at::TensorList tensors, double scale) {
  int64_t total = detail::check_tensor_list("unflatten_into", tensors, "tensors");
  detail::check_flat("unflatten_into", "flat", flat, tensors, total);
  TORCH_CHECK(flat.device().is_cpu(), "unflatten_into: `flat` is on ", flat.device(), ", expected cpu");
  detail::check_scale("unflatten_into", flat, scale);
  const bool plain = scale == 1.0;
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
  SegmentPlan plan = plan_segments(tensors, /*stage_strided=*/true);
  if (plain) {
    const bool streaming = total * itemsize >= kStreamingMinBytes;
    over_elements(total, itemsize, [&](int64_t begin, int64_t end) {
      for_pieces(plan.segments, begin, end, [&](const Segment& s, int64_t first, int64_t count) {
        copy_bytes(s.tensor + first * itemsize, src + (s.offset + first) * itemsize, count * itemsize, streaming);
      });
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "unflatten_into", [&] {
      const scalar_t* typed_src = reinterpret_cast<const scalar_t*>(src);
      over_elements(total, itemsize, [&](int64_t begin, int64_t end) {
        for_pieces(plan.segments, begin, end, [&](const Segment& s, int64_t first, int64_t count) {
          scaled_copy(reinterpret_cast<scalar_t*>(s.tensor) + first, typed_src + s.offset + first, count, scale);
        });
      });
    });
  }
  for (size_t k = 0; k < plan.strided.size(); ++k) {
    const at::Tensor& t = tensors[plan.strided[k].first];
    at::Tensor target = t;  // a handle: writes land in the caller's tensor
    target.copy_(plan.staging[k].view(t.sizes()));
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(pydist, CPU, m) {
  m.impl("flatten", &flatten_cpu);
  m.impl("flatten_into", &flatten_into_cpu);
  m.impl("unflatten_into", &unflatten_into_cpu);
}

}  // namespace pydist::ops
