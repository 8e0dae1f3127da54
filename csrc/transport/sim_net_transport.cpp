// A simulated network link in front of any transport: every collective
// completes no earlier than an alpha-beta model of a cluster link allows.
// Registered as "sim_net":
//   pydist.transport.wrap("sim_net", inner, bandwidth=10e9, latency=20e-6)
//   (bandwidth in bits per second, latency in seconds; pydist.overlap.sim_net
//   parses "10Gbps,20us"; optional inflight_bytes: see [Note: the link's queue])
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
// The caller is never blocked: the launch only queues the transfer, and a
// timer thread completes the future when it is due (or at once, when inner
// finishes after the deadline).
//
// [Note: the link's queue]
// The link is the one place that decides the order of transfers (see
// [Note: transfer priority] in transport.h). A launched transfer waits in
// the link's queue until it is committed; committed transfers go over the
// link one at a time, first committed first, each starting at max(its
// launch, the end of the previous committed one). A transfer is committed
// while fewer than `inflight_bytes` bytes are committed and not yet through
// (none at all: the default, 0, commits one transfer at a time), and among
// those waiting the link commits the highest priority first (the priority
// its launching thread stated), equal priorities in launch order. So a
// transfer launched later with a higher priority overtakes the waiting ones
// launched before it (counted in sim_net_overtakes), but never one already
// committed: the cap on bytes in flight is how far ahead the link commits,
// ByteScheduler's credit. With every priority equal this is exactly the
// first-in-first-out link above, whatever the cap. Only the modelled
// completion is reordered: inner still runs every collective in launch
// order, the same on every rank, so results are unchanged. The model starts each transfer at this
// rank's launch; `inner` cannot complete before every rank has launched, so
// a rank that launches late delays the others by at least its lateness,
// though not by the whole modelled time, as a real link would.
#include "transport/transport.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
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

  // Runs `action` on the timer's thread at `due_ns`. Returns false, running
  // nothing, when the timer has stopped.
  bool at(int64_t due_ns, std::function<void()> action) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return false;
    pending_.push(Pending{due_ns, {}, false, std::move(action)});
    if (!thread_) thread_ = std::make_unique<std::thread>([this] { run(); });
    wake_.notify_all();
    return true;
  }

  pid_t owner_pid() const { return owner_pid_; }

 private:
  struct Pending {
    int64_t due_ns;
    c10::intrusive_ptr<c10::ivalue::Future> done;  // completed when due, or:
    bool stamp;
    std::function<void()> action;                   // run when due
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
      lock.unlock();  // completion runs the future's callbacks; an action takes the link's lock
      if (next.action) {
        next.action();
      } else {
        next.done->markCompleted(next.stamp ? steady_now_ns() : int64_t{-1});
      }
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

// One collective on the link: queued until committed (see [Note: the link's
// queue]), completed at max(its modelled end, inner's completion).
struct Transfer {
  int64_t priority;     // the launching thread's current_priority()
  int64_t seq;          // launch order on this link
  int64_t launch_ns;
  int64_t duration_ns;  // its alpha-beta time
  int64_t bytes;
  c10::intrusive_ptr<c10::ivalue::Future> done;
  bool stamp;
  // Guarded by Link::mutex_.
  int64_t due_ns = -1;       // its modelled end, once committed
  bool inner_done = false;   // inner completed it (or failed: `done` already holds the error)
  bool completed = false;    // `done` completed or holds inner's error, or handed to the timer
};

// The link's queue and the transfers committed to it. Shared (like the
// Timer) with the callbacks and timer actions that outlive a transport.
class Link : public std::enable_shared_from_this<Link> {
 public:
  Link(std::shared_ptr<Timer> timer, int64_t inflight_bytes) : timer_(std::move(timer)), cap_(inflight_bytes) {}

  // Queues a transfer (launched now) and commits what the cap allows.
  std::shared_ptr<Transfer> launch(int64_t priority, int64_t duration_ns, int64_t bytes,
                                   c10::intrusive_ptr<c10::ivalue::Future> done, bool stamp) {
    auto transfer = std::make_shared<Transfer>(
        Transfer{priority, 0, steady_now_ns(), duration_ns, bytes, std::move(done), stamp});
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      transfer->seq = next_seq_++;
      waiting_.push_back(transfer);
      advance_locked(transfer->launch_ns, actions);
    }
    run(actions);
    return transfer;
  }

  // inner completed `transfer` (or failed: `error` set).
  void inner_finished(const std::shared_ptr<Transfer>& transfer, std::exception_ptr error) {
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      transfer->inner_done = true;
      if (error) {
        transfer->completed = true;  // the error is set below; the link still carries its bytes
        actions.failed.emplace_back(transfer, error);
      } else if (transfer->due_ns >= 0) {
        complete_when_due(transfer, steady_now_ns(), actions);
      }
    }
    run(actions);
  }

  int64_t overtakes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return overtakes_;
  }

 private:
  struct Actions {
    std::vector<std::shared_ptr<Transfer>> now;                 // complete at once
    std::vector<std::shared_ptr<Transfer>> later;               // hand to the timer at their due
    std::vector<std::pair<std::shared_ptr<Transfer>, std::exception_ptr>> failed;
    int64_t wake_ns = -1;                                       // commit more then
  };

  // mutex_ held. Commits waiting transfers, in model time, up to `now`.
  void advance_locked(int64_t now, Actions& actions) {
    while (!waiting_.empty()) {
      // When the link has room: committed bytes not yet through fall below
      // the cap (or none are left), walking the committed ends in order.
      int64_t room_ns = std::numeric_limits<int64_t>::min();
      int64_t ahead = committed_bytes_;
      for (const auto& [due, bytes] : committed_) {
        if (ahead == 0 || ahead < cap_) break;
        ahead -= bytes;
        room_ns = due;
      }
      int64_t first_launch = std::numeric_limits<int64_t>::max();
      for (const auto& w : waiting_) first_launch = std::min(first_launch, w->launch_ns);
      const int64_t t = std::max(room_ns, first_launch);
      if (t > now) {
        actions.wake_ns = t;
        return;
      }
      // The most urgent transfer launched by then; equal priorities in launch order.
      size_t best = waiting_.size();
      for (size_t i = 0; i < waiting_.size(); ++i) {
        const Transfer& w = *waiting_[i];
        if (w.launch_ns > t) continue;
        if (best == waiting_.size() || w.priority > waiting_[best]->priority ||
            (w.priority == waiting_[best]->priority && w.seq < waiting_[best]->seq)) {
          best = i;
        }
      }
      std::shared_ptr<Transfer> next = waiting_[best];
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(best));
      for (const auto& w : waiting_) {
        if (w->seq < next->seq) {
          ++overtakes_;
          break;
        }
      }
      while (!committed_.empty() && committed_.front().first <= t) {
        committed_bytes_ -= committed_.front().second;
        committed_.pop_front();
      }
      const int64_t due = std::max(next->launch_ns, link_free_ns_) + next->duration_ns;
      link_free_ns_ = due;
      committed_.emplace_back(due, next->bytes);
      committed_bytes_ += next->bytes;
      next->due_ns = due;
      if (next->inner_done) complete_when_due(next, now, actions);
    }
  }

  // mutex_ held; `transfer` committed and done by inner.
  static void complete_when_due(const std::shared_ptr<Transfer>& transfer, int64_t now, Actions& actions) {
    if (transfer->completed) return;
    transfer->completed = true;
    (transfer->due_ns <= now ? actions.now : actions.later).push_back(transfer);
  }

  // Without mutex_: completion runs the futures' callbacks, and the timer may
  // run an action at once.
  void run(Actions& actions) {
    for (auto& [transfer, error] : actions.failed) transfer->done->setError(error);
    for (const auto& transfer : actions.now) {
      transfer->done->markCompleted(transfer->stamp ? steady_now_ns() : int64_t{-1});
    }
    for (const auto& transfer : actions.later) timer_->hold(transfer->due_ns, transfer->done, transfer->stamp);
    if (actions.wake_ns < 0) return;
    std::weak_ptr<Link> self = weak_from_this();
    const bool queued = timer_->at(actions.wake_ns, [self] {
      if (auto link = self.lock()) link->wake();
    });
    if (!queued) drain();
  }

  void wake() {
    Actions actions;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      advance_locked(steady_now_ns(), actions);
    }
    run(actions);
  }

  // The timer has stopped (the transport is going): commit everything now.
  void drain() {
    std::vector<std::shared_ptr<Transfer>> now;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& w : waiting_) {
        w->due_ns = 0;
        if (w->inner_done && !w->completed) {
          w->completed = true;
          now.push_back(w);
        }
      }
      waiting_.clear();
    }
    for (const auto& transfer : now) transfer->done->markCompleted(transfer->stamp ? steady_now_ns() : int64_t{-1});
  }

  const std::shared_ptr<Timer> timer_;
  const int64_t cap_;  // inflight_bytes

  mutable std::mutex mutex_;  // guards everything below, and the Transfers' guarded fields
  std::vector<std::shared_ptr<Transfer>> waiting_;        // launched, not committed
  std::deque<std::pair<int64_t, int64_t>> committed_;     // (modelled end, bytes), in commit order
  int64_t committed_bytes_ = 0;                           // their bytes
  int64_t link_free_ns_ = 0;  // when the link finishes the last committed transfer
  int64_t next_seq_ = 0;
  int64_t overtakes_ = 0;     // commits ahead of a transfer launched earlier
};

class SimNetTransport : public WrappingTransport {
 public:
  // Requires bandwidth > 0 (bits/s), latency >= 0 (s), inflight_bytes >= 0.
  SimNetTransport(std::shared_ptr<Transport> inner, double bandwidth_bps, double latency_s, int64_t inflight_bytes)
      : WrappingTransport(std::move(inner)),
        bandwidth_bps_(bandwidth_bps),
        latency_s_(latency_s),
        inflight_bytes_(inflight_bytes) {
    TORCH_CHECK(bandwidth_bps_ > 0, "sim_net: bandwidth must be > 0 bits/s, got ", bandwidth_bps_);
    TORCH_CHECK(latency_s_ >= 0, "sim_net: latency must be >= 0 s, got ", latency_s_);
    TORCH_CHECK(inflight_bytes_ >= 0, "sim_net: inflight_bytes must be >= 0, got ", inflight_bytes_);
    link_ = std::make_shared<Link>(timer_, inflight_bytes_);
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

  bool orders_by_priority() const override { return true; }
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
    out["sim_net_inflight_bytes"] = inflight_bytes_;
    out["sim_net_overtakes"] = link_->overtakes();
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
  // that completes at max(modelled end, inner's completion). The transfer
  // joins the link's queue when this is called, before inner sees the
  // collective, with this thread's current_priority().
  template <typename Launch>
  Future delayed(Collective kind, size_t nbytes, Launch&& launch_inner) {
    TORCH_CHECK(getpid() == timer_->owner_pid(), "sim_net: this simulated link belongs to process ", timer_->owner_pid(),
                "; process ", getpid(), " was forked from it and cannot use it (make its own process group and ",
                "transport there)");
    const int64_t duration = model_ns(kind, static_cast<int64_t>(nbytes));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++calls_;
      model_ns_ += duration;
    }
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
    std::shared_ptr<Transfer> transfer = link_->launch(transport::current_priority(), duration,
                                                       static_cast<int64_t>(nbytes), done, stamp_completion());
    Future inner = launch_inner();
    // Runs on the thread that completes the inner collective: never blocks.
    inner.ivalue()->addCallback([link = link_, transfer](c10::ivalue::Future& finished) {
      link->inner_finished(transfer, finished.hasError() ? finished.exception_ptr() : std::exception_ptr());
    });
    // Waiting on the wrapped future first runs inner's bounded wait (a
    // process group's timeout; gloo's reduce-scatter completes only then).
    return Future(done, [inner] { inner.wait(); }, inner.inner());
  }

  const double bandwidth_bps_;
  const double latency_s_;
  const int64_t inflight_bytes_;
  const std::shared_ptr<Timer> timer_ = std::make_shared<Timer>();
  std::shared_ptr<Link> link_;  // the queue: [Note: the link's queue]

  mutable std::mutex mutex_;  // guards the two below
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
    TORCH_CHECK(entry.first == "bandwidth" || entry.first == "latency" || entry.first == "inflight_bytes",
                "pydist.transport.wrap('sim_net'): unknown option '", entry.first,
                "'; sim_net takes bandwidth (bits/s), latency (s) and optionally inflight_bytes");
  }
  auto cap = options.find("inflight_bytes");
  const double inflight = cap == options.end() ? 0.0 : cap->second;
  TORCH_CHECK(inflight >= 0 && inflight == static_cast<double>(static_cast<int64_t>(inflight)),
              "pydist.transport.wrap('sim_net'): inflight_bytes must be a whole number >= 0, got ", inflight);
  return std::make_shared<SimNetTransport>(std::move(inner), option(options, "bandwidth"), option(options, "latency"),
                                           static_cast<int64_t>(inflight));
});

}  // namespace
}  // namespace transport
}  // namespace pydist
