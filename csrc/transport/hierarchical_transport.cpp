// Collectives across hosts: shared memory inside each host, a process group
// between hosts, every local rank carrying its own shard across.
//
// [Note: hierarchical collectives]
// A group of H hosts x L ranks (every host the same L; pydist/topology.py
// finds the hosts: the ranks that map one shared segment). Local rank l of
// host h is group rank rank_of[h][l]. Each rank holds three transports:
//
//   local_in    shared memory among the L ranks of its host (the first leg)
//   cross       a process group of the H ranks with its local index l, one
//               per host, in host order: "stream l" (the cross-host leg)
//   local_out   a second shared-memory segment among the same L ranks (the
//               last leg)
//
// and composes:
//
//   all_reduce(x, s)     local_in.reduce_scatter(x padded to L*c, mine[c], s)
//                        -> cross.all_reduce(mine)
//                        -> local_out.all_gather(mine, x)
//   reduce_scatter(in, out, s)
//                        local_in.reduce_scatter(in with its shards in
//                        [local index][host] order, mine[H*s], s)
//                        -> cross.reduce_scatter(mine, out)
//   all_gather(shard, out)
//                        cross.all_gather(shard, mine[H*s])
//                        -> local_out.all_gather_many(mine's H pieces, each
//                        rank's H pieces of out, at their group ranks)
//
// so the bytes a host sends across are the tensor's (S), not a flat ring's
// 2(n-1)/n S, and they go as L concurrent streams, one per local rank, not
// through one leader. Every element is summed once inside its host (by the
// local rank owning it, in local rank order) and once across hosts (by the
// cross group, whose ring gives every member the same bits), then copied:
// every rank ends with the same bits, the same every run. The order of the
// sum, (x_0 + x_1) + (x_2 + x_3) at 2 x 2, is not a flat ring's, so results
// equal torch's to rounding (exactly on integer-valued data).
//
// Ordering. Every rank must issue the same collectives in the same order on
// each of the three transports. The caller's thread issues the first legs
// (in call order, the same on every rank). One thread (the "cross issuer")
// then takes the jobs in call order, waits for each one's first leg and
// issues its cross leg; a second (the "finisher") takes them in the same
// order, waits for the cross leg, runs the last leg and completes the job.
// Cross and last legs thus go out in call order on every rank, whatever
// order the peers' legs finish in, while job k+1's first leg and job k's
// cross leg run at once. The last legs get a segment of their own
// (local_out) because the first legs' queue fills from the caller's thread
// and the last legs' from the finisher: in one queue their interleaving
// would differ between ranks.
//
// A failure ends the transport: the failing job and every later one raise,
// naming the leg and, for the cross leg, the hosts of the stream (what the
// Python side passed as host descriptions), since a stream's peers are the
// other hosts' ranks and a lost peer there is a lost host.
#include "transport/transport.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>

namespace pydist {
namespace transport {
namespace {

class HierarchicalTransport : public Transport {
 public:
  // `rank_of[h][l]`: the group rank of local rank l on host h (every host
  // the same number of ranks, >= 2 hosts and >= 2 ranks each). `local_in`
  // and `local_out`: this host's two shared-memory ends (rank l of L);
  // `cross`: this rank's stream (rank h of H, host order). `host_names[h]`:
  // how errors name host h (e.g. "node1 (ranks 2, 3)").
  HierarchicalTransport(std::shared_ptr<Transport> local_in, std::shared_ptr<Transport> local_out,
                        std::shared_ptr<Transport> cross, int64_t rank, std::vector<std::vector<int64_t>> rank_of,
                        std::vector<std::string> host_names)
      : local_in_(std::move(local_in)),
        local_out_(std::move(local_out)),
        cross_(std::move(cross)),
        rank_(rank),
        rank_of_(std::move(rank_of)),
        host_names_(std::move(host_names)),
        owner_pid_(getpid()) {
    TORCH_CHECK(local_in_ && local_out_ && cross_, "HierarchicalTransport: a leg's transport is None");
    hosts_ = static_cast<int64_t>(rank_of_.size());
    TORCH_CHECK(hosts_ >= 2, "HierarchicalTransport: needs ranks on at least two hosts, got ", hosts_);
    local_size_ = static_cast<int64_t>(rank_of_[0].size());
    TORCH_CHECK(local_size_ >= 2, "HierarchicalTransport: needs at least two ranks per host, got ", local_size_);
    host_ = local_ = -1;
    for (int64_t h = 0; h < hosts_; ++h) {
      TORCH_CHECK(static_cast<int64_t>(rank_of_[h].size()) == local_size_, "HierarchicalTransport: host ", h,
                  " has ", rank_of_[h].size(), " ranks, host 0 ", local_size_, "; every host needs the same number");
      for (int64_t l = 0; l < local_size_; ++l) {
        if (rank_of_[h][l] == rank_) host_ = h, local_ = l;
      }
    }
    TORCH_CHECK(host_ >= 0, "HierarchicalTransport: rank ", rank_, " is on no host of rank_of");
    TORCH_CHECK(static_cast<int64_t>(host_names_.size()) == hosts_, "HierarchicalTransport: ", host_names_.size(),
                " host names for ", hosts_, " hosts");
    TORCH_CHECK(local_in_->world_size() == local_size_ && local_in_->rank() == local_ &&
                    local_out_->world_size() == local_size_ && local_out_->rank() == local_,
                "HierarchicalTransport: the local transports are rank ", local_in_->rank(), "/", local_out_->rank(),
                " of ", local_in_->world_size(), ", expected rank ", local_, " of ", local_size_);
    TORCH_CHECK(cross_->world_size() == hosts_ && cross_->rank() == host_, "HierarchicalTransport: the cross-host ",
                "transport is rank ", cross_->rank(), " of ", cross_->world_size(), ", expected rank ", host_, " of ",
                hosts_, " (one rank per host, in host order)");
    identity_layout_ = true;  // rank_of[h][l] == l * H + h: shards are already in [local][host] order
    for (int64_t h = 0; h < hosts_; ++h)
      for (int64_t l = 0; l < local_size_; ++l) identity_layout_ &= rank_of_[h][l] == l * hosts_ + h;
    cross_issuer_ = std::thread([this] { issue_cross_loop(); });
    finisher_ = std::thread([this] { finish_loop(); });
  }

  ~HierarchicalTransport() override {
    if (getpid() != owner_pid_) {  // a forked child's copy: the threads are not its own
      cross_issuer_.detach();
      finisher_.detach();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (cross_issuer_.joinable()) cross_issuer_.join();
    if (finisher_.joinable()) finisher_.join();
  }

  Future all_reduce(at::Tensor piece, double scale) override {
    check_tensor("all_reduce", piece);
    auto job = std::make_shared<Job>();
    job->kind = Collective::kAllReduce;
    job->target = piece;
    const int64_t n = piece.numel();
    const int64_t c = (n + local_size_ - 1) / local_size_;
    // The reduce-scatter needs L equal shards: a tensor that does not
    // divide goes through a zero-padded copy (and back at the end).
    if (c * local_size_ == n) {
      job->work = piece.view(-1);
    } else {
      job->work = at::zeros({c * local_size_}, piece.options());
      job->work.narrow(0, 0, n).copy_(piece.view(-1));
    }
    job->mine = at::empty({c}, piece.options());
    job->first = local_in_->reduce_scatter(job->work, job->mine, scale);
    return submit(std::move(job));
  }

  Future reduce_scatter(at::Tensor input, at::Tensor output_shard, double scale) override {
    check_tensor("reduce_scatter", input);
    check_tensor("reduce_scatter", output_shard);
    const int64_t s = output_shard.numel();
    TORCH_CHECK(input.numel() == s * world_size(), "HierarchicalTransport.reduce_scatter: input has ", input.numel(),
                " elements, world_size (", world_size(), ") x output_shard (", s, ") expected");
    auto job = std::make_shared<Job>();
    job->kind = Collective::kReduceScatter;
    job->target = output_shard;
    at::Tensor flat = input.view(-1);
    if (identity_layout_) {
      job->work = flat;
    } else {  // shards in [local index][host] order: local rank l's part is stream l's H shards
      job->work = at::empty_like(flat);
      for (int64_t l = 0; l < local_size_; ++l)
        for (int64_t h = 0; h < hosts_; ++h)
          job->work.narrow(0, (l * hosts_ + h) * s, s).copy_(flat.narrow(0, rank_of_[h][l] * s, s));
    }
    job->mine = at::empty({hosts_ * s}, input.options());
    job->first = local_in_->reduce_scatter(job->work, job->mine, scale);
    return submit(std::move(job));
  }

  Future all_gather(at::Tensor shard, at::Tensor output) override {
    check_tensor("all_gather", shard);
    check_tensor("all_gather", output);
    TORCH_CHECK(output.numel() == shard.numel() * world_size(), "HierarchicalTransport.all_gather: output has ",
                output.numel(), " elements, world_size (", world_size(), ") x shard (", shard.numel(), ") expected");
    auto job = std::make_shared<Job>();
    job->kind = Collective::kAllGather;
    job->work = shard.view(-1);
    job->target = output;
    job->mine = at::empty({hosts_ * shard.numel()}, shard.options());
    return submit(std::move(job));
  }

  bool applies_scale() const override { return true; }  // the first leg (shared memory) scales as it copies
  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return hosts_ * local_size_; }
  // The cross-host leg is the link (a simulated one orders it).
  bool orders_by_priority() const override { return cross_->orders_by_priority(); }
  std::string name() const override { return "hierarchical(" + local_in_->name() + "+" + cross_->name() + ")"; }
  std::map<std::string, int64_t> stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return {{"collectives", collectives_}, {"cross_bytes", cross_bytes_}};
  }

 private:
  struct Job {
    Collective kind = Collective::kAllReduce;
    at::Tensor work;    // all-reduce: the (padded) tensor; reduce-scatter: the reordered input; all-gather: the shard
    at::Tensor mine;    // what this rank carries across: its 1/L (all-reduce), its stream's H shards
    at::Tensor target;  // the caller's tensor the result lands in
    Future first, cross;
    c10::intrusive_ptr<c10::ivalue::Future> done;
    int64_t number = 0;  // collectives started before this one
  };

  // An error's message without the C++ backtrace c10 appends.
  static std::string message_of(const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    return c10_error ? c10_error->what_without_backtrace() : e.what();
  }

  void check_tensor(const char* who, const at::Tensor& t) const {
    TORCH_CHECK(getpid() == owner_pid_, "HierarchicalTransport.", who, ": used in a forked child; the transport ",
                "belongs to the process that made it");
    TORCH_CHECK(t.defined() && t.is_contiguous() && t.device().is_cpu(), "HierarchicalTransport.", who,
                ": tensors must be contiguous CPU tensors");
  }

  Future submit(std::shared_ptr<Job> job) {
    job->done = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
    Future handle(job->done, {}, {}, job);  // the tensors stay with the caller's handle too
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job->number = collectives_++;
      to_cross_.push_back(job);
    }
    wake_.notify_all();
    return handle;
  }

  // Pops the next job of `queue` in order, or nullptr once stopping with none left.
  std::shared_ptr<Job> next(std::deque<std::shared_ptr<Job>>& queue) {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return stopping_ || !queue.empty(); });
    if (queue.empty()) return nullptr;
    auto job = queue.front();
    queue.pop_front();
    return job;
  }

  std::string describe_stream() const {
    std::ostringstream out;
    out << "the cross-host leg (stream " << local_ << ": local rank " << local_ << " of each host; this is "
        << host_names_[host_] << "; peers ";
    for (int64_t h = 0, listed = 0; h < hosts_; ++h) {
      if (h == host_) continue;
      out << (listed++ ? ", " : "") << host_names_[h];
    }
    out << ")";
    return out.str();
  }

  std::string failure(const Job& job, const std::string& leg, const std::string& what) const {
    std::ostringstream out;
    out << "HierarchicalTransport: " << collective_name(job.kind) << " #" << job.number << " failed on " << leg;
    if (leg.find("cross") != std::string::npos) {
      out << "; " << (hosts_ == 2 ? "unreachable host: " : "unreachable host among: ");
      for (int64_t h = 0, listed = 0; h < hosts_; ++h)
        if (h != host_) out << (listed++ ? ", " : "") << host_names_[h];
    }
    out << ": " << what;
    return out.str();
  }

  // The job fails with `message`. The first failure also aborts both local
  // legs, before this rank's caller can see the error and exit: the host's
  // other ranks may be waiting on this one in shared memory (the last leg
  // of an earlier collective), and would otherwise only learn that it left,
  // not that the cross leg lost a host.
  void fail(Job& job, const std::string& message) {
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken_why_.empty()) {
        broken_why_ = message;
        first = true;
      }
    }
    if (first) {
      local_in_->abort(message);
      local_out_->abort(message);
    }
    job.done->setError(std::make_exception_ptr(std::runtime_error(message)));
  }

  std::string broken() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return broken_why_;
  }

  // In call order: wait for the first leg, issue the cross leg.
  void issue_cross_loop() {
    while (auto job = next(to_cross_)) {
      std::string why = broken();
      if (why.empty()) {
        try {
          if (job->first.defined()) job->first.wait();
        } catch (const std::exception& e) {
          why = failure(*job, "the first leg (shared memory inside the host)", message_of(e));
        }
      } else {
        why = "HierarchicalTransport: an earlier collective failed: " + why;
      }
      if (why.empty()) {
        try {
          const int64_t bytes = static_cast<int64_t>(job->mine.nbytes());
          switch (job->kind) {
            case Collective::kAllReduce: job->cross = cross_->all_reduce(job->mine, 1.0); break;
            case Collective::kReduceScatter: job->cross = cross_->reduce_scatter(job->mine, job->target, 1.0); break;
            case Collective::kAllGather: job->cross = cross_->all_gather(job->work, job->mine); break;
          }
          std::lock_guard<std::mutex> lock(mutex_);
          cross_bytes_ += bytes;
        } catch (const std::exception& e) {
          why = failure(*job, describe_stream(), message_of(e));
        }
      }
      if (!why.empty()) fail(*job, why);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        to_finish_.push_back(std::move(job));
      }
      wake_.notify_all();
    }
    // Stopping: the finisher drains what is left.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      cross_done_ = true;
    }
    wake_.notify_all();
  }

  // In call order: wait for the cross leg, run the last leg, complete.
  void finish_loop() {
    while (true) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return cross_done_ || !to_finish_.empty(); });
        if (to_finish_.empty()) return;
        job = to_finish_.front();
        to_finish_.pop_front();
      }
      if (job->done->completed()) continue;  // failed before its cross leg
      try {
        job->cross.wait();
      } catch (const std::exception& e) {
        fail(*job, failure(*job, describe_stream(), message_of(e)));
        continue;
      }
      try {
        finish(*job);
      } catch (const std::exception& e) {
        fail(*job, failure(*job, "the last leg (shared memory inside the host)", message_of(e)));
        continue;
      }
      job->done->markCompleted(completion_time());
    }
  }

  void finish(Job& job) {
    switch (job.kind) {
      case Collective::kAllReduce: {
        local_out_->all_gather(job.mine, job.work).wait();
        if (job.work.data_ptr() != job.target.data_ptr())
          job.target.view(-1).copy_(job.work.narrow(0, 0, job.target.numel()));
        break;
      }
      case Collective::kReduceScatter: break;  // the cross leg wrote the output shard
      case Collective::kAllGather: {
        const int64_t s = job.work.numel();
        at::Tensor out = job.target.view(-1);
        std::vector<at::Tensor> inputs;
        std::vector<std::vector<at::Tensor>> outputs(static_cast<size_t>(local_size_));
        for (int64_t h = 0; h < hosts_; ++h) inputs.push_back(job.mine.narrow(0, h * s, s));
        for (int64_t l = 0; l < local_size_; ++l)
          for (int64_t h = 0; h < hosts_; ++h) outputs[l].push_back(out.narrow(0, rank_of_[h][l] * s, s));
        local_out_->all_gather_many(std::move(inputs), std::move(outputs)).wait();
        break;
      }
    }
  }

  std::shared_ptr<Transport> local_in_, local_out_, cross_;
  int64_t rank_;
  std::vector<std::vector<int64_t>> rank_of_;  // [host][local index] -> group rank
  std::vector<std::string> host_names_;        // for errors
  pid_t owner_pid_;
  int64_t hosts_ = 0, local_size_ = 0, host_ = 0, local_ = 0;
  bool identity_layout_ = false;

  mutable std::mutex mutex_;  // guards the queues, the counters and broken_why_
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> to_cross_;   // first leg issued, cross leg not yet
  std::deque<std::shared_ptr<Job>> to_finish_;  // cross leg issued (or failed), not completed
  bool stopping_ = false;
  bool cross_done_ = false;  // the cross issuer has exited
  std::string broken_why_;   // the first failure; every later job fails with it
  int64_t collectives_ = 0;
  int64_t cross_bytes_ = 0;  // bytes this rank handed to its stream (its share of what its host sends)
  std::thread cross_issuer_, finisher_;
};

}  // namespace

// Registered for pydist.transport.hierarchical (csrc/module.cpp).
std::shared_ptr<Transport> make_hierarchical_transport(std::shared_ptr<Transport> local_in,
                                                       std::shared_ptr<Transport> local_out,
                                                       std::shared_ptr<Transport> cross, int64_t rank,
                                                       std::vector<std::vector<int64_t>> rank_of,
                                                       std::vector<std::string> host_names) {
  return std::make_shared<HierarchicalTransport>(std::move(local_in), std::move(local_out), std::move(cross), rank,
                                                 std::move(rank_of), std::move(host_names));
}

}  // namespace transport
}  // namespace pydist
