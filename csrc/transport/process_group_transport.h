// A torch ProcessGroup (gloo, NCCL, the mpi4py backend) as a Transport.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "transport/transport.h"

namespace pydist {
namespace transport {

class ProcessGroupTransport : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> process_group);

  // The group's allreduce / _reduce_scatter_base / _allgather_base. A scale
  // other than 1 is applied before the collective (in place for all_reduce,
  // into a temporary for reduce_scatter): see applies_scale(). wait() waits
  // on the group's Work, so the group's timeout bounds it. A collective whose
  // Work has no future (gloo's reduce-scatter) completes when waited on, and
  // is stamped then.
  Future all_reduce(at::Tensor piece, double scale) override;
  Future reduce_scatter(at::Tensor input, at::Tensor output_shard, double scale) override;
  Future all_gather(at::Tensor shard, at::Tensor output) override;

  int64_t rank() const override { return process_group_->getRank(); }
  int64_t world_size() const override { return process_group_->getSize(); }
  std::string name() const override { return process_group_->getBackendName(); }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return process_group_; }

  // Appended to the error of a collective that fails, for a group that spans
  // hosts: the hosts this rank could have lost (set by pydist.transport; the
  // hierarchical transport names them the same way on its cross-host leg).
  void set_failure_context(std::string context) { failure_context_ = std::move(context); }
  const std::string& failure_context() const { return failure_context_; }

 private:
  Future track(c10::intrusive_ptr<c10d::Work> work) const;

  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  std::string failure_context_;
};

}  // namespace transport
}  // namespace pydist
