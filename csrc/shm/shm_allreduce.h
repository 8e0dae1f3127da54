// All-reduce through shared memory, for groups whose ranks all live on one
// host: what the reducer uses on CPU instead of the process group's
// all-reduce, where every rank can map the same segment.
//
// [Note: shared-memory all-reduce]
// Gloo moves CPU tensors between processes on one host through loopback TCP:
// every byte is copied into the kernel by the sender and out of it by the
// receiver, and most of a gloo all-reduce's CPU time is that kernel work
// (benchmarks/RESULTS.md). Here the ranks map one segment and copy through
// it directly. A tensor is processed in pieces of kPieceBytes; each piece is
// split into n slices, slice q reduced by rank q. Per piece k, rank r:
//
//   stage(k)    copies each slice q != r of its tensor, times `scale`, into
//               region q of its own staging set (k & 1), then raises
//               staged[r] to k;
//   reduce(k)   once every peer's staged >= k, sums its own slice in rank
//               order, x_0*s + x_1*s + ... (its own term from its tensor,
//               the others from their staging), writes the sum into its
//               tensor and publishes it into region r of its set, then
//               raises reduced[r] to k;
//   collect(k)  once every peer's reduced >= k, copies each peer q's
//               published slice into slice q of its tensor.
//
// Each element is reduced by one rank and copied to the others, so every
// rank ends with the same bits. The scale is applied to each term before the
// sum, as torch's DDP pre-divides gradients, so for two ranks the result is
// bitwise torch's (a two-term sum is the same in any order); with more ranks
// the order differs from gloo's ring at rounding level.
//
// Two staging sets, used in turn, are enough: rank r writes set k & 1 again
// at piece k + 2, and before that it has seen every peer's reduced(k + 1)
// (so their reads of its staging for k are done) and staged(k + 2) (so their
// collect(k) of its published slice is done).
//
// Waiting spins briefly, then sleeps on a futex in the segment. A wait gives
// up with an error naming the peer after the group's timeout, at once when
// that peer's process has exited, when it has dropped its end of the
// transport, or when it hit an error itself (it marks the segment aborted).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace pydist {

// Bytes of a tensor reduced per step of the protocol: small enough that a
// piece and the peers' staging stay in the caches between the three passes.
constexpr int64_t kShmPieceBytes = int64_t{1} << 20;

struct ShmSegment;  // the mapped layout; shm_allreduce.cpp

class ShmAllreduce {
 public:
  // Maps the POSIX shared-memory object `name` for group rank `rank` of
  // `world_size`. Rank 0 passes create=true and creates it (it must not
  // exist); the others open it once rank 0 has (the Python side orders this:
  // pydist/ddp/shm_transport.py). Starts this rank's worker thread. Waits
  // give up after `timeout`. Raises if the object cannot be created, opened
  // or mapped, or holds another layout.
  ShmAllreduce(std::string name, int64_t rank, int64_t world_size, bool create, std::chrono::milliseconds timeout);

  // Marks this rank as gone (a peer still waiting on it fails at once),
  // fails work not yet started, joins the worker and unmaps.
  ~ShmAllreduce();

  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  // Removes the name from the file system; the memory lives on until the
  // last rank unmaps it. Rank 0 calls it once every rank has mapped.
  void unlink();

  // Queues an all-reduce of `tensor` in place: afterwards every rank holds
  // sum over ranks of (its tensor × scale). Returns a future the worker
  // completes (with None) once `tensor` holds the result, or sets to the
  // error; it lets go of `tensor` before that. Every rank must queue the same
  // sequence of calls with the same numels and dtypes. Requires a contiguous
  // CPU tensor of a dtype supports() accepts.
  c10::intrusive_ptr<c10::ivalue::Future> allreduce(at::Tensor tensor, double scale);

  // Whether allreduce takes this dtype (float32, float64, bfloat16, float16).
  static bool supports(at::ScalarType dtype);

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  const std::string& name() const { return name_; }

 private:
  struct Job {
    at::Tensor tensor;
    double scale = 1.0;
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };

  // --- the worker thread: one job at a time, in queue order ---
  void work_loop();
  void run_job(const Job& job);
  template <typename T, typename Scale>
  void run_pieces(T* data, int64_t numel, Scale scale);

  // --- synchronization through the segment ---
  // The two counters each rank raises once per piece (see the note).
  enum class Phase { kStaged, kReduced };
  uint32_t* counter(int64_t rank, Phase phase) const;
  // Raises this rank's counter to `piece` and wakes peers sleeping on it.
  void publish(Phase phase, uint32_t piece);
  // Returns once every peer's counter has reached `piece`; throws naming the
  // peer when one cannot get there (see the note).
  void wait_for_peers(Phase phase, uint32_t piece);
  void check_peer(int64_t peer, Phase phase, uint32_t piece, std::chrono::steady_clock::time_point deadline) const;
  // Where rank `owner` keeps region `region` of staging set `set`.
  template <typename T>
  T* region(int64_t owner, uint32_t set, int64_t region) const;

  std::string name_;
  int64_t rank_;
  int64_t world_size_;
  std::chrono::milliseconds timeout_;
  void* base_ = nullptr;  // the mapping, of mapped_bytes_
  size_t mapped_bytes_ = 0;
  std::unique_ptr<ShmSegment> segment_;  // views of base_
  uint32_t pieces_done_ = 0;  // pieces this rank has run; the k of the protocol

  // Jobs from allreduce() to the worker.
  std::mutex mutex_;
  std::condition_variable wake_worker_;
  std::deque<Job> queue_;
  std::atomic<bool> stopping_{false};  // set by the destructor; waits give up
  bool broken_ = false;     // a job failed: every later one fails too (peers are out of step)
  std::string broken_why_;  // the first failure, repeated to later jobs
  std::thread worker_;
};

}  // namespace pydist
