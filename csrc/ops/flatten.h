// Fused flatten / unflatten: the copies between a list of tensors and one
// flat 1-D buffer that gradient buckets and parameter shards are made of.
//
// The op schemas live in one place, csrc/module.cpp (namespace `pydist`).
// flatten.cpp registers the device-independent kernels (argument checks,
// autograd, version counters; see [Note: the layers of a flatten op]);
// flatten_cpu.cpp and flatten_cuda.cpp add only the copies, and pydist/ops.py
// the fake-tensor rules. Callers in C++ (the reducer) go through the
// dispatcher with the handles below, so a bucket on any device reaches its
// device's kernel.
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace pydist::ops {

// Copies `tensors` (one dtype, one device, any shapes and strides) into the
// contiguous 1-D `out`, back to back in list order, each element multiplied
// by `scale` (1: a plain copy; integer dtypes accept only 1). Requires
// out.numel() == sum of numels, out on the same device with the same dtype.
// A tensor may be exactly its own place in `out` (same address, contiguous):
// it is scaled in place, or left alone when scale is 1; any other tensor
// that shares memory with `out` is an error (as for torch.cat's `out=`).
// Runs with grad mode off: a copy of gradients, never part of a graph.
// Called by the reducer on its way into a bucket.
void flatten_into(at::TensorList tensors, const at::Tensor& out, double scale = 1.0);

// As flatten_into, into a freshly allocated buffer.
at::Tensor flatten(at::TensorList tensors);

// Copies consecutive segments of the contiguous 1-D `flat` back into
// `tensors` in place, each multiplied by `scale` (scale 1 is a plain copy;
// integer dtypes accept only 1). Requires the numels to add up to flat.numel().
// A tensor that is exactly its own segment of `flat` is scaled in place; a
// tensor that shares memory with `flat` otherwise, or with another tensor of
// the list, is an error. Runs with grad mode off, as flatten_into. Called by
// the reducer on its way out of a bucket.
void unflatten_into(const at::Tensor& flat, at::TensorList tensors, double scale);

namespace detail {

// Argument checks of each op, run once per call before any device kernel
// (see [Note: the layers of a flatten op]): dtypes and devices agree, sizes
// add up, the scale suits the dtype, and nothing written overlaps what else
// the call reads or writes. Each returns the total number of elements.
int64_t check_flatten(at::TensorList tensors);
int64_t check_flatten_into(at::TensorList tensors, const at::Tensor& out, double scale);
int64_t check_unflatten_into(const at::Tensor& flat, at::TensorList tensors, double scale);

// One contiguous tensor's place in the flat buffer, in elements.
struct Segment {
  char* data;      // the tensor's data (or its staging buffer's)
  int64_t offset;  // its first element's index in the flat buffer
  int64_t numel;
};

// How the device kernels see a list: contiguous tensors become segments, in
// offset order. Strided ones are listed apart with their offsets; with
// `stage_strided`, each also gets a contiguous staging buffer that stands in
// for it as a segment (unflatten_into writes there, then copies it into the
// strided tensor; see [Note: strided targets are staged]). Zero-size tensors
// appear nowhere.
struct SegmentPlan {
  std::vector<Segment> segments;
  std::vector<std::pair<size_t, int64_t>> strided;  // (index in list, offset)
  std::vector<at::Tensor> staging;                  // per strided tensor, when staged
};
SegmentPlan plan_segments(at::TensorList tensors, bool stage_strided);

// flatten_into's strided tensors: ATen's strided copy puts each in its place
// in `out`, unscaled.
void copy_strided_into(const SegmentPlan& plan, at::TensorList tensors, const at::Tensor& out);

// unflatten_into's strided tensors: each staging buffer, once written, is
// copied into its tensor.
void write_back_staged(const SegmentPlan& plan, at::TensorList tensors);

}  // namespace detail
}  // namespace pydist::ops
