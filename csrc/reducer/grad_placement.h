// Where a parameter's gradient meets its bucket slot: one strategy per
// reducer, chosen when its transport is set (choose_grad_placement), so the
// pipeline in reducer.cpp never branches on it.
//
//   CopyPlacement        .grad is its own tensor: copied (scaled) into the
//                        bucket before the collective, copied back after
//                        (torch DDP's default).
//   BucketViewPlacement  gradient_as_bucket_view=True: .grad *is* a view of
//                        its slot; nothing is copied, the chunk is scaled in
//                        place.
//   ResidentPlacement    copy, except that a .grad which lives on across
//                        iterations is moved into its slot on a storage of
//                        its own, after which copying it is a no-op. See
//                        [Note: resident gradients] in reducer.h.
//
// Implemented in bucket.cpp.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "reducer/bucket.h"

namespace pydist {

// Whether parameter `index` got no gradient on any rank, by the reduced
// "parameter used" map (undefined: not reduced, every parameter counts as used).
inline bool globally_unused(const at::Tensor& global_used, int64_t index) {
  return global_used.defined() && global_used.const_data_ptr<int>()[index] == 0;
}

class GradPlacement {
 public:
  // `params` and `names` are the reducer's; they outlive the placement.
  GradPlacement(const std::vector<at::Tensor>& params, const std::vector<std::string>& names)
      : params_(params), names_(names) {}
  virtual ~GradPlacement() = default;
  GradPlacement(const GradPlacement&) = delete;
  GradPlacement& operator=(const GradPlacement&) = delete;

  virtual const char* name() const = 0;

  // A bucket was just made (construction, rebuild): gradients that exist
  // may move into it.
  virtual void adopt(Bucket& /*bucket*/) {}

  // prepare_for_backward, before any gradient of this backward arrives.
  virtual void before_backward(std::vector<Bucket>& /*buckets*/) {}

  // launch_chunk: puts the chunk's gradients, times `scale`, into its piece
  // of the bucket buffer (a parameter without a gradient contributes zeros).
  virtual void fill_chunk(Bucket& bucket, const Chunk& chunk, double scale) = 0;

  // finalize_backward: writes the chunk's reduced values back into .grad.
  // `result` is the reduced bucket: its own buffer, or a tensor laid out
  // like it (a comm hook's). Parameters globally unused keep their .grad.
  virtual void write_back(Bucket& bucket, const Chunk& chunk, const at::Tensor& result,
                          const at::Tensor& global_used) = 0;

 protected:
  // A zero tensor standing in for the gradient of a parameter unused this iteration.
  const at::Tensor& zeros_for(int64_t index);

  const std::vector<at::Tensor>& params_;
  const std::vector<std::string>& names_;
  std::vector<at::Tensor> zeros_;  // made on first use, kept: the same parameters go unused again
};

// gradient_as_bucket_view: BucketViewPlacement. Otherwise ResidentPlacement
// where `resident_allowed` (see [Note: resident gradients] for when), else
// CopyPlacement.
std::unique_ptr<GradPlacement> choose_grad_placement(const std::vector<at::Tensor>& params,
                                                     const std::vector<std::string>& names,
                                                     bool gradient_as_bucket_view, bool resident_allowed);

}  // namespace pydist
