// A sharded unit's output hook that can be closed: pydist/fsdp's backward
// skips the Python hook of a unit whose run of units handles its backward.
// See [Note: runs of units] in pydist/fsdp/_fsdp_state.py.
//
// Every fully_shard'ed unit hooks the tensor its forward returned: the hook
// is the unit's pre-backward, and the post-backward of the units that took
// that tensor as their one input. A Python hook costs the autograd engine a
// GIL acquisition, a call and the hook's own bookkeeping for every unit in
// every backward. Inside a run (consecutive units of one gather batch, each
// taking the one output of the one before it) the run's last unit does that
// work for all of them at once, so the hooks on the other units' outputs
// have nothing left to do: the run closes their gates, and a closed gate
// returns without the GIL. An open gate (the run never started: its last
// unit's output got no gradient) calls its Python hook as before.
//
// A closed gate still has one job: the unit after it in the run has just
// finished its backward (its gradients are accumulated; autograd is about to
// compute this output's), so the gate packs that unit's gradients into its
// reduce batch (GradPack), as the unit's post-backward would have, while
// they are hot in cache and before autograd allocates the next unit's.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdp/unit_ops.h"

namespace pydist {
namespace fsdp {

// One unit's gradients on their way into its reduce batch's rank-major
// input (see [Note: batched collectives] in pydist/fsdp/_fsdp_collectives.py):
// made once per unit, aimed at a column each backward, packed by a closed
// gate. pydist/fsdp/_fsdp_param_group.py: FSDPParamGroup._grad_pack.
//
// A unit's layout is columns (see [Note: a unit's layout] there): one for
// the flat layout, one per parameter for FSDP2's dim-0 chunks. Column c
// holds params [first, end) (in order), starts `shard_offset` elements into
// the unit's part of a row and is `width` elements a rank: packing the unit
// is pack_param_grads of each column's parameters into its place.
class GradPack {
 public:
  struct Column {
    int64_t first, end, shard_offset, width;
  };

  // The unit's unsharded parameters, their numels, its columns as
  // (first, end, shard_offset, width).
  GradPack(std::vector<at::Tensor> params, std::vector<int64_t> numels,
           const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>& columns)
      : params_(std::move(params)), numels_(std::move(numels)) {
    int64_t expect = 0;
    for (const auto& [first, end, shard_offset, width] : columns) {
      TORCH_CHECK(first == expect && end >= first && end <= static_cast<int64_t>(params_.size()) &&
                      shard_offset >= 0 && width >= 0,
                  "GradPack: column (", first, ", ", end, ", ", shard_offset, ", ", width, ") does not follow the ",
                  "columns before it over ", params_.size(), " parameters");
      columns_.push_back({first, end, shard_offset, width});
      expect = end;
    }
    TORCH_CHECK(expect == static_cast<int64_t>(params_.size()) && params_.size() == numels_.size(), "GradPack: ",
                params_.size(), " parameters, ", numels_.size(), " numels, columns cover ", expect);
  }

  // Where this backward's pack goes: the unit's part of `input`'s
  // world_size rows starts at `column`, times `scale` (see pack_rank_major).
  // Called by the run start, with the GIL; replaces an earlier aim.
  void aim(at::Tensor input, int64_t world_size, int64_t column, double scale) {
    input_ = std::move(input);
    world_size_ = world_size;
    column_ = column;
    scale_ = scale;
    had_.clear();
    packed_ = false;
  }

  // pack_param_grads of each column into the aim, once (the closed gate; no GIL needed).
  void pack() {
    if (!input_.defined() || packed_) return;
    had_.clear();
    if (columns_.size() == 1) {
      had_ = pack_param_grads(params_, numels_, input_, world_size_, column_, columns_[0].width, scale_);
    } else {
      std::vector<at::Tensor> params;
      std::vector<int64_t> numels;
      for (const Column& c : columns_) {
        params.assign(params_.begin() + c.first, params_.begin() + c.end);
        numels.assign(numels_.begin() + c.first, numels_.begin() + c.end);
        const std::vector<bool> had =
            pack_param_grads(params, numels, input_, world_size_, column_ + c.shard_offset, c.width, scale_);
        had_.insert(had_.end(), had.begin(), had.end());
      }
    }
    packed_ = true;
    input_ = at::Tensor();
  }

  bool packed() const { return packed_; }

  // Which parameters had a gradient, once packed; forgets the aim either way.
  std::vector<bool> take_had() {
    input_ = at::Tensor();
    packed_ = false;
    return std::move(had_);
  }

 private:
  std::vector<at::Tensor> params_;
  std::vector<int64_t> numels_;
  std::vector<Column> columns_;
  at::Tensor input_;  // aimed, not packed yet
  int64_t world_size_ = 1;
  int64_t column_ = 0;
  double scale_ = 1.0;
  std::vector<bool> had_;
  bool packed_ = false;
};

class OutputGate {
 public:
  // `callback`: called with no argument, under the GIL, when the hook fires
  // while the gate is open; what it returns is ignored (the gradient goes on
  // unchanged).
  explicit OutputGate(pybind11::object callback) : callback_(std::move(callback)) {}

  // The autograd graph holding the hook may be freed without the GIL (at the
  // end of a backward); the callback is a Python object.
  ~OutputGate() {
    if (!Py_IsInitialized()) {
      (void)callback_.release();  // the interpreter is gone: nothing left to free it with
      return;
    }
    pybind11::gil_scoped_acquire gil;
    callback_ = pybind11::object();
  }

  OutputGate(const OutputGate&) = delete;
  OutputGate& operator=(const OutputGate&) = delete;

  // Registers the gate as a backward hook of `output` (which requires grad).
  // Called by the unit's post-forward, with the GIL held.
  static void attach(const std::shared_ptr<OutputGate>& gate, const at::Tensor& output) {
    TORCH_CHECK(output.requires_grad(), "OutputGate.attach: the tensor does not require grad");
    output.register_hook([gate](const at::Tensor&) { gate->fire(); });
  }

  // From now on the hook returns at once, packing `pack` (may be null) when
  // it fires. Called by the run's last unit, in backward, before autograd
  // reaches the gated tensors.
  void close(std::shared_ptr<GradPack> pack) {
    pack_ = std::move(pack);
    closed_.store(true, std::memory_order_release);
  }
  bool closed() const { return closed_.load(std::memory_order_acquire); }

 private:
  void fire() {
    if (closed()) {
      if (pack_) pack_->pack();
      return;
    }
    pybind11::gil_scoped_acquire gil;
    try {
      callback_();
    } catch (pybind11::error_already_set& e) {
      e.restore();  // re-raised in Python as what the callback raised
      throw python_error();
    }
  }

  std::atomic<bool> closed_{false};
  std::shared_ptr<GradPack> pack_;  // set before closed_
  pybind11::object callback_;
};

}  // namespace fsdp
}  // namespace pydist
