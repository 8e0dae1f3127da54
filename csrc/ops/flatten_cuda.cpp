// CUDA implementations of the flatten ops: the shared checks of flatten.cpp,
// then the torch-free launchers of kernels/flatten_kernels.cuh on the current
// stream. One kernel launch per call for the contiguous tensors (see [Note:
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

// Segments of the contiguous tensors, and the strided ones apart with their
// element offsets in the flat buffer; with `stage_strided`, each strided one
// also gets a contiguous staging buffer that stands in for it as a segment
// (see [Note: strided targets are staged] in flatten_cpu.cpp).
struct CudaPlan {
  std::vector<k::Segment> segments;
  std::vector<std::pair<size_t, int64_t>> strided;  // (index in list, element offset)
  std::vector<at::Tensor> staging;                  // per strided tensor, when staged
};

CudaPlan plan_segments(at::TensorList tensors, int64_t itemsize, bool stage_strided = false) {
  CudaPlan plan;
  plan.segments.reserve(tensors.size());
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() > 0) {
      if (t.is_contiguous()) {
        plan.segments.push_back({static_cast<char*>(t.data_ptr()), offset * itemsize, t.numel() * itemsize});
      } else {
        plan.strided.emplace_back(i, offset);
        if (stage_strided) {
          plan.staging.push_back(at::empty({t.numel()}, t.options().memory_format(at::MemoryFormat::Contiguous)));
          plan.segments.push_back({static_cast<char*>(plan.staging.back().data_ptr()), offset * itemsize,
                                   t.numel() * itemsize});
        }
      }
    }
    offset += t.numel();
  }
  return plan;
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

void flatten_into_cuda(at::TensorList tensors, const at::Tensor& out, double scale) {
  int64_t total = detail::check_tensor_list("flatten_into", tensors, "tensors");
  detail::check_flat("flatten_into", "out", out, tensors, total);
  TORCH_CHECK(out.is_cuda(), "flatten_into: `out` is on ", out.device(), ", expected a CUDA device");
  detail::check_scale("flatten_into", out, scale);
  if (total == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  const int64_t itemsize = out.element_size();
  CudaPlan plan = plan_segments(tensors, itemsize);
  if (!plan.segments.empty()) {
    at::Tensor table = table_workspace(out, plan.segments.size());
    cudaError_t err = k::launch_flatten(plan.segments.data(), static_cast<int64_t>(plan.segments.size()),
                                        out.data_ptr(), total * itemsize, table.data_ptr(),
                                        c10::cuda::getCurrentCUDAStream());
    check_launch("flatten_into", err, plan.segments.size(), total * itemsize);
  }
  for (auto [index, offset] : plan.strided) {
    const at::Tensor& t = tensors[index];
    out.narrow(0, offset, t.numel()).view(t.sizes()).copy_(t);
  }
  // A second pass on the device rather than a scaled kernel: `out` is
  // contiguous, where ATen's mul_ by a scalar computes as the CPU path does
  // (in the opmath type, the scale rounded to it).
  if (scale != 1.0) out.mul_(scale);
}

at::Tensor flatten_cuda(at::TensorList tensors) {
  int64_t total = detail::check_tensor_list("flatten", tensors, "tensors");
  TORCH_CHECK(!tensors.empty(), "flatten: `tensors` is empty (the Python wrapper handles this)");
  at::Tensor out = at::empty({total}, tensors[0].options().memory_format(at::MemoryFormat::Contiguous));
  flatten_into_cuda(tensors, out, 1.0);
  return out;
}

k::ScaledType scaled_type(const at::Tensor& flat, double scale) {
  switch (flat.scalar_type()) {
    case at::kFloat: return k::ScaledType::kFloat32;
    case at::kDouble: return k::ScaledType::kFloat64;
    case at::kHalf: return k::ScaledType::kFloat16;
    case at::kBFloat16: return k::ScaledType::kBFloat16;
    default:
      TORCH_CHECK(false, "unflatten_into: scale ", scale, " needs float16, bfloat16, float32 or float64, got ",
                  flat.scalar_type(), " (integer tensors take scale=1)");
  }
  return k::ScaledType::kFloat32;  // not reached: TORCH_CHECK(false) throws
}

void unflatten_into_cuda(const at::Tensor& flat, at::TensorList tensors, double scale) {
  int64_t total = detail::check_tensor_list("unflatten_into", tensors, "tensors");
  detail::check_flat("unflatten_into", "flat", flat, tensors, total);
  TORCH_CHECK(flat.is_cuda(), "unflatten_into: `flat` is on ", flat.device(), ", expected a CUDA device");
  const bool plain = scale == 1.0;
  const k::ScaledType type = plain ? k::ScaledType::kFloat32 : scaled_type(flat, scale);
  if (total == 0) return;
  c10::cuda::CUDAGuard guard(flat.device());
  const int64_t itemsize = flat.element_size();
  CudaPlan plan = plan_segments(tensors, itemsize, /*stage_strided=*/true);
  if (!plan.segments.empty()) {
    at::Tensor table = table_workspace(flat, plan.segments.size());
    const auto n = static_cast<int64_t>(plan.segments.size());
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    cudaError_t err =
        plain ? k::launch_unflatten(plan.segments.data(), n, flat.data_ptr(), total * itemsize, table.data_ptr(), stream)
              : k::launch_unflatten_scaled(plan.segments.data(), n, flat.data_ptr(), total * itemsize, type, scale,
                                           table.data_ptr(), stream);
    check_launch("unflatten_into", err, plan.segments.size(), total * itemsize);
  }
  for (size_t j = 0; j < plan.strided.size(); ++j) {
    const at::Tensor& t = tensors[plan.strided[j].first];
    at::Tensor target = t;  // a handle: writes land in the caller's tensor
    target.copy_(plan.staging[j].view(t.sizes()));
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(pydist, CUDA, m) {
  m.impl("flatten", &flatten_cuda);
  m.impl("flatten_into", &flatten_into_cuda);
  m.impl("unflatten_into", &unflatten_into_cuda);
}

}  // namespace pydist::ops
