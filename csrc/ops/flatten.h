// Fused flatten / unflatten: the copies between a list of tensors and one
// flat 1-D buffer that gradient buckets and parameter shards are made of.
//
// The op schemas live in one place, csrc/module.cpp (namespace `pydist`);
// flatten_cpu.cpp and flatten_cuda.cpp only add implementations. Callers in
// C++ (the reducer) go through the dispatcher with the handles below, so a
// bucket on any device reaches its device's kernel.
#pragma once

#include <ATen/ATen.h>

namespace pydist::ops {

// Copies `tensors` (one dtype, one device, any shapes and strides) into the
// contiguous 1-D `out`, back to back in list order, each element multiplied
// by `scale` (1: a plain copy; integer dtypes accept only 1). Requires
// out.numel() == sum of numels, out on the same device with the same dtype.
// A tensor may be exactly its own place in `out` (same address, contiguous):
// it is scaled in place, or left alone when scale is 1.
void flatten_into(at::TensorList tensors, const at::Tensor& out, double scale = 1.0);

// As flatten_into, into a freshly allocated buffer.
at::Tensor flatten(at::TensorList tensors);

// Copies consecutive segments of the contiguous 1-D `flat` back into
// `tensors` in place, each multiplied by `scale` (scale 1 is a plain copy;
// integer dtypes accept only 1). Requires the numels to add up to flat.numel().
// A tensor that is exactly its own segment of `flat` is scaled in place.
void unflatten_into(const at::Tensor& flat, at::TensorList tensors, double scale);

namespace detail {

// Shared argument checks, so CPU and CUDA reject the same input with the
// same words. Each returns the total number of elements of `tensors`.
int64_t check_tensor_list(const char* op, at::TensorList tensors, const char* what);
void check_flat(const char* op, const char* arg, const at::Tensor& flat,
                at::TensorList tensors, int64_t total);
// A scale other than 1 needs a floating dtype.
void check_scale(const char* op, const at::Tensor& flat, double scale);

}  // namespace detail
}  // namespace pydist::ops
