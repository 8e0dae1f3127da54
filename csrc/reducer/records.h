// What the reducer measured: per chunk (one collective each), per bucket and
// per iteration, for the last K iterations. Header-only: the reducer fills
// these under its mutex, Python reads copies (pydist/ddp/records.py).
//
// [Note: record clocks]
// Every stamp is taken on the steady clock (std::chrono::steady_clock, which
// is CLOCK_MONOTONIC on Linux: the clock of Python's time.monotonic_ns()),
// the clock transports stamp completions on (transport::steady_now_ns).
// An IterationRecord keeps the absolute time it began (`start_ns`, when the
// reducer was armed by prepare_for_backward); every other time in it is in
// ns since then, -1 where the event did not happen. torch.profiler stamps its
// events on another clock: c10::getApproximateTime (the TSC where there is
// one) converted to c10::getTime(), which is CLOCK_REALTIME (ns since the
// Unix epoch). So profiler_clock_offset_ns() measures REALTIME - MONOTONIC;
// steady + offset is the time a profiler event at the same instant carries
// (kineto's start_ns(); a Chrome trace's `ts` is that minus the trace's
// baseTimeNanoseconds, in µs). The offset changes only when the wall clock
// is stepped (NTP), so it is measured when asked for, not cached.
// With records off the reducer and its transport read no clock at all.
#pragma once

#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace pydist {

// How many iterations the reducer keeps records of unless told otherwise.
constexpr int64_t kDefaultRecordsKept = 8;

// One collective of a bucket, in the order it was launched.
struct ChunkRecord {
  int64_t offset = 0;  // first element of the chunk in its bucket
  int64_t bytes = 0;
  transport::Collective collective = transport::Collective::kAllReduce;
  int64_t launch_ns = -1;    // just before the collective was handed to the transport
  int64_t complete_ns = -1;  // it finished, stamped by the thread that finished it (see BucketRecord)
};

// One bucket in one iteration.
struct BucketRecord {
  int64_t index = 0;
  int64_t num_params = 0;
  int64_t bytes = 0;
  int64_t first_grad_ns = -1;  // first of its gradients became ready
  int64_t last_grad_ns = -1;   // its last gradient became ready
  int64_t launch_ns = -1;      // its first chunk's collective (or its comm hook) was launched
  // Its last collective finished, stamped by the thread that completed it.
  // NCCL marks its futures complete once the kernels are enqueued (streams
  // then order the rest), so on CUDA this is the enqueue, not the finish.
  int64_t complete_ns = -1;
  int64_t done_ns = -1;        // finalize_backward had waited for it and written its grads back
  std::vector<ChunkRecord> chunks;
  // Per parameter, in buffer order: which one (its index among the
  // reducer's parameters) and when its gradient became ready (-1: not this
  // iteration). What the overlap lab's predictor re-buckets at another cap.
  std::vector<int64_t> param_indices;
  std::vector<int64_t> grad_ns;
};

// One reduced iteration.
struct IterationRecord {
  int64_t iteration = -1;       // count of reduced iterations, from 0
  int64_t rank = -1;            // of the reducer's group
  std::string transport;        // Transport::name() of what carried the chunks
  int64_t start_ns = -1;        // absolute steady-clock time the reducer was armed: [Note: record clocks]
  int64_t backward_end_ns = -1; // autograd finished (finalize_backward began)
  int64_t finalize_end_ns = -1; // all results written back into .grad
  std::vector<BucketRecord> buckets;
};

// The last `keep` IterationRecords, oldest first.
class RecordRing {
 public:
  explicit RecordRing(int64_t keep = kDefaultRecordsKept) { set_keep(keep); }

  // Keeps at most `keep` (>= 1) records from now on, dropping the oldest.
  void set_keep(int64_t keep) {
    TORCH_CHECK(keep >= 1, "set_record_timing: keep must be at least 1 (the number of iterations to keep), got ",
                keep);
    keep_ = static_cast<size_t>(keep);
    while (records_.size() > keep_) records_.pop_front();
  }
  int64_t keep() const { return static_cast<int64_t>(keep_); }

  void push(IterationRecord record) {
    records_.push_back(std::move(record));
    while (records_.size() > keep_) records_.pop_front();
  }
  std::vector<IterationRecord> all() const { return {records_.begin(), records_.end()}; }
  // The newest, or a record with iteration -1 when there is none.
  IterationRecord last() const { return records_.empty() ? IterationRecord{} : records_.back(); }
  void clear() { records_.clear(); }

 private:
  size_t keep_ = 0;
  std::deque<IterationRecord> records_;
};

// The name Python records use for a collective: "all_reduce",
// "reduce_scatter", "all_gather".
inline const char* record_name(transport::Collective kind) {
  switch (kind) {
    case transport::Collective::kAllReduce: return "all_reduce";
    case transport::Collective::kReduceScatter: return "reduce_scatter";
    case transport::Collective::kAllGather: return "all_gather";
  }
  return "collective";
}

// Nanoseconds to add to a steady-clock time to get torch.profiler's clock:
// see [Note: record clocks]. Reads the two clocks in turn many times and
// keeps the pair read closest together (the error is at most half that
// read's span, typically well under a microsecond).
inline int64_t profiler_clock_offset_ns() {
  int64_t best_span = std::numeric_limits<int64_t>::max();
  int64_t offset = 0;
  for (int i = 0; i < 101; ++i) {
    const int64_t before = transport::steady_now_ns();
    const int64_t profiler = c10::getTime();
    const int64_t after = transport::steady_now_ns();
    if (after - before < best_span) {
      best_span = after - before;
      offset = profiler - (before + (after - before) / 2);
    }
  }
  return offset;
}

}  // namespace pydist
