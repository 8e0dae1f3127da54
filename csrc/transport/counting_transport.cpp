// A wrapper that counts what goes through the transport behind it: calls
// and bytes per collective kind. Registered as "counting":
//   pydist.transport.wrap("counting", inner).stats()
//   -> {"all_reduce_calls": 3, "all_reduce_bytes": 4096, ...}
// It is also the model for any other wrapper (the overlap lab's simulated
// network): one file, a subclass of WrappingTransport, one register_wrapper.
#include "transport/transport.h"

#include <atomic>

namespace pydist {
namespace transport {
namespace {

class CountingTransport : public WrappingTransport {
 public:
  using WrappingTransport::WrappingTransport;

  Future all_reduce(at::Tensor piece, double scale) override {
    count(all_reduce_, piece);
    return WrappingTransport::all_reduce(std::move(piece), scale);
  }
  Future all_reduce_bucket(at::Tensor piece, double scale, c10d::GradBucket& bucket) override {
    count(all_reduce_, piece);
    return WrappingTransport::all_reduce_bucket(std::move(piece), scale, bucket);
  }
  Future reduce_scatter(at::Tensor input, at::Tensor output_shard, double scale) override {
    count(reduce_scatter_, input);
    return WrappingTransport::reduce_scatter(std::move(input), std::move(output_shard), scale);
  }
  Future all_gather(at::Tensor shard, at::Tensor output) override {
    count(all_gather_, output);
    return WrappingTransport::all_gather(std::move(shard), std::move(output));
  }
  Future all_gather_many(std::vector<at::Tensor> inputs, std::vector<std::vector<at::Tensor>> outputs) override {
    count(all_gather_, all_gather_many_bytes(inputs, world_size()));
    return WrappingTransport::all_gather_many(std::move(inputs), std::move(outputs));
  }
  std::string name() const override { return "counting(" + inner_->name() + ")"; }
  std::map<std::string, int64_t> stats() const override {
    return {{"all_reduce_calls", all_reduce_.calls},         {"all_reduce_bytes", all_reduce_.bytes},
            {"reduce_scatter_calls", reduce_scatter_.calls}, {"reduce_scatter_bytes", reduce_scatter_.bytes},
            {"all_gather_calls", all_gather_.calls},         {"all_gather_bytes", all_gather_.bytes}};
  }

 private:
  // Bytes are those of the full-size tensor: the piece, the reduce-scatter
  // input, the all-gather output (all_gather_many: the output it stands for,
  // world_size x its inputs).
  struct Counter {
    std::atomic<int64_t> calls{0};
    std::atomic<int64_t> bytes{0};
  };
  static void count(Counter& counter, const at::Tensor& t) { count(counter, static_cast<int64_t>(t.nbytes())); }
  static void count(Counter& counter, int64_t bytes) {
    ++counter.calls;
    counter.bytes += bytes;
  }
  Counter all_reduce_, reduce_scatter_, all_gather_;
};

const bool registered = register_wrapper("counting", [](std::shared_ptr<Transport> inner, const WrapperOptions&) {
  return std::make_shared<CountingTransport>(std::move(inner));
});

}  // namespace
}  // namespace transport
}  // namespace pydist
