// A DDP comm hook (torch's CommHookInterface: a Python hook, or a C++ one)
// as a Transport, so the reducer runs a user's hook the way it runs any
// transport and includes no pybind itself.
#pragma once

#include <torch/csrc/distributed/c10d/comm.hpp>

#include "transport/transport.h"

namespace pydist {
namespace transport {

class CommHookTransport : public Transport {
 public:
  CommHookTransport(std::unique_ptr<c10d::CommHookInterface> hook, int64_t rank, int64_t world_size);

  // A hook reduces whole buckets: owns_buckets(). all_reduce_bucket runs
  // hook(state, bucket) and completes when the hook's future does; `scale`
  // is ignored (a hook divides as it sees fit: torch's GradBucket contract).
  // result_of returns the tensor the hook's future holds.
  bool owns_buckets() const override { return true; }
  Future all_reduce_bucket(at::Tensor piece, double scale, c10d::GradBucket& bucket) override;
  at::Tensor result_of(const Future& future, const at::Tensor& piece) override;
  bool applies_scale() const override { return true; }

  // A DDP comm hook only all-reduces buckets: these raise.
  Future all_reduce(at::Tensor piece, double scale) override;
  Future reduce_scatter(at::Tensor input, at::Tensor output_shard, double scale) override;
  Future all_gather(at::Tensor shard, at::Tensor output) override;
  Future all_gather_many(std::vector<at::Tensor> inputs, std::vector<std::vector<at::Tensor>> outputs) override;

  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return world_size_; }
  std::string name() const override { return "comm_hook"; }

 private:
  std::unique_ptr<c10d::CommHookInterface> hook_;
  int64_t rank_;
  int64_t world_size_;
};

}  // namespace transport
}  // namespace pydist
