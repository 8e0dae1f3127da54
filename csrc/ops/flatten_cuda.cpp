// CUDA implementations of the flatten ops (arguments checked and segments
// planned by flatten.cpp): the torch-free launchers of
// kernels/flatten_kernels.cuh on the current stream. One kernel launch per call for the contiguous tensors (see [Note:
// one launch per call]); non-contiguous tensors, rare in a gradient bucket,
// go through ATen's strided copy (unflatten_into: from a staging buffer the
// kernel writes), as on the CPU.
//
// Compiled only in CUDA builds: setup.py drops files ending _cuda.cpp otherwise.
#include "ops/flatten.h"

#include "kernels/flatten_kernels.cuh"

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

namespace pydist::ops {
namespace {

namespace k = pydist::kernels;

// The kernels' segment table: byte offsets and lengths.
std::vector<k::Segment> byte_segments(const detail::SegmentPlan& plan, int64_t itemsize) {
  std::vector<k::Segment> segments;
  segments.reserve(plan.segments.size());
  for (const detail::Segment& s : plan.segments) segments.push_back({s.data, s.offset * itemsize, s.numel * itemsize});
  return segments;
}

// Device memory for the segment table, from the caching allocator on the
// current stream: freed when this returns, reused only by later work on the
// same stream, so the kernel has read it by then.
at::Tensor table_workspace(const at::Tensor& like, size_t n_segments) {
  return at::empty({static_cast<int64_t>(k::segment_table_bytes(n_segments))}, like.options().dtype(at::kByte));
}

void check_launch(const char* op, cudaError_t err, size_t n_segments, int64_t flat_bytes) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel failed with ", cudaGetErrorName(err), " (",
              cudaGetErrorString(err), ") copying ", n_segments, " segments, ", flat_bytes, " bytes");
}

// Arguments are checked before these run: see [Note: the layers of a
// flatten op] in flatten.cpp.
void flatten_into_cuda(at::TensorList tensors, const at::Tensor& out, double scale) {
  const int64_t total = out.numel();
  if (total == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  const int64_t itemsize = out.element_size();
  const detail::SegmentPlan plan = detail::plan_segments(tensors, /*stage_strided=*/false);
  if (!plan.segments.empty()) {
    const std::vector<k::Segment> segments = byte_segments(plan, itemsize);
    at::Tensor table = table_workspace(out, segments.size());
    cudaError_t err = k::launch_flatten(segments.data(), static_cast<int64_t>(segments.size()), out.data_ptr(),
                                        total * itemsize, table.data_ptr(), c10::cuda::getCurrentCUDAStream());
    check_launch("flatten_into", err, segments.size(), total * itemsize);
  }
  detail::copy_strided_into(plan, tensors, out);
  // A second pass on the device rather than a scaled kernel: `out` is
  // contiguous, where ATen's mul_ by a scalar computes as the CPU path does
  // (in the opmath type, the scale rounded to it).
  if (scale != 1.0) out.mul_(scale);
}

at::Tensor flatten_cuda(at::TensorList tensors) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors) total += t.numel();
  at::Tensor out = at::empty({total}, tensors[0].options().memory_format(at::MemoryFormat::Contiguous));
  flatten_into_cuda(tensors, out, 1.0);
  return out;
}

// The kernels' name for a floating dtype (check_unflatten_into has refused
// a scale on any other).
k::ScaledType scaled_type(const at::Tensor& flat) {
  switch (flat.scalar_type()) {
    case at::kFloat: return k::ScaledType::kFloat32;
    case at::kDouble: return k::ScaledType::kFloat64;
    case at::kHalf: return k::ScaledType::kFloat16;
    case at::kBFloat16: return k::ScaledType::kBFloat16;
    default: TORCH_CHECK(false, "unflatten_into: no scaled CUDA kernel for ", flat.scalar_type());
  }
  return k::ScaledType::kFloat32;  // not reached: TORCH_CHECK(false) throws
}

void unflatten_into_cuda(const at::Tensor& flat, at::TensorList tensors, double scale) {
  const int64_t total = flat.numel();
  if (total == 0) return;
  c10::cuda::CUDAGuard guard(flat.device());
  const int64_t itemsize = flat.element_size();
  const detail::SegmentPlan plan = detail::plan_segments(tensors, /*stage_strided=*/true);
  if (!plan.segments.empty()) {
    const std::vector<k::Segment> segments = byte_segments(plan, itemsize);
    at::Tensor table = table_workspace(flat, segments.size());
    const auto n = static_cast<int64_t>(segments.size());
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    cudaError_t err =
        scale == 1.0
            ? k::launch_unflatten(segments.data(), n, flat.data_ptr(), total * itemsize, table.data_ptr(), stream)
            : k::launch_unflatten_scaled(segments.data(), n, flat.data_ptr(), total * itemsize, scaled_type(flat),
                                         scale, table.data_ptr(), stream);
    check_launch("unflatten_into", err, segments.size(), total * itemsize);
  }
  detail::write_back_staged(plan, tensors);
}

}  // namespace

TORCH_LIBRARY_IMPL(pydist, CUDA, m) {
  m.impl("flatten", &flatten_cuda);
  m.impl("flatten_into", &flatten_into_cuda);
  m.impl("unflatten_into", &unflatten_into_cuda);
}

}  // namespace pydist::ops
