// Priority on a real link: a transport in front of any other that issues
// the collectives launched through it to `inner` in an order every rank
// agrees on, the most urgent first. Registered as "ordered":
//   pydist.transport.wrap("ordered", inner, inflight_bytes=0)
// DistributedDataParallel.overlap_optimizer puts it in front of a transport
// that does not order by priority itself (gloo, the mpi4py group, shared
// memory, the hierarchical transport without a simulated link).
//
// [Note: ordering a real link]
// The simulated link reorders only when transfers are modelled to finish
// ([Note: the link's queue] in sim_net_transport.cpp); a real transport
// (gloo, NCCL, mpi4py, shared memory) carries collectives in the order they
// were issued, and every rank must issue the same collectives in the same
// order. A rank deciding alone which queued collective goes next would
// decide from what it alone has launched and when its own last one
// finished, and ranks would issue different orders. So one rank decides for
// all: rank 0 of the transport (the leader) keeps the collectives launched
// and not yet issued, and whenever it has room it commits the most urgent
// (the highest priority its launching thread stated, see [Note: transfer
// priority] in transport.h; equal priorities in launch order) and tells the
// others which one, by sequence number, in a one-element all-reduce on
// `inner` itself (the leader contributes the number + 1, the others 0),
// issued just before the collective it names. Every rank numbers its
// launches 0, 1, 2, ... in launch order, which is the same on every rank,
// so a number names the same collective everywhere. A follower issues one
// such decision all-reduce whenever it has a launched collective still
// undecided, and issues the named collective once the decision arrives (at
// once if it has launched it, else when it does). Every rank thus issues
// the same sequence on `inner`: decision 0, collective, decision 1,
// collective, ..., and each collective is issued exactly once.
//
// Room: the leader commits while fewer than `inflight_bytes` bytes it
// committed are still running, and always when none is (the default, 0,
// commits one collective at a time: the most room to overtake, at the cost
// of the decision's round trip between collectives, one small all-reduce).
// So a front-layer chunk launched at the end of backward goes before the
// back-layer chunks still waiting, never before one already issued. A
// collective completes when `inner` completes it; its result is inner's,
// bitwise (only the order of issue changes, and each collective still runs
// alone on inner with its own tensors). Counters: ordered_commits,
// ordered_overtakes (commits ahead of a collective launched earlier).
//
// No thread of its own: launches, and the completions of inner's futures,
// drive it. Issuing happens outside the lock through one queue drained by
// whichever thread finds it idle, so an inner future that completes at once
// (its callback runs inline) cannot re-enter an issue in progress. A
// decision that fails (a peer gone: inner's own timeout or error) fails
// every collective still waiting here with inner's error.
//
// Only all-reduces go through it (the collectives DDP's buckets take; the
// others are refused): a collective whose inner future completes only when
// waited on (gloo's reduce-scatter) would hold the leader's next commit
// until someone waited on it, and all-reduces complete by themselves. The
// leader, going away, commits what is still waiting at once, so the
// others' launches are all decided. `inner` must carry nothing else while
// the wrapper lives: it issues collectives from completion callbacks, at
// moments of its own, and another user's collectives on the same group
// would fall between them in a different order on different ranks
// (overlap_optimizer gives it a gloo group of its own). Ranks must launch
// and wait alike (the
// same collectives, each rank waiting on the same ones before launching the
// same next ones), as every SPMD program does: a rank that waited on a
// collective the others launch more after could wait for one the leader
// ordered behind a collective that rank has not launched.
#include "transport/transport.h"

#include <c10/util/Exception.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace pydist {
namespace transport {
namespace {

// One all-reduce launched through the wrapper. The caller's handle holds it
// (its piece), so letting go of it here is only a count: see [Note: who
// lets go of a collective's tensors].
struct Op {
  int64_t seq = 0;
  int64_t priority = 0;
  at::Tensor piece;  // until issued
  int64_t bytes = 0;
  double scale = 1.0;
  c10::intrusive_ptr<c10::ivalue::Future> done;  // what the caller waits on

  // Set once it is issued (or failed before that), for the caller's bounded wait.
  std::mutex mutex;
  std::condition_variable changed;
  bool issued = false;
  bool failed = false;
  Future inner;
};

// The order's state, shared by the wrapper and the callbacks on inner's
// futures (so a collective completes after the wrapper is gone). It holds
// inner weakly: the wrapper alone owns it, so the last reference to a
// process group is never dropped on that group's own thread (a gloo
// worker running a callback), whose destructor would join itself.
class Order : public std::enable_shared_from_this<Order> {
 public:
  Order(const std::shared_ptr<Transport>& inner, int64_t cap)
      : inner_(inner), cap_(cap), leader_(inner->rank() == 0) {}

  void launch(const std::shared_ptr<Op>& op) {
    std::exception_ptr failed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      op->seq = next_seq_++;
      if (error_) {
        failed = error_;  // failed below, without the lock: the caller's callbacks run then
      } else if (leader_) {
        waiting_.emplace(op->seq, op);
        commit_locked(false);
      } else if (op->seq == decided_) {
        decided_ = -1;
        issue_locked(op);
        ask_locked();
      } else {
        waiting_.emplace(op->seq, op);
        ask_locked();
      }
    }
    if (failed) {
      fail(op, failed);
      return;
    }
    drain();
  }

  // The leader, going away: commits what still waits, so every rank's
  // launches are decided.
  void flush() {
    if (!leader_) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) commit_locked(true);
    }
    drain();
  }

  std::map<std::string, int64_t> counters() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {{"ordered_commits", commits_}, {"ordered_overtakes", overtakes_}, {"ordered_inflight_bytes", cap_}};
  }

 private:
  // mutex_ held. Leader: commits the most urgent waiting collectives while
  // there is room (all of them when `all`).
  void commit_locked(bool all) {
    while (!waiting_.empty() && (all || inflight_ops_ == 0 || inflight_bytes_ < cap_)) {
      auto best = waiting_.begin();
      for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
        if (it->second->priority > best->second->priority) best = it;  // equal: the earlier (map order)
      }
      if (best != waiting_.begin()) ++overtakes_;
      std::shared_ptr<Op> op = best->second;
      waiting_.erase(best);
      ++commits_;
      ++inflight_ops_;
      inflight_bytes_ += op->bytes;
      issues_.emplace_back([self = shared_from_this(), seq = op->seq] { self->decide(seq); });
      issue_locked(op);
    }
  }

  // mutex_ held. Follower: one decision all-reduce in flight while a
  // launched collective is undecided (none while a decided one is still to
  // be launched here).
  void ask_locked() {
    if (asking_ || decided_ >= 0 || waiting_.empty() || error_) return;
    asking_ = true;
    issues_.emplace_back([self = shared_from_this()] { self->decide(-1); });
  }

  // mutex_ held. Queues `op` for issue on inner.
  void issue_locked(const std::shared_ptr<Op>& op) {
    issues_.emplace_back([self = shared_from_this(), op] { self->issue(op); });
  }

  // Issues what is queued, in order, unless another thread is already doing so.
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (draining_) return;
    draining_ = true;
    while (!issues_.empty()) {
      std::function<void()> next = std::move(issues_.front());
      issues_.pop_front();
      lock.unlock();
      next();
      lock.lock();
    }
    draining_ = false;
  }

  // The decision all-reduce: the leader announces `seq` (-1: a follower asking).
  void decide(int64_t seq) {
    at::Tensor word = at::full({1}, static_cast<double>(seq + 1), at::kDouble);
    Future future;
    try {
      future = inner()->all_reduce(word, 1.0);
    } catch (...) {
      fail_all(std::current_exception());
      return;
    }
    future.ivalue()->addCallback([self = shared_from_this(), word](c10::ivalue::Future& finished) {
      if (finished.hasError()) {
        self->fail_all(finished.exception_ptr());
      } else if (!self->leader_) {
        self->decided(static_cast<int64_t>(word.item<double>()) - 1);
      }
    });
  }

  // Follower: the leader named collective `seq`.
  void decided(int64_t seq) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      asking_ = false;
      auto found = waiting_.find(seq);
      if (found != waiting_.end()) {
        issue_locked(found->second);
        waiting_.erase(found);
        ask_locked();
      } else {
        // Not launched here yet: issued at its launch, and only then the
        // next decision asked for, so that this rank issues the decided
        // collective where the leader did, before the next decision.
        decided_ = seq;
      }
    }
    drain();
  }

  void issue(const std::shared_ptr<Op>& op) {
    Future future;
    try {
      future = inner()->all_reduce(op->piece, op->scale);
    } catch (...) {
      fail_all(std::current_exception());
      fail(op, std::current_exception());
      return;
    }
    {
      std::lock_guard<std::mutex> lock(op->mutex);
      op->inner = future;
      op->issued = true;
      op->piece = at::Tensor();  // inner's handle and the caller's hold it now
    }
    op->changed.notify_all();
    future.ivalue()->addCallback([self = shared_from_this(), op](c10::ivalue::Future& finished) {
      self->finished(op, finished);
    });
  }

  // The leader commits what the completion made room for before the caller
  // learns of it: a caller that then lets go of the wrapper finds no
  // callback still issuing on inner.
  void finished(const std::shared_ptr<Op>& op, c10::ivalue::Future& inner) {
    if (leader_) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --inflight_ops_;
        inflight_bytes_ -= op->bytes;
        if (!error_) commit_locked(false);
      }
      drain();
    }
    if (inner.hasError()) {
      op->done->setError(inner.exception_ptr());
    } else {
      op->done->markCompleted(inner.value());
    }
  }

  void fail_all(std::exception_ptr error) {
    std::vector<std::shared_ptr<Op>> failing;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = error;
      for (auto& entry : waiting_) failing.push_back(entry.second);
      waiting_.clear();
    }
    for (const auto& op : failing) fail(op, error);
  }

  static void fail(const std::shared_ptr<Op>& op, std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(op->mutex);
      if (op->failed) return;
      op->failed = true;
      op->piece = at::Tensor();
    }
    op->changed.notify_all();
    if (!op->done->completed()) op->done->setError(error);
  }

  // inner, while the wrapper holds it; raises once the wrapper is gone.
  std::shared_ptr<Transport> inner() const {
    std::shared_ptr<Transport> inner = inner_.lock();
    TORCH_CHECK(inner, "ordered: the transport was destroyed before rank 0 decided this all-reduce's turn");
    return inner;
  }

  const std::weak_ptr<Transport> inner_;
  const int64_t cap_;   // inflight_bytes
  const bool leader_;   // rank 0 decides

  mutable std::mutex mutex_;  // guards everything below
  std::map<int64_t, std::shared_ptr<Op>> waiting_;  // launched, not issued, by seq
  std::deque<std::function<void()>> issues_;        // to issue on inner, in order
  bool draining_ = false;
  int64_t next_seq_ = 0;
  std::exception_ptr error_;                        // a failed decision: every later launch fails
  // The leader's:
  int64_t inflight_ops_ = 0;                        // committed, not completed
  int64_t inflight_bytes_ = 0;
  int64_t commits_ = 0;
  int64_t overtakes_ = 0;
  // A follower's:
  bool asking_ = false;                             // a decision all-reduce in flight
  int64_t decided_ = -1;                            // named by the leader, not launched here yet
};

class OrderedTransport : public WrappingTransport {
 public:
  OrderedTransport(std::shared_ptr<Transport> inner, int64_t inflight_bytes)
      : WrappingTransport(std::move(inner)), order_(std::make_shared<Order>(inner_, inflight_bytes)) {
    TORCH_CHECK(!inner_->owns_buckets(), "pydist.transport.wrap('ordered'): ", inner_->name(),
                " hands whole buckets to user code (a comm hook), which orders nothing");
  }

  ~OrderedTransport() override { order_->flush(); }

  // Queued with this thread's current_priority(); the returned future
  // completes when inner's does.
  Future all_reduce(at::Tensor piece, double scale) override {
    auto op = std::make_shared<Op>();
    op->priority = current_priority();
    op->piece = piece;
    op->bytes = static_cast<int64_t>(piece.nbytes());
    op->scale = scale;
    op->done = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
    order_->launch(op);
    // Waiting first waits until it is issued (or failed), then runs inner's
    // bounded wait (a process group's timeout).
    auto bounded_wait = [op] {
      Future inner;
      {
        std::unique_lock<std::mutex> lock(op->mutex);
        op->changed.wait(lock, [&] { return op->issued || op->failed; });
        if (!op->issued) return;
        inner = op->inner;
      }
      inner.wait();
    };
    return Future(op->done, std::move(bounded_wait), {}, std::make_shared<at::Tensor>(std::move(piece)));
  }
  Future all_reduce_bucket(at::Tensor piece, double scale, c10d::GradBucket& /*bucket*/) override {
    return all_reduce(std::move(piece), scale);  // inner owns no buckets (checked above)
  }
  // Only all-reduces are ordered: see [Note: ordering a real link].
  Future reduce_scatter(at::Tensor, at::Tensor, double) override { refuse("reduce_scatter"); }
  Future all_gather(at::Tensor, at::Tensor) override { refuse("all_gather"); }
  Future all_gather_many(std::vector<at::Tensor>, std::vector<std::vector<at::Tensor>>) override {
    refuse("all_gather_many");
  }

  bool orders_by_priority() const override { return true; }
  std::string name() const override { return "ordered(" + inner_->name() + ")"; }
  std::map<std::string, int64_t> stats() const override {
    std::map<std::string, int64_t> out = inner_->stats();
    for (const auto& entry : order_->counters()) out[entry.first] = entry.second;
    return out;
  }

 private:
  [[noreturn]] void refuse(const char* what) const {
    TORCH_CHECK(false, "ordered(", inner_->name(), ").", what, ": the ordered transport orders all-reduces only ",
                "(DistributedDataParallel's buckets); use ", inner_->name(), " itself");
  }

  std::shared_ptr<Order> order_;
};

const bool registered = register_wrapper("ordered", [](std::shared_ptr<Transport> inner, const WrapperOptions& options) {
  for (const auto& entry : options) {
    TORCH_CHECK(entry.first == "inflight_bytes", "pydist.transport.wrap('ordered'): unknown option '", entry.first,
                "'; ordered takes only inflight_bytes");
  }
  auto cap = options.find("inflight_bytes");
  const double inflight = cap == options.end() ? 0.0 : cap->second;
  TORCH_CHECK(inflight >= 0 && inflight == static_cast<double>(static_cast<int64_t>(inflight)),
              "pydist.transport.wrap('ordered'): inflight_bytes must be a whole number >= 0, got ", inflight);
  return std::make_shared<OrderedTransport>(std::move(inner), static_cast<int64_t>(inflight));
});

}  // namespace
}  // namespace transport
}  // namespace pydist
