// A simulated network link in front of any transport: every collective
// completes no earlier than an alpha-beta model of a cluster link allows.
// Registered as "sim_net":
//   pydist.transport.wrap("sim_net", inner, bandwidth=10e9, latency=20e-6)
//   (bandwidth in bits per second, latency in seconds; pydist.overlap.sim_net
//   parses "10Gbps,20us")
//
// [Note: simulated network]
// The collective still runs on `inner` (shared memory, gloo, mpi4py), so its
// result is bitwise what `inner` computes; only its completion is held back.
// For n ranks, a collective of `bytes` (the full-size tensor: the piece, the
// reduce-scatter input, the all-gather output; all_gather_many's stands for
// world_size x its inputs) takes, with the ring
// algorithms NCCL uses across nodes,
//
//   all-reduce                   2(n-1) latency + 2(n-1)/n bytes / bandwidth
//   reduce-scatter, all-gather    (n-1) latency +  (n-1)/n bytes / bandwidth
//
// (the busbw factors of nccl-tests). The link carries one collective at a
// time, in launch order, as one NCCL communicator's stream does: a
// collective's modelled transfer starts at max(its launch, the end of the
// previous one's), so pieces launched together queue behind each other
// instead of each getting the whole link. It completes at
//
//   max(end of its modelled transfer, when `inner` completed it)
//
// The caller is never blocked: the launch only notes the deadline, and a
// timer thread completes the future when it is due (or at once, when inner
// finishes after the deadline). The model starts each transfer at this
// rank's launch; `inner` cannot complete before every rank has launched, so
// a rank that launches late delays the others by at least its lateness,
// though not by the whole modelled time, as a real link would.
#include "transport/transport.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <queue>
#include <sstream>
#include <thread>
#include <unistd.h>

namespace pydist {
namespace transport {
namespace {

// Completes held futures when they are due, earliest first, on a thread of
// its own. Shared by the transport and the callbacks that hold completions,
// so a collective finishing after the transport is gone still completes.
// Belongs to the process that made it: a forked child's copy is never used
// nor destroyed (see ~SimNetTransport).
class Timer {
 public:
  ~Timer() { stop(); }

  // Completes `done` with its stamp at `due_ns` (steady clock), or now if
  // the timer has stopped.
  void hold(int64_t due_ns, c10::intrusive_ptr<c10::ivalue::Future> done, bool stamp) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!stopping_) {
        pending_.push(Pending{due_ns, std::move(done), stamp});
        if (!thread_) thread_ = std::make_unique<std::thread>([this] { run(); });  // the first hold starts it
        wake_.notify_all();
        return;
      }
    }
    done->markCompleted(stamp ? steady_now_ns() : int64_t{-1});
  }

  // Completes what is held when due, then ends the thread.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (!thread_ || !thread_->joinable()) return;
    if (thread_->get_id() == std::this_thread::get_id()) {
      thread_->detach();  // the last owner let go on the timer's own thread
    } else {
      thread_->join();
    }
  }

  pid_t owner_pid() const { return owner_pid_; }

 private:
  struct Pending {
    int64_t due_ns;
    c10::intrusive_ptr<c10::ivalue::Future> done;
    bool stamp;
    bool operator>(const Pending& other) const { return due_ns > other.due_ns; }
  };

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      if (pending_.empty()) {
        if (stopping_) return;
        wake_.wait(lock);
        continue;
      }
      const int64_t due = pending_.top().due_ns;
      if (steady_now_ns() < due) {
        wake_.wait_until(lock, std::chrono::steady_clock::time_point(std::chrono::nanoseconds(due)));
        continue;
      }
      Pending next = pending_.top();
      pending_.pop();
      lock.unlock();  // completion runs the future's callbacks
      next.done->markCompleted(next.stamp ? steady_now_ns() : int64_t{-1});
      lock.lock();
    }
  }

  const pid_t owner_pid_ = getpid();  // the process that made the timer
  std::mutex mutex_;                  // guards pending_, stopping_, thread_
  std::priority_queue<Pending, std::vector<Pending>, std::greater<Pending>> pending_;
  std::condition_variable wake_;  // a new due time, or stopping
  bool stopping_ = false;
  std::unique_ptr<std::thread> thread_;  // started by the first hold
};

class SimNetTransport : public WrappingTransport {
 public:
  // Requires bandwidth > 0 (bits/s) and latency >= 0 (s).
  SimNetTransport(std::shared_ptr<Transport> inner, double bandwidth_bps, double latency_s)
      : WrappingTransport(std::move(inner)), bandwidth_bps_(bandwidth_bps), latency_s_(latency_s) {
    TORCH_CHECK(bandwidth_bps_ > 0, "sim_net: bandwidth must be > 0 bits/s, got ", bandwidth_bps_);
    TORCH_CHECK(latency_s_ >= 0, "sim_net: latency must be >= 0 s, got ", latency_s_);
  }

  ~SimNetTransport() override {
    if (getpid() != timer_->owner_pid()) {
      // A forked child holds copies of the parent's timer: its thread is not
      // one the child can join, its mutex may have been copied locked, and
      // destroying a condition variable the parent's thread waited on hangs.
      // Leave the copy alone (a deliberate leak, once per fork).
      new std::shared_ptr<Timer>(timer_);
      return;
    }
    timer_->stop();
  }

  Future all_reduce(at::Tensor piece, double scale) override {
    return delayed(Collective::kAllReduce, piece.nbytes(), [&] { return WrappingTransport::all_reduce(piece, scale); });
  }
  Future all_reduce_bucket(at::Tensor piece, double scale, c10d::GradBucket& bucket) override {
    return delayed(Collective::kAllReduce, piece.nbytes(),
                   [&] { return WrappingTransport::all_reduce_bucket(piece, scale, bucket); });
  }
  Future reduce_scatter(at::Tensor input, at::Tensor output_shard, double scale) override {
    return delayed(Collective::kReduceScatter, input.nbytes(),
                   [&] { return WrappingTransport::reduce_scatter(input, output_shard, scale); });
  }
  Future all_gather(at::Tensor shard, at::Tensor output) override {
    return delayed(Collective::kAllGather, output.nbytes(),
                   [&] { return WrappingTransport::all_gather(shard, output); });
  }
  Future all_gather_many(std::vector<at::Tensor> inputs, std::vector<std::vector<at::Tensor>> outputs) override {
    return delayed(Collective::kAllGather, all_gather_many_bytes(inputs, world_size()),
                   [&] { return WrappingTransport::all_gather_many(std::move(inputs), std::move(outputs)); });
  }

  std::string name() const override { return "sim_net(" + inner_->name() + ")"; }

  // inner's counters, plus the model's settings and what it delayed:
  // sim_net_model_ns sums the modelled transfer times.
  std::map<std::string, int64_t> stats() const override {
    std::map<std::string, int64_t> out = inner_->stats();
    std::lock_guard<std::mutex> lock(mutex_);
    out["sim_net_calls"] = calls_;
    out["sim_net_model_ns"] = model_ns_;
    out["sim_net_bandwidth_bps"] = static_cast<int64_t>(bandwidth_bps_);
    out["sim_net_latency_ns"] = static_cast<int64_t>(latency_s_ * 1e9);
    return out;
  }

 private:
  // The alpha-beta time of one collective: see [Note: simulated network].
  int64_t model_ns(Collective kind, int64_t bytes) const {
    const int64_t n = world_size();
    if (n <= 1) return 0;
    const double steps = kind == Collective::kAllReduce ? 2.0 * (n - 1) : static_cast<double>(n - 1);
    const double seconds = steps * latency_s_ + steps / n * static_cast<double>(bytes) * 8.0 / bandwidth_bps_;
    return static_cast<int64_t>(seconds * 1e9 + 0.5);
  }

  // Launches the collective on inner (`launch_inner`) and returns a future
  // that completes at max(modelled end, inner's completion). The modelled
  // transfer starts when this is called, before inner sees the collective.
  template <typename Launch>
  Future delayed(Collective kind, size_t nbytes, Launch&& launch_inner) {
    TORCH_CHECK(getpid() == timer_->owner_pid(), "sim_net: this simulated link belongs to process ", timer_->owner_pid(),
                "; process ", getpid(), " was forked from it and cannot use it (make its own process group and ",
                "transport there)");
    const int64_t launch = steady_now_ns();
    const int64_t duration = model_ns(kind, static_cast<int64_t>(nbytes));
    int64_t due;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      due = std::max(launch, link_free_ns_) + duration;  // one transfer at a time on the link
      link_free_ns_ = due;
      ++calls_;
      model_ns_ += duration;
    }
    Future inner = launch_inner();
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
    const bool stamp = stamp_completion();
    // Runs on the thread that completes the inner collective: never blocks.
    inner.ivalue()->addCallback([timer = timer_, done, due, stamp](c10::ivalue::Future& finished) {
      if (finished.hasError()) {
        done->setError(finished.exception_ptr());
        return;
      }
      const int64_t now = steady_now_ns();
      if (now >= due) {
        done->markCompleted(stamp ? now : int64_t{-1});
      } else {
        timer->hold(due, done, stamp);
      }
    });
    // Waiting on the wrapped future first runs inner's bounded wait (a
    // process group's timeout; gloo's reduce-scatter completes only then).
    return Future(done, [inner] { inner.wait(); }, inner.inner());
  }

  const double bandwidth_bps_;
  const double latency_s_;
  const std::shared_ptr<Timer> timer_ = std::make_shared<Timer>();

  mutable std::mutex mutex_;  // guards the four below
  int64_t link_free_ns_ = 0;  // when the modelled link finishes the last transfer queued on it
  int64_t calls_ = 0;         // collectives delayed so far
  int64_t model_ns_ = 0;      // sum of their modelled transfer times
};

double option(const WrapperOptions& options, const char* key) {
  auto found = options.find(key);
  if (found == options.end()) {
    std::ostringstream given;
    for (const auto& entry : options) given << " '" << entry.first << "'";
    TORCH_CHECK(false, "pydist.transport.wrap('sim_net'): option '", key,
                "' is required (bandwidth in bits/s, latency in s); given:", given.str());
  }
  return found->second;
}

const bool registered = register_wrapper("sim_net", [](std::shared_ptr<Transport> inner, const WrapperOptions& options) {
  for (const auto& entry : options) {
    TORCH_CHECK(entry.first == "bandwidth" || entry.first == "latency", "pydist.transport.wrap('sim_net'): unknown option '",
                entry.first, "'; sim_net takes bandwidth (bits/s) and latency (s)");
  }
  return std::make_shared<SimNetTransport>(std::move(inner), option(options, "bandwidth"), option(options, "latency"));
});

}  // namespace
}  // namespace transport
}  // namespace pydist
