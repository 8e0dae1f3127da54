// Collectives through shared memory, for groups whose ranks all live on one
// host: the transport DDP uses on CPU instead of the process group, where
// every rank can map the same segment (pydist.transport.open_shm decides).
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
// Reduce-scatter and all-gather over contiguous per-rank shards are the two
// halves of this. reduce_scatter: the slices are the shards (a step covers
// one region's worth of each), stage and reduce as above with the sum going
// into the output shard; then reduced[r] is raised and awaited with nothing
// to collect. all_gather: each rank publishes its shard's step into region r
// and raises staged[r]; once all have, it collects every peer's region and
// raises reduced[r]. Every step of every collective ends with every peer's
// reduced >= k, so the reuse argument below holds across a mix of them.
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
// that peer's process has exited (a zombie counts as exited: kill(pid, 0)
// succeeds on one, so its state in /proc is read too), when it has dropped
// its end of the transport, or when it hit an error itself (it marks the
// segment aborted).
//
// [Note: buckets in shared memory]
// The protocol above copies every byte it reduces three times: into the
// staging, into the published region, out of it. A buffer the peers can map
// needs none of that. empty_buffer() gives such buffers (a memfd each,
// mapped shared; the reducer makes its buckets with it, and since gradients
// stay resident in their buckets ([Note: resident gradients] in
// csrc/reducer/reducer.h) autograd accumulates straight into them). An
// all_reduce whose piece lies in one of them on every rank runs in place:
//
//   announce    the rank writes where its piece lies (buffer id, its fd,
//               byte offset) with the collective's description and raises
//               staged[r] to k: its piece is final;
//   reduce      once every peer's staged >= k, it maps each peer's buffer
//               (the first time it sees it: /proc/<pid>/fd/<fd>), sums its
//               slice r of every rank's piece, x_0*s + x_1*s + ..., in rank
//               order, and writes the sum into slice r of every rank's
//               piece; then finish_step (reduced[r] = k, waits for the peers').
//
// One read and one write of each byte per rank, and two waits per piece
// however large, instead of two per kShmPieceBytes. The sums are those of
// the copying protocol, term by term, so the results are bitwise the same.
// Whether a peer's buffer can be mapped (the ranks share a pid namespace and
// may open each other's fds) is found out once, at the first such piece:
// every rank tries, says whether it could in its block, and after a
// finish_step all take the same path; if any could not, every later piece is
// copied. A piece outside the buffers on any rank (a tensor of the caller's,
// join's zeros) is copied as before, after the announcement. A peer keeps a
// rank's buffers mapped until that rank frees one (it counts its frees in
// its block), then maps afresh the ones it still meets. A process forked from
// a rank shares these buffers with it (they are shared memory) and must not
// write into the gradients.
//
// [Note: the segment's name lives only while ranks attach]
// A named segment outlives every process that maps it until someone unlinks
// the name, so the name must go on every path, including a rank killed
// between rank 0 creating the segment and the last rank mapping it:
//   - each rank counts itself into the header as it maps; the one that
//     brings the count to world_size unlinks the name (so a rank 0 killed
//     right after creating leaves nothing once the others have mapped);
//   - rank 0 unlinks it when the set-up fails or is interrupted (Python's
//     `finally` in pydist/transport/shm_segment.py), and its end unlinks it on
//     destruction if that has not happened;
//   - what no rank survives to unlink (rank 0 killed and a peer killed
//     before mapping) is swept by the next set-up on the host: names carry
//     the creator's pid namespace and pid, and a name whose creator has
//     exited in this namespace is removed (shm_transport.sweep_stale_segments).
//
// [Note: forked children]
// A process forked from a rank (a DataLoader worker, a subprocess launched
// with fork) inherits a copy of the transport object but not its worker
// thread, and perhaps a copy of its mutex taken mid-operation. Such a child
// owns nothing: its copy refuses work, and its destructor neither joins the
// thread nor touches the segment's shared state (the parent rank is still
// attached); it only drops its own mapping.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/types.h>

#include "transport/transport.h"

namespace pydist {

// Bytes of a tensor reduced per step of the protocol: small enough that a
// piece and the peers' staging stay in the caches between the three passes.
constexpr int64_t kShmPieceBytes = int64_t{1} << 20;

struct ShmSegment;  // the mapped layout; shm_transport.cpp
struct ShmBuffers;  // this rank's empty_buffer() buffers; shm_transport.cpp

class ShmTransport : public transport::Transport {
 public:
  // Maps the POSIX shared-memory object `name` for group rank `rank` of
  // `world_size`. Rank 0 passes create=true and creates it (it must not
  // exist); the others open it once rank 0 has (the Python side orders this:
  // pydist.transport.open_shm). Starts this rank's worker thread. Waits
  // give up after `timeout`. Raises if the object cannot be created, opened
  // or mapped, or holds another layout.
  ShmTransport(std::string name, int64_t rank, int64_t world_size, bool create, std::chrono::milliseconds timeout);

  // Marks this rank as gone (a peer still waiting on it fails at once),
  // fails work not yet started, joins the worker and unmaps; rank 0
  // unlinks the name if nobody has. In a forked child only unmaps: see
  // [Note: forked children].
  ~ShmTransport() override;

  // What the destructor does but the unmapping, now: marks this rank as
  // gone, fails work not yet started and joins the worker; every later
  // collective here raises. For the exit, while other references may still
  // hold this end (pydist.transport.shm_segment.close_all). Idempotent; a
  // no-op in a forked child.
  void shut_down();

  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // Removes the name from the file system; the memory lives on until the
  // last rank unmaps it. Rank 0 calls it once every rank has mapped, or when
  // the set-up fails; the last rank to map calls it itself. Idempotent.
  // See [Note: the segment's name lives only while ranks attach].
  void unlink();

  // Queue the collective of [Note: transports] (csrc/transport/transport.h):
  // the worker runs jobs in order, completes the future once the output
  // holds the result (or sets it to the error), and lets go of the tensors
  // before that. Every rank must queue the same sequence of calls with the
  // same numels and dtypes (a rank that does not fails every rank at its
  // first differing call, naming both). Require contiguous CPU tensors of one dtype that
  // supports() accepts, and the process that made this end (see [Note:
  // forked children]). The scale is applied in the copies: applies_scale().
  transport::Future all_reduce(at::Tensor piece, double scale) override;
  transport::Future reduce_scatter(at::Tensor input, at::Tensor output_shard, double scale) override;
  transport::Future all_gather(at::Tensor shard, at::Tensor output) override;
  // The worker copies each input straight into this rank's staging region
  // and each rank's region straight into its outputs: no concatenated input,
  // no gathered buffer (see [Note: an all-gather in pieces] in the .cpp). It
  // runs, and is checked against the peers, as an all_gather of the inputs'
  // total, so it pairs with a peer's plain all_gather of that total. Writes
  // through data pointers: no version counter is bumped.
  transport::Future all_gather_many(std::vector<at::Tensor> inputs,
                                    std::vector<std::vector<at::Tensor>> outputs) override;
  // See [Note: buckets in shared memory]: a CPU buffer of a supported dtype
  // in memory the peers can map (at::empty for anything else, for a group of
  // one, or if the memory cannot be had).
  at::Tensor empty_buffer(int64_t numel, const at::TensorOptions& options) override;
  bool applies_scale() const override { return true; }
  std::string name() const override { return "shm"; }
  // all_reduce calls (of at least one element, more than one rank) reduced
  // in place and copied: "in_place_all_reduces", "copied_all_reduces".
  std::map<std::string, int64_t> stats() const override;
  // Marks the segment aborted by this rank with `why` (Transport::abort).
  void abort(const std::string& why) override;

  // Whether the collectives take this dtype (float32, float64, bfloat16, float16).
  static bool supports(at::ScalarType dtype);

  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return world_size_; }
  const std::string& segment_name() const { return name_; }

 private:
  struct Job {
    transport::Collective kind = transport::Collective::kAllReduce;
    at::Tensor input;   // the piece (all-reduce, in place), the input, or the shard
    at::Tensor output;  // the output shard (reduce-scatter) or output (all-gather)
    double scale = 1.0;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    // all_gather_many (kind kAllGather, input and output undefined): this
    // rank's shard in pieces, rank q's destinations, and the shard's elements.
    std::vector<at::Tensor> shard_pieces;
    std::vector<std::vector<at::Tensor>> output_pieces;
    int64_t pieces_numel = 0;
  };
  transport::Future enqueue(Job job);

  // --- the worker thread: one job at a time, in queue order ---
  void work_loop();
  void run_job(const Job& job);
  template <typename T, typename Scale>
  void run_pieces(T* data, int64_t numel, Scale scale);
  template <typename T, typename Scale>
  void run_reduce_scatter(const T* input, T* output, int64_t shard, Scale scale);
  // A rank's part of an all-gather as the byte ranges it is made of, in
  // order: the one shard, or all_gather_many's pieces.
  using Spans = std::vector<std::pair<char*, int64_t>>;
  void run_all_gather(const Spans& shard, const std::vector<Spans>& outputs, int64_t element_size);
  // Ends a step: raises reduced and waits for the peers' (see the note).
  void finish_step(uint32_t piece);
  // [Note: buckets in shared memory]: announces the piece; returns whether
  // it was reduced in place (otherwise the caller copies it).
  bool all_reduce_in_place(const at::Tensor& piece, double scale);
  template <typename T, typename Scale>
  void reduce_in_place(const std::vector<T*>& pieces, int64_t numel, Scale scale);
  // Rank `peer`'s announced piece of `bytes` bytes, mapped here.
  char* peer_piece(int64_t peer, size_t bytes);
  void unmap_peer_buffers(int64_t peer);
  enum class InPlace { kUnknown, kYes, kNo };  // whether peers' buffers can be mapped
  InPlace in_place_ = InPlace::kUnknown;
  std::atomic<int64_t> in_place_calls_{0};  // stats()
  std::atomic<int64_t> copied_calls_{0};

  // --- synchronization through the segment ---
  // The two counters each rank raises once per piece (see the note).
  enum class Phase { kStaged, kReduced };
  uint32_t* counter(int64_t rank, Phase phase) const;
  // Raises this rank's counter to `piece` and wakes peers sleeping on it.
  void publish(Phase phase, uint32_t piece);
  // Returns once every peer's counter has reached `piece`; throws naming the
  // peer when one cannot get there (see the note). The first staged wait of
  // a collective also checks that the peers run the same one
  // (check_same_call; [Note: ranks agree on each collective] in the .cpp).
  void wait_for_peers(Phase phase, uint32_t piece);
  void wait_for_counters(Phase phase, uint32_t piece);
  void check_same_call() const;
  void check_peer(int64_t peer, Phase phase, uint32_t piece, std::chrono::steady_clock::time_point deadline) const;
  // The first rank to call it marks the segment aborted, with the collective
  // it failed (kNoCollective: failed outside one) and why; every call wakes
  // the peers' waits.
  void mark_aborted(uint32_t kind, const std::string& why);
  // Throws `where` + which rank aborted the segment and why, if one has.
  void check_not_aborted(const std::string& where) const;
  transport::Collective running_ = transport::Collective::kAllReduce;  // the worker's job, for errors
  // Where rank `owner` keeps region `region` of staging set `set`.
  template <typename T>
  T* region(int64_t owner, uint32_t set, int64_t region) const;

  // Throws unless called by the process that constructed this end.
  void check_owner(const char* what) const;

  std::string name_;
  int64_t rank_;
  pid_t owner_pid_;  // the process that made this end; [Note: forked children]
  bool create_;      // this end created the segment (rank 0)
  std::atomic<bool> unlinked_{false};  // unlink() ran here
  int64_t world_size_;
  std::chrono::milliseconds timeout_;
  void* base_ = nullptr;  // the mapping, of mapped_bytes_
  size_t mapped_bytes_ = 0;
  std::unique_ptr<ShmSegment> segment_;  // views of base_
  std::shared_ptr<ShmBuffers> buffers_;   // shared with the buffers' deleters
  // Per peer, its buffers mapped here, by id (the worker's alone), and its
  // frees counter when they were last valid.
  struct PeerBuffer {
    char* base = nullptr;
    size_t bytes = 0;
  };
  std::vector<std::map<uint64_t, PeerBuffer>> peer_buffers_;
  std::vector<uint32_t> peer_frees_seen_;
  uint32_t pieces_done_ = 0;  // pieces this rank has run; the k of the protocol
  uint32_t calls_done_ = 0;   // collectives this rank has started
  bool call_unchecked_ = false;  // the running collective's description is not yet compared with the peers'

  std::atomic<bool> stopping_{false};  // set by shut_down(); waits give up
  std::atomic<bool> closed_{false};    // shut_down() ran here
  bool broken_ = false;     // a job failed: every later one fails too (peers are out of step)
  std::string broken_why_;  // the first failure, repeated to later jobs
  // Jobs from allreduce() to the worker thread, which it owns. On the heap
  // so a forked child can leave its copy alone: [Note: forked children].
  struct Queue {
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<Job> jobs;
    std::thread thread;
  };
  std::unique_ptr<Queue> queue_ = std::make_unique<Queue>();
};

}  // namespace pydist
