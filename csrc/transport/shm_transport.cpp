// Collectives through shared memory: see shm_transport.h and its note.
#include "transport/shm_transport.h"

#include "ops/scaled_copy.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PYDIST_CPU_RELAX() _mm_pause()
#else
#define PYDIST_CPU_RELAX() ((void)0)
#endif

namespace pydist {
namespace {

constexpr uint64_t kMagic = 0x70796469'73747368ULL;  // "pydistsh"
constexpr uint32_t kLayoutVersion = 5;
constexpr size_t kHeaderBytes = 4096;
// Checks of a counter before going to sleep on it: a peer that is running
// usually arrives within this, and sleeping costs two syscalls and a wakeup.
constexpr int kSpinChecks = 2000;
// How long one sleep lasts at most: how often a waiter looks whether its
// peer has died or the deadline has passed.
constexpr long kSleepNs = 20'000'000;

enum RankState : uint32_t { kAbsent = 0, kAttached = 1, kDetached = 2 };

// The first page of the segment.
struct ShmHeader {
  uint64_t magic;        // written last by the creator: the layout is ready
  uint32_t version;
  uint32_t world_size;
  uint64_t region_bytes; // size of one staging region
  uint32_t aborted;      // 0, or 1 + the rank that failed first; written last, after kind and why
  uint32_t aborted_kind; // the transport::Collective it failed, or kNoCollective
  uint32_t attached;     // ranks that have mapped it; see [Note: the segment's name lives only while ranks attach]
  uint32_t abort_claim;  // 1 once a rank has begun writing the abort: the first one writes it
  char aborted_why[3072];  // that rank's error, NUL-terminated (cut to fit)
};
static_assert(sizeof(ShmHeader) <= kHeaderBytes, "the header must fit its page");

// aborted_kind of an abort outside any collective (Transport::abort).
constexpr uint32_t kNoCollective = 0xffffffffu;

// One per rank, after the header; counters on cache lines of their own,
// since peers poll them while their owner writes its staging.
struct alignas(64) ShmRankBlock {
  uint32_t staged;  // the last piece this rank has staged
  char pad0[60];
  uint32_t reduced;  // the last piece this rank has reduced and published
  char pad1[60];
  uint32_t state;    // RankState
  int32_t pid;       // for the liveness check
  uint64_t pid_ns;   // inode of its pid namespace; pids compare only within one
  char pad2[48];
  // The collective this rank is running, written before it stages the
  // collective's first piece: see [Note: ranks agree on each collective].
  uint32_t call;       // collectives this rank has started, this one included
  uint32_t call_kind;  // its transport::Collective
  uint32_t call_dtype; // its at::ScalarType
  uint32_t pad3;
  int64_t call_numel;  // elements per rank: the piece, the output shard, or the shard
  // An all-reduce's piece, announced with its description: see [Note:
  // buckets in shared memory] in shm_transport.h.
  uint64_t piece_id;     // the empty_buffer() buffer it lies in; 0: none
  uint64_t piece_offset; // its first byte's offset in that buffer
  int32_t piece_fd;      // the buffer's fd in this rank's process
  uint32_t map_ok;       // 1: this rank could map every peer's buffer; 2: it could not
  uint32_t frees;        // buffers this rank has freed (peers then map afresh)
  char pad4[12];
};
static_assert(sizeof(ShmRankBlock) == 256, "four cache lines per rank");

size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }

uint64_t pid_namespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

uint32_t load(const uint32_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
void store(uint32_t* word, uint32_t value) { __atomic_store_n(word, value, __ATOMIC_RELEASE); }
bool reached(uint32_t counter, uint32_t piece) { return static_cast<int32_t>(counter - piece) >= 0; }

// Whether process `pid` (of this pid namespace) has exited: it no longer
// exists, or is a zombie waiting to be reaped (or being reaped), which
// kill(pid, 0) alone reports as alive.
bool process_gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* file = std::fopen(path, "r");
  if (file == nullptr) return errno == ENOENT;
  char line[512];
  const size_t got = std::fread(line, 1, sizeof(line) - 1, file);
  std::fclose(file);
  line[got] = '\0';
  // "pid (comm) S ...": the state follows the last ')' (comm may hold one).
  const char* paren = std::strrchr(line, ')');
  if (paren == nullptr || paren[1] != ' ') return false;
  return paren[2] == 'Z' || paren[2] == 'X' || paren[2] == 'x';
}

void futex_wake_all(uint32_t* word) { syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }
void futex_sleep(uint32_t* word, uint32_t seen) {
  struct timespec timeout {0, kSleepNs};
  syscall(SYS_futex, word, FUTEX_WAIT, seen, &timeout, nullptr, 0);
}

// --- the arithmetic: torch's, element by element ------------------------
// A product or sum of reduced-precision floats is taken in float (the
// dtype's opmath type) and rounded back, as torch's mul_out (the
// pre-division) and gloo's sum do. The product is ops::scaled, shared with
// the flatten kernels (ops/scaled_copy.h), so every scale rounds alike.
template <typename T> using acc_t = at::opmath_type<T>;
using ops::scaled;

template <typename T>
inline T add(T a, T b) { return static_cast<T>(static_cast<acc_t<T>>(a) + static_cast<acc_t<T>>(b)); }

// dst = src * s; dst may be src (an in-place scale).
template <typename T>
void copy_scaled(T* dst, const T* src, int64_t n, acc_t<T> s) {
  if (s == acc_t<T>(1)) {
    if (dst != src) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
    return;
  }
  ops::scaled_copy(dst, src, n, static_cast<double>(s));
}

// Two ranks: mine = mine*s + peer (the peer's term arrives scaled), into
// both the tensor and the published region, in one pass.
template <typename T>
void reduce_two(T* __restrict mine, const T* __restrict peer, T* __restrict out, int64_t n, acc_t<T> s) {
  for (int64_t i = 0; i < n; ++i) out[i] = mine[i] = add(scaled(mine[i], s), peer[i]);
}

// Two ranks, reduce-scatter: out = mine*s + peer, leaving `mine` as it is.
template <typename T>
void sum_two(T* __restrict out, const T* __restrict mine, const T* __restrict peer, int64_t n, acc_t<T> s) {
  for (int64_t i = 0; i < n; ++i) out[i] = add(scaled(mine[i], s), peer[i]);
}

// Any number of ranks: every term is staged (scaled); sum in rank order.
template <typename T>
void sum_in_rank_order(T* __restrict out, const T* const* terms, int64_t num_terms, int64_t n) {
  const T* __restrict first = terms[0];
  const T* __restrict second = terms[1];
  for (int64_t i = 0; i < n; ++i) out[i] = add(first[i], second[i]);
  for (int64_t q = 2; q < num_terms; ++q) {
    const T* __restrict term = terms[q];
    for (int64_t i = 0; i < n; ++i) out[i] = add(out[i], term[i]);
  }
}

const char* article_name(transport::Collective kind) {
  switch (kind) {
    case transport::Collective::kAllReduce: return "an all-reduce";
    case transport::Collective::kReduceScatter: return "a reduce-scatter";
    case transport::Collective::kAllGather: return "an all-gather";
  }
  return "a collective";
}

}  // namespace

// The mapped layout: header, one block per rank, then per rank two staging
// sets of world_size regions each.
struct ShmSegment {
  ShmHeader* header = nullptr;
  ShmRankBlock* ranks = nullptr;
  char* data = nullptr;
  size_t region_bytes = 0;

  static size_t data_offset(int64_t world_size) {
    return round_up(kHeaderBytes + sizeof(ShmRankBlock) * static_cast<size_t>(world_size), 4096);
  }
  static size_t region_bytes_for(int64_t world_size) {
    return round_up(static_cast<size_t>(kShmPieceBytes) / static_cast<size_t>(world_size), 64);
  }
  static size_t total_bytes(int64_t world_size) {
    const auto n = static_cast<size_t>(world_size);
    return data_offset(world_size) + n * 2 * n * region_bytes_for(world_size);
  }
};

// This rank's empty_buffer() buffers, by address, for the worker to find a
// piece's buffer. Shared with every buffer's deleter, which may run after
// the transport is gone (a gradient outlives its model's wrapper).
struct ShmBuffers {
  struct Buffer {
    uint64_t id = 0;  // unique within the process, never 0
    int fd = -1;
    size_t bytes = 0;
  };
  std::mutex mutex;
  std::map<uintptr_t, Buffer> by_base;
  uint64_t next_id = 1;
  uint32_t* frees = nullptr;  // this rank's counter in the segment; null once unmapped
  pid_t owner_pid = 0;

  // The buffer's deleter: unmaps it and counts the free for the peers. A
  // forked child only drops its own mapping and fd (the parent's worker may
  // have held the mutex at the fork; the counter is the parent's).
  void release(void* data) {
    if (getpid() != owner_pid) {
      // The size is not known without the map; the child's copy of it is
      // still readable, the mutex is not to be trusted.
      auto it = by_base.find(reinterpret_cast<uintptr_t>(data));
      if (it != by_base.end()) {
        munmap(data, it->second.bytes);
        close(it->second.fd);
      }
      return;
    }
    std::lock_guard<std::mutex> lock(mutex);
    auto it = by_base.find(reinterpret_cast<uintptr_t>(data));
    if (it == by_base.end()) return;
    munmap(data, it->second.bytes);
    close(it->second.fd);
    by_base.erase(it);
    if (frees != nullptr) __atomic_add_fetch(frees, 1u, __ATOMIC_RELEASE);
  }

  // Whether [data, data + bytes) lies in one buffer; if so, which and where.
  bool find(const void* data, size_t bytes, Buffer* buffer, uint64_t* offset) {
    const auto at = reinterpret_cast<uintptr_t>(data);
    std::lock_guard<std::mutex> lock(mutex);
    auto it = by_base.upper_bound(at);
    if (it == by_base.begin()) return false;
    --it;
    if (at + bytes > it->first + it->second.bytes) return false;
    *buffer = it->second;
    *offset = at - it->first;
    return true;
  }
};

// --- setting up and tearing down ------------------------------------------

ShmTransport::ShmTransport(std::string name, int64_t rank, int64_t world_size, bool create,
                           std::chrono::milliseconds timeout)
    : name_(std::move(name)),
      rank_(rank),
      owner_pid_(getpid()),
      create_(create),
      world_size_(world_size),
      timeout_(timeout) {
  TORCH_CHECK(world_size_ >= 1 && rank_ >= 0 && rank_ < world_size_, "ShmTransport: rank ", rank_,
              " is not in a group of ", world_size_);
  const size_t bytes = ShmSegment::total_bytes(world_size_);
  const int fd = create ? shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600) : shm_open(name_.c_str(), O_RDWR, 0);
  TORCH_CHECK(fd >= 0, "ShmTransport: rank ", rank_, " could not ", create ? "create" : "open",
              " the shared-memory object ", name_, ": ", std::strerror(errno));
  if (create) {
    // Reserve the pages now: a /dev/shm too small fails here, not later
    // with a SIGBUS at the first write.
    const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (err != 0) {
      close(fd);
      shm_unlink(name_.c_str());
      TORCH_CHECK(false, "ShmTransport: could not reserve ", bytes, " bytes of shared memory for ", name_, ": ",
                  std::strerror(err), " (is /dev/shm full or too small?)");
    }
  } else {
    struct stat st {};
    const bool sized = fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes;
    if (!sized) close(fd);
    TORCH_CHECK(sized, "ShmTransport: the shared-memory object ", name_, " has ", st.st_size, " bytes, rank ", rank_,
                " expected ", bytes, " bytes for ", world_size_, " ranks");
  }
  base_ = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base_ == MAP_FAILED && create) shm_unlink(name_.c_str());
  TORCH_CHECK(base_ != MAP_FAILED, "ShmTransport: rank ", rank_, " could not map ", name_, ": ", std::strerror(errno));
  mapped_bytes_ = bytes;

  segment_ = std::make_unique<ShmSegment>();
  ShmSegment* segment = segment_.get();
  segment->header = static_cast<ShmHeader*>(base_);
  segment->ranks = reinterpret_cast<ShmRankBlock*>(static_cast<char*>(base_) + kHeaderBytes);
  segment->data = static_cast<char*>(base_) + ShmSegment::data_offset(world_size_);
  segment->region_bytes = ShmSegment::region_bytes_for(world_size_);
  ShmHeader& header = *segment->header;
  if (create) {
    header.version = kLayoutVersion;
    header.world_size = static_cast<uint32_t>(world_size_);
    header.region_bytes = segment->region_bytes;
    header.attached = 0;
    __atomic_store_n(&header.magic, kMagic, __ATOMIC_RELEASE);
  } else {
    const bool same = __atomic_load_n(&header.magic, __ATOMIC_ACQUIRE) == kMagic && header.version == kLayoutVersion &&
                      header.world_size == world_size_ && header.region_bytes == segment->region_bytes;
    if (!same) munmap(base_, mapped_bytes_);  // the destructor does not run for a constructor that throws
    TORCH_CHECK(same, "ShmTransport: ", name_, " does not hold the layout rank ", rank_,
                " expects (another pydist version, or another group?)");
  }
  ShmRankBlock& me = segment->ranks[rank_];
  me.pid = static_cast<int32_t>(getpid());
  me.pid_ns = pid_namespace();
  buffers_ = std::make_shared<ShmBuffers>();
  buffers_->frees = &me.frees;
  buffers_->owner_pid = owner_pid_;
  peer_buffers_.resize(static_cast<size_t>(world_size_));
  peer_frees_seen_.assign(static_cast<size_t>(world_size_), 0);
  store(&me.state, kAttached);
  queue_->thread = std::thread([this] { work_loop(); });
  // The last rank to map needs the name no more than anyone after it.
  if (__atomic_add_fetch(&header.attached, 1, __ATOMIC_ACQ_REL) == static_cast<uint32_t>(world_size_)) unlink();
}

ShmTransport::~ShmTransport() {
  if (getpid() != owner_pid_) {
    // A forked child: the worker is not ours and the segment's state is the
    // parent's. See [Note: forked children].
    // Its copy of the queue (a condition variable the parent's worker was
    // waiting on, a mutex perhaps held at the fork) cannot be destroyed
    // here without waiting for that thread: it is left to the exit.
    (void)queue_.release();
    munmap(base_, mapped_bytes_);
    return;
  }
  shut_down();
  {
    std::lock_guard<std::mutex> lock(buffers_->mutex);
    buffers_->frees = nullptr;  // buffers freed from now on count nowhere
  }
  munmap(base_, mapped_bytes_);
  if (create_) unlink();  // set-up ended before anyone did; harmless if done
}

void ShmTransport::shut_down() {
  if (getpid() != owner_pid_ || closed_.exchange(true)) return;  // a forked child's: see the destructor
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    stopping_ = true;
  }
  queue_->wake.notify_all();
  queue_->thread.join();  // it empties the queue first: those jobs fail fast
  for (int64_t q = 0; q < world_size_; ++q) unmap_peer_buffers(q);
  store(&segment_->ranks[rank_].state, kDetached);
  for (Phase phase : {Phase::kStaged, Phase::kReduced}) futex_wake_all(counter(rank_, phase));
}

void ShmTransport::unlink() {
  if (!unlinked_.exchange(true)) shm_unlink(name_.c_str());
}

void ShmTransport::check_owner(const char* what) const {
  TORCH_CHECK(getpid() == owner_pid_, "ShmTransport.", what, ": this end of ", name_, " belongs to process ",
              owner_pid_, "; process ", getpid(), " was forked from it and cannot use it (make its own ",
              "process group and DistributedDataParallel instead)");
}

bool ShmTransport::supports(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// --- the queue -----------------------------------------------------------

namespace {
void check_carriable(const char* what, const char* role, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cpu() && t.is_contiguous() && ShmTransport::supports(t.scalar_type()),
              "ShmTransport.", what, ": needs a contiguous CPU tensor of float32, float64, bfloat16 or float16, got ",
              role, " ", t.scalar_type(), " on ", t.device(), t.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(t.scalar_type() == dtype, "ShmTransport.", what, ": ", role, " is ", t.scalar_type(), ", the input ",
              dtype);
}
}  // namespace

transport::Future ShmTransport::all_reduce(at::Tensor piece, double scale) {
  check_carriable("all_reduce", "piece", piece, piece.scalar_type());
  return enqueue(Job{transport::Collective::kAllReduce, std::move(piece), at::Tensor(), scale, nullptr});
}

transport::Future ShmTransport::reduce_scatter(at::Tensor input, at::Tensor output_shard, double scale) {
  check_carriable("reduce_scatter", "input", input, input.scalar_type());
  check_carriable("reduce_scatter", "output_shard", output_shard, input.scalar_type());
  TORCH_CHECK(input.numel() == output_shard.numel() * world_size_, "ShmTransport.reduce_scatter: input has ",
              input.numel(), " elements, world_size (", world_size_, ") x output_shard (", output_shard.numel(),
              ") expected");
  return enqueue(Job{transport::Collective::kReduceScatter, std::move(input), std::move(output_shard), scale, nullptr});
}

transport::Future ShmTransport::all_gather(at::Tensor shard, at::Tensor output) {
  check_carriable("all_gather", "shard", shard, shard.scalar_type());
  check_carriable("all_gather", "output", output, shard.scalar_type());
  TORCH_CHECK(output.numel() == shard.numel() * world_size_, "ShmTransport.all_gather: output has ", output.numel(),
              " elements, world_size (", world_size_, ") x shard (", shard.numel(), ") expected");
  return enqueue(Job{transport::Collective::kAllGather, std::move(shard), std::move(output), 1.0, nullptr});
}

transport::Future ShmTransport::all_gather_many(std::vector<at::Tensor> inputs,
                                                std::vector<std::vector<at::Tensor>> outputs) {
  const int64_t total = transport::check_all_gather_many("ShmTransport.all_gather_many", inputs, outputs, world_size_);
  const at::ScalarType dtype = inputs[0].scalar_type();
  for (const at::Tensor& t : inputs) check_carriable("all_gather_many", "an input", t, dtype);
  for (const auto& mine : outputs) {
    for (const at::Tensor& t : mine) check_carriable("all_gather_many", "an output", t, dtype);
  }
  Job job{transport::Collective::kAllGather, at::Tensor(), at::Tensor(), 1.0, nullptr};
  job.shard_pieces = std::move(inputs);
  job.output_pieces = std::move(outputs);
  job.pieces_numel = total;
  return enqueue(std::move(job));
}

transport::Future ShmTransport::enqueue(Job job) {
  check_owner(transport::collective_name(job.kind));
  job.future = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
  auto future = job.future;
  // The caller's handle holds the tensors too: see [Note: who lets go of a
  // collective's tensors] in transport.h.
  auto tensors = std::make_shared<std::vector<at::Tensor>>();
  tensors->reserve(2 + job.shard_pieces.size() * (1 + job.output_pieces.size()));
  for (const at::Tensor* t : {&job.input, &job.output}) {
    if (t->defined()) tensors->push_back(*t);
  }
  tensors->insert(tensors->end(), job.shard_pieces.begin(), job.shard_pieces.end());
  for (const auto& mine : job.output_pieces) tensors->insert(tensors->end(), mine.begin(), mine.end());
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    TORCH_CHECK(!stopping_, "ShmTransport.", transport::collective_name(job.kind),
                ": the transport is shutting down");
    queue_->jobs.push_back(std::move(job));
  }
  queue_->wake.notify_one();
  return transport::Future(std::move(future), {}, {}, std::move(tensors));
}

void ShmTransport::work_loop() {
  while (true) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(queue_->mutex);
      queue_->wake.wait(lock, [this] { return stopping_ || !queue_->jobs.empty(); });
      if (queue_->jobs.empty()) return;  // stopping, nothing left
      job = std::move(queue_->jobs.front());
      queue_->jobs.pop_front();
    }
    std::exception_ptr error;
    try {
      TORCH_CHECK(!broken_, broken_why_);
      run_job(job);
    } catch (const std::exception& e) {
      error = std::current_exception();
      if (!broken_) {
        // Peers are now out of step with this rank: fail them at once, and
        // every later job here.
        broken_ = true;
        const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
        broken_why_ = c10_error ? c10_error->what_without_backtrace() : e.what();
        mark_aborted(static_cast<uint32_t>(job.kind), broken_why_);
      }
    }
    // Let go of the tensors before waking the caller. The caller's handle
    // holds them too, so this is only a count; should the caller have
    // dropped the handle, it is the last reference to a tensor Python may
    // also hold, which needs the GIL, and the caller releases it while it
    // waits. See [Note: who lets go of a collective's tensors].
    job.input.reset();
    job.output.reset();
    job.shard_pieces.clear();
    job.output_pieces.clear();
    if (error) {
      job.future->setError(error);
    } else {
      job.future->markCompleted(c10::IValue(completion_time()));
    }
  }
}

void ShmTransport::run_job(const Job& job) {
  running_ = job.kind;
  // [Note: ranks agree on each collective]
  // Peers pair their pieces by count alone, so ranks that issue different
  // collectives (a unit run on some ranks only, a rank that skipped a
  // bucket) would pair unrelated pieces and finish with wrong data. So each
  // rank writes what it is running into its block before staging its first
  // piece, and the first wait for the peers' staged pieces compares theirs
  // with its own (wait_for_peers): a mismatch fails every rank at once,
  // naming both. A peer cannot overwrite its description before this rank
  // reads it: it cannot finish that first piece without this rank. A
  // collective of no elements still makes one empty step, so its check
  // happens too.
  // all_gather_many describes itself as the all-gather of its total, which
  // it is: see [Note: an all-gather in pieces].
  const bool many = !job.input.defined();
  const at::ScalarType dtype = many ? job.shard_pieces[0].scalar_type() : job.input.scalar_type();
  const int64_t per_rank = many ? job.pieces_numel
                                : job.kind == transport::Collective::kReduceScatter ? job.output.numel()
                                                                                    : job.input.numel();
  ShmRankBlock& me = segment_->ranks[rank_];
  me.call_kind = static_cast<uint32_t>(job.kind);
  me.call_dtype = static_cast<uint32_t>(dtype);
  me.call_numel = per_rank;
  store(&me.call, ++calls_done_);
  call_unchecked_ = world_size_ > 1;
  if (per_rank == 0) {
    if (world_size_ > 1) {
      const uint32_t piece = ++pieces_done_;
      publish(Phase::kStaged, piece);
      wait_for_peers(Phase::kStaged, piece);
      finish_step(piece);
    }
    return;
  }
  if (job.kind == transport::Collective::kAllGather) {
    const int64_t element_size = static_cast<int64_t>(c10::elementSize(dtype));
    auto span = [&](const at::Tensor& t) {
      return std::make_pair(static_cast<char*>(t.data_ptr()), static_cast<int64_t>(t.nbytes()));
    };
    Spans shard;
    std::vector<Spans> outputs(static_cast<size_t>(world_size_));
    if (many) {
      for (const at::Tensor& t : job.shard_pieces) shard.push_back(span(t));
      for (int64_t q = 0; q < world_size_; ++q) {
        for (const at::Tensor& t : job.output_pieces[static_cast<size_t>(q)]) outputs[q].push_back(span(t));
      }
    } else {
      shard.push_back(span(job.input));
      char* output = static_cast<char*>(job.output.data_ptr());
      const int64_t bytes = shard[0].second;
      for (int64_t q = 0; q < world_size_; ++q) outputs[q].emplace_back(output + q * bytes, bytes);
    }
    return run_all_gather(shard, outputs, element_size);
  }
  if (job.kind == transport::Collective::kAllReduce && world_size_ > 1) {
    if (in_place_ != InPlace::kNo && all_reduce_in_place(job.input, job.scale)) {
      in_place_calls_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    copied_calls_.fetch_add(1, std::memory_order_relaxed);
  }
  auto run = [&](auto* input, auto scale) {
    using T = std::remove_pointer_t<decltype(input)>;
    switch (job.kind) {
      case transport::Collective::kAllReduce:
        return run_pieces(input, job.input.numel(), scale);
      case transport::Collective::kReduceScatter:
        return run_reduce_scatter<T>(input, job.output.data_ptr<T>(), job.output.numel(), scale);
      case transport::Collective::kAllGather:
        break;  // above
    }
  };
  const at::Tensor& t = job.input;
  switch (t.scalar_type()) {
    case at::kFloat:
      return run(t.data_ptr<float>(), static_cast<float>(job.scale));
    case at::kDouble:
      return run(t.data_ptr<double>(), job.scale);
    case at::kBFloat16:
      return run(t.data_ptr<c10::BFloat16>(), static_cast<float>(job.scale));
    case at::kHalf:
      return run(t.data_ptr<c10::Half>(), static_cast<float>(job.scale));
    default:
      TORCH_CHECK(false, "ShmTransport: unsupported dtype ", t.scalar_type());
  }
}

// --- the protocol of [Note: shared-memory all-reduce] ---------------------

template <typename T>
T* ShmTransport::region(int64_t owner, uint32_t set, int64_t region) const {
  const auto n = static_cast<size_t>(world_size_);
  const size_t index = (static_cast<size_t>(owner) * 2 + set) * n + static_cast<size_t>(region);
  return reinterpret_cast<T*>(segment_->data + index * segment_->region_bytes);
}

template <typename T, typename Scale>
void ShmTransport::run_pieces(T* data, int64_t numel, Scale scale) {
  static_assert(std::is_same_v<Scale, acc_t<T>>, "the scale is applied in the accumulate type");
  const int64_t n = world_size_;
  const int64_t r = rank_;
  if (n == 1) {  // nothing to exchange; the scale still applies
    copy_scaled(data, data, numel, scale);
    return;
  }
  // Slices are multiples of 16 elements, so each starts on a cache line.
  const int64_t grain = 16 * n;
  const int64_t piece_elems = std::max<int64_t>(grain, kShmPieceBytes / static_cast<int64_t>(sizeof(T)) / grain * grain);
  std::vector<const T*> terms(static_cast<size_t>(n));
  for (int64_t offset = 0; offset < numel; offset += piece_elems) {
    T* x = data + offset;
    const int64_t len = std::min(piece_elems, numel - offset);
    const int64_t slice = (len + grain - 1) / grain * 16;
    auto begin = [&](int64_t q) { return std::min(len, q * slice); };
    auto count = [&](int64_t q) { return std::min(len, (q + 1) * slice) - begin(q); };
    TORCH_INTERNAL_ASSERT(static_cast<size_t>(slice) * sizeof(T) <= segment_->region_bytes);
    const uint32_t piece = ++pieces_done_;
    const uint32_t set = piece & 1;

    // stage: the slices peers reduce (and, with more than two ranks, this
    // rank's own, so every term of the rank-order sum is in one place).
    for (int64_t q = 0; q < n; ++q) {
      if (q != r || n > 2) copy_scaled(region<T>(r, set, q), x + begin(q), count(q), scale);
    }
    publish(Phase::kStaged, piece);
    wait_for_peers(Phase::kStaged, piece);

    // reduce: this rank's slice, into its tensor and its published region.
    T* mine = x + begin(r);
    if (n == 2) {
      reduce_two(mine, region<T>(1 - r, set, r), region<T>(r, set, r), count(r), scale);
    } else {
      for (int64_t q = 0; q < n; ++q) terms[q] = region<T>(q, set, r);
      sum_in_rank_order(mine, terms.data(), n, count(r));
      std::memcpy(region<T>(r, set, r), mine, static_cast<size_t>(count(r)) * sizeof(T));
    }
    finish_step(piece);

    // collect: every peer's reduced slice.
    for (int64_t q = 0; q < n; ++q) {
      if (q != r) std::memcpy(x + begin(q), region<T>(q, set, q), static_cast<size_t>(count(q)) * sizeof(T));
    }
  }
}

template <typename T, typename Scale>
void ShmTransport::run_reduce_scatter(const T* input, T* output, int64_t shard, Scale scale) {
  static_assert(std::is_same_v<Scale, acc_t<T>>, "the scale is applied in the accumulate type");
  const int64_t n = world_size_;
  const int64_t r = rank_;
  if (n == 1) {
    copy_scaled(output, input, shard, scale);
    return;
  }
  const int64_t step = std::max<int64_t>(16, static_cast<int64_t>(segment_->region_bytes / sizeof(T)) / 16 * 16);
  std::vector<const T*> terms(static_cast<size_t>(n));
  for (int64_t offset = 0; offset < shard; offset += step) {
    const int64_t len = std::min(step, shard - offset);
    const uint32_t piece = ++pieces_done_;
    const uint32_t set = piece & 1;
    // stage: this step of every shard but the own (all of them beyond two ranks)
    for (int64_t q = 0; q < n; ++q) {
      if (q != r || n > 2) copy_scaled(region<T>(r, set, q), input + q * shard + offset, len, scale);
    }
    publish(Phase::kStaged, piece);
    wait_for_peers(Phase::kStaged, piece);
    // reduce: the own shard's step, into the output
    if (n == 2) {
      sum_two(output + offset, input + r * shard + offset, region<T>(1 - r, set, r), len, scale);
    } else {
      for (int64_t q = 0; q < n; ++q) terms[q] = region<T>(q, set, r);
      sum_in_rank_order(output + offset, terms.data(), n, len);
    }
    finish_step(piece);
  }
}

// [Note: an all-gather in pieces]
// An all-gather moves bytes without arithmetic, so it runs on byte spans:
// this rank's shard as the ranges it is made of (one tensor, or
// all_gather_many's pieces), and per rank q the ranges rank q's part lands
// in, the same sizes in the same order. The protocol is the one of the
// header's note, on the concatenation of the spans: step k covers bytes
// [k * step, (k + 1) * step) of it whatever spans they fall in, so a rank
// gathering pieces and a peer gathering one tensor of the same total meet in
// the same regions with the same bytes. The step is a whole number of
// elements, the same for both.

namespace {

// Where a walk over spans has got to: the span, and the byte within it.
struct SpanCursor {
  size_t span = 0;
  int64_t within = 0;
};

// Calls visit(span bytes, offset from the walk's start, length) for the
// `len` bytes of `spans` from `at`, span by span; returns where it stopped.
template <typename Visit>
SpanCursor walk_spans(const std::vector<std::pair<char*, int64_t>>& spans, SpanCursor at, int64_t len, Visit&& visit) {
  for (int64_t done = 0; done < len;) {
    const auto& [data, size] = spans[at.span];
    const int64_t n = std::min(size - at.within, len - done);
    if (n > 0) visit(data + at.within, done, n);
    done += n;
    at.within += n;
    if (at.within == size) at = SpanCursor{at.span + 1, 0};
  }
  return at;
}

}  // namespace

void ShmTransport::run_all_gather(const Spans& shard, const std::vector<Spans>& outputs, int64_t element_size) {
  const int64_t n = world_size_;
  const int64_t r = rank_;
  int64_t total = 0;
  for (size_t i = 0; i < shard.size(); ++i) {
    char* own = outputs[r][i].first;
    if (own != shard[i].first) std::memcpy(own, shard[i].first, static_cast<size_t>(shard[i].second));
    total += shard[i].second;
  }
  if (n == 1) return;
  const int64_t step_elements = std::max<int64_t>(16, static_cast<int64_t>(segment_->region_bytes) / element_size / 16 * 16);
  const int64_t step = step_elements * element_size;
  SpanCursor at;  // every rank's spans have the shard's sizes: one cursor serves them all
  for (int64_t offset = 0; offset < total; offset += step) {
    const int64_t len = std::min(step, total - offset);
    const uint32_t piece = ++pieces_done_;
    const uint32_t set = piece & 1;
    char* mine = region<char>(r, set, r);
    const SpanCursor next = walk_spans(shard, at, len, [&](const char* data, int64_t off, int64_t bytes) {
      std::memcpy(mine + off, data, static_cast<size_t>(bytes));
    });
    publish(Phase::kStaged, piece);
    wait_for_peers(Phase::kStaged, piece);
    for (int64_t q = 0; q < n; ++q) {
      if (q == r) continue;
      const char* theirs = region<char>(q, set, q);
      walk_spans(outputs[q], at, len, [&](char* data, int64_t off, int64_t bytes) {
        std::memcpy(data, theirs + off, static_cast<size_t>(bytes));
      });
    }
    at = next;
    finish_step(piece);
  }
}

// --- [Note: buckets in shared memory] --------------------------------------

at::Tensor ShmTransport::empty_buffer(int64_t numel, const at::TensorOptions& options) {
  const at::ScalarType dtype = options.dtype().toScalarType();
  if (world_size_ == 1 || numel <= 0 || options.device().type() != at::kCPU || !supports(dtype) ||
      getpid() != owner_pid_ || closed_) {
    return at::empty({numel}, options);
  }
  const size_t bytes = round_up(static_cast<size_t>(numel) * c10::elementSize(dtype), 4096);
  const int fd = memfd_create("pydist-bucket", MFD_CLOEXEC);
  if (fd < 0) return at::empty({numel}, options);
  // Reserve the pages now, as for the segment: memory that cannot be had
  // means private memory (copied collectives), not a SIGBUS at a later write.
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 || posix_fallocate(fd, 0, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    return at::empty({numel}, options);
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    close(fd);
    return at::empty({numel}, options);
  }
  std::shared_ptr<ShmBuffers> buffers = buffers_;
  {
    std::lock_guard<std::mutex> lock(buffers->mutex);
    buffers->by_base[reinterpret_cast<uintptr_t>(base)] = ShmBuffers::Buffer{buffers->next_id++, fd, bytes};
  }
  return at::from_blob(base, {numel}, [buffers](void* data) { buffers->release(data); }, options);
}

std::map<std::string, int64_t> ShmTransport::stats() const {
  return {{"in_place_all_reduces", in_place_calls_.load(std::memory_order_relaxed)},
          {"copied_all_reduces", copied_calls_.load(std::memory_order_relaxed)}};
}

bool ShmTransport::all_reduce_in_place(const at::Tensor& piece, double scale) {
  const int64_t n = world_size_;
  const size_t bytes = piece.nbytes();
  ShmRankBlock& me = segment_->ranks[rank_];
  ShmBuffers::Buffer buffer;
  uint64_t offset = 0;
  const bool in_buffer = buffers_->find(piece.const_data_ptr(), bytes, &buffer, &offset);
  me.piece_id = in_buffer ? buffer.id : 0;
  me.piece_offset = offset;
  me.piece_fd = buffer.fd;
  uint32_t step = ++pieces_done_;
  publish(Phase::kStaged, step);  // announce: this rank's piece is final
  wait_for_peers(Phase::kStaged, step);
  for (int64_t q = 0; q < n; ++q) {
    if (segment_->ranks[q].piece_id == 0) return false;  // copied, by every rank alike
  }
  std::vector<char*> pieces(static_cast<size_t>(n));
  pieces[rank_] = static_cast<char*>(piece.data_ptr());
  if (in_place_ == InPlace::kUnknown) {
    // The first time: can every rank map every peer's buffer? All learn the
    // answer after one more step and take the same path from then on.
    bool mapped = true;
    try {
      for (int64_t q = 0; q < n; ++q) {
        if (q != rank_) pieces[q] = peer_piece(q, bytes);
      }
    } catch (const std::exception&) {
      mapped = false;
    }
    store(&me.map_ok, mapped ? 1u : 2u);
    finish_step(step);
    bool all = true;
    for (int64_t q = 0; q < n; ++q) all = all && load(&segment_->ranks[q].map_ok) == 1u;
    in_place_ = all ? InPlace::kYes : InPlace::kNo;
    if (!all) {
      for (int64_t q = 0; q < n; ++q) unmap_peer_buffers(q);
      return false;
    }
    step = ++pieces_done_;  // the reduce below ends a step of its own
  } else {
    for (int64_t q = 0; q < n; ++q) {
      if (q != rank_) pieces[q] = peer_piece(q, bytes);
    }
  }
  auto run = [&](auto* typed, auto s) {
    using T = std::remove_pointer_t<decltype(typed)>;
    std::vector<T*> terms(static_cast<size_t>(n));
    for (int64_t q = 0; q < n; ++q) terms[q] = reinterpret_cast<T*>(pieces[q]);
    reduce_in_place<T>(terms, piece.numel(), s);
  };
  switch (piece.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr), static_cast<float>(scale)); break;
    case at::kDouble: run(static_cast<double*>(nullptr), scale); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr), static_cast<float>(scale)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr), static_cast<float>(scale)); break;
    default: TORCH_CHECK(false, "ShmTransport: unsupported dtype ", piece.scalar_type());
  }
  finish_step(step);
  return true;
}

template <typename T, typename Scale>
void ShmTransport::reduce_in_place(const std::vector<T*>& pieces, int64_t numel, Scale scale) {
  static_assert(std::is_same_v<Scale, acc_t<T>>, "the scale is applied in the accumulate type");
  const int64_t n = world_size_;
  // Slice r of every piece is rank r's to sum; slices are multiples of 16
  // elements, as in run_pieces.
  const int64_t slice = (numel + 16 * n - 1) / (16 * n) * 16;
  const int64_t begin = std::min(numel, rank_ * slice);
  const int64_t len = std::min(numel, begin + slice) - begin;
  if (n == 2) {
    T* __restrict x0 = pieces[0] + begin;
    T* __restrict x1 = pieces[1] + begin;
    for (int64_t i = 0; i < len; ++i) x0[i] = x1[i] = add(scaled(x0[i], scale), scaled(x1[i], scale));
    return;
  }
  // In blocks that stay in the cache: the rank-order sum of the scaled
  // terms (as sum_in_rank_order over staged terms), then into every piece.
  constexpr int64_t kBlock = 4096;
  std::vector<T> sum(static_cast<size_t>(std::min(kBlock, std::max<int64_t>(len, 1))));
  for (int64_t done = 0; done < len; done += kBlock) {
    const int64_t m = std::min(kBlock, len - done);
    const T* __restrict first = pieces[0] + begin + done;
    const T* __restrict second = pieces[1] + begin + done;
    T* __restrict out = sum.data();
    for (int64_t i = 0; i < m; ++i) out[i] = add(scaled(first[i], scale), scaled(second[i], scale));
    for (int64_t q = 2; q < n; ++q) {
      const T* __restrict term = pieces[q] + begin + done;
      for (int64_t i = 0; i < m; ++i) out[i] = add(out[i], scaled(term[i], scale));
    }
    for (int64_t q = 0; q < n; ++q) std::memcpy(pieces[q] + begin + done, out, static_cast<size_t>(m) * sizeof(T));
  }
}

char* ShmTransport::peer_piece(int64_t peer, size_t bytes) {
  const ShmRankBlock& block = segment_->ranks[peer];
  const uint32_t frees = load(&block.frees);
  if (frees != peer_frees_seen_[peer]) {
    // The peer freed buffers: drop every mapping of its (the live ones are
    // mapped again as they come), so freed memory is not kept alive here.
    unmap_peer_buffers(peer);
    peer_frees_seen_[peer] = frees;
  }
  auto& mapped = peer_buffers_[peer];
  auto it = mapped.find(block.piece_id);
  if (it == mapped.end()) {
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/%d/fd/%d", static_cast<int>(block.pid), static_cast<int>(block.piece_fd));
    const int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      TORCH_CHECK(!process_gone(block.pid), "shared-memory all-reduce (", name_, "): rank ", rank_,
                  " could not map rank ", peer, "'s gradient buffer: its process (pid ", block.pid, ") has exited");
      TORCH_CHECK(false, "shared-memory all-reduce (", name_, "): rank ", rank_, " could not open rank ", peer,
                  "'s gradient buffer ", path, ": ", std::strerror(err));
    }
    struct stat st {};
    const bool sized = fstat(fd, &st) == 0 && st.st_size > 0;
    void* base = sized ? mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                       : MAP_FAILED;
    const int err = errno;
    close(fd);
    TORCH_CHECK(base != MAP_FAILED, "shared-memory all-reduce (", name_, "): rank ", rank_, " could not map rank ",
                peer, "'s gradient buffer ", path, ": ", std::strerror(err));
    it = mapped.emplace(block.piece_id, PeerBuffer{static_cast<char*>(base), static_cast<size_t>(st.st_size)}).first;
  }
  TORCH_CHECK(block.piece_offset + bytes <= it->second.bytes, "shared-memory all-reduce (", name_, "): rank ", peer,
              " announced a piece of ", bytes, " bytes at offset ", block.piece_offset, " of a buffer of ",
              it->second.bytes, " bytes");
  return it->second.base + block.piece_offset;
}

void ShmTransport::unmap_peer_buffers(int64_t peer) {
  for (auto& [id, mapped] : peer_buffers_[peer]) munmap(mapped.base, mapped.bytes);
  peer_buffers_[peer].clear();
}

void ShmTransport::finish_step(uint32_t piece) {
  publish(Phase::kReduced, piece);
  wait_for_peers(Phase::kReduced, piece);
}

uint32_t* ShmTransport::counter(int64_t rank, Phase phase) const {
  ShmRankBlock& block = segment_->ranks[rank];
  return phase == Phase::kStaged ? &block.staged : &block.reduced;
}

void ShmTransport::publish(Phase phase, uint32_t piece) {
  uint32_t* word = counter(rank_, phase);
  store(word, piece);
  futex_wake_all(word);
}

void ShmTransport::wait_for_peers(Phase phase, uint32_t piece) {
  wait_for_counters(phase, piece);
  if (phase == Phase::kStaged && call_unchecked_) {
    call_unchecked_ = false;
    check_same_call();
  }
}

void ShmTransport::check_same_call() const {
  const ShmRankBlock& me = segment_->ranks[rank_];
  auto describe = [](const ShmRankBlock& b) {
    return c10::str(transport::collective_name(static_cast<transport::Collective>(b.call_kind)), " #", b.call, " of ",
                    b.call_numel, " ", static_cast<at::ScalarType>(b.call_dtype), " elements per rank");
  };
  for (int64_t q = 0; q < world_size_; ++q) {
    const ShmRankBlock& peer = segment_->ranks[q];
    const bool same = load(&peer.call) == me.call && peer.call_kind == me.call_kind &&
                      peer.call_dtype == me.call_dtype && peer.call_numel == me.call_numel;
    TORCH_CHECK(same, "shared-memory transport (", name_, "): the ranks issued different collectives: rank ", rank_,
                " runs ", describe(me), ", rank ", q, " runs ", describe(peer),
                ". Every rank must issue the same collectives in the same order: run the same modules in forward "
                "and backward on every rank (a unit or bucket skipped on some ranks breaks this, and so does an "
                "exception in a forward or backward that some ranks caught and trained on)");
  }
}

void ShmTransport::wait_for_counters(Phase phase, uint32_t piece) {
  for (int64_t q = 0; q < world_size_; ++q) {
    if (q == rank_) continue;
    uint32_t* word = counter(q, phase);
    if (reached(load(word), piece)) continue;
    bool there = false;
    for (int spin = 0; spin < kSpinChecks && !there; ++spin) {
      PYDIST_CPU_RELAX();
      there = reached(load(word), piece);
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (!there) {
      const uint32_t seen = load(word);
      if (reached(seen, piece)) break;
      check_peer(q, phase, piece, deadline);
      futex_sleep(word, seen);
      there = reached(load(word), piece);
    }
  }
}

void ShmTransport::check_peer(int64_t peer, Phase phase, uint32_t piece,
                              std::chrono::steady_clock::time_point deadline) const {
  const char* step = phase == Phase::kStaged ? "stage" : "reduce";
  const std::string where = c10::str("shared-memory ", transport::collective_name(running_), " (", name_, "): rank ",
                                     rank_, " waited for rank ", peer, " to ", step, " piece ", piece, ", but ");
  check_not_aborted(where);
  const ShmRankBlock& block = segment_->ranks[peer];
  if (load(&block.state) == kDetached) {
    check_not_aborted(where);  // a rank that failed aborts before it detaches
    TORCH_CHECK(false, where, "rank ", peer,
                " has shut its end down (the wrapper that opened the transport was destroyed or its process is "
                "exiting; an error on that rank, if any, is the cause)");
  }
  if (block.pid_ns != 0 && block.pid_ns == segment_->ranks[rank_].pid_ns) {
    TORCH_CHECK(!process_gone(block.pid), where, "its process (pid ", block.pid, ") has exited");
  }
  TORCH_CHECK(!stopping_, where, "this rank is shutting its transport down");
  TORCH_CHECK(std::chrono::steady_clock::now() < deadline, where, "rank ", peer, " did not arrive within the timeout of ",
              timeout_.count(), " ms (ranks issuing collectives in different orders or sizes, or one stuck)");
}

void ShmTransport::abort(const std::string& why) {
  if (getpid() != owner_pid_ || closed_) return;  // a forked child's end, or one that has left
  mark_aborted(kNoCollective, why);
}

void ShmTransport::mark_aborted(uint32_t kind, const std::string& why) {
  ShmHeader* header = segment_->header;
  uint32_t none = 0;
  if (__atomic_compare_exchange_n(&header->abort_claim, &none, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    const size_t n = std::min(why.size(), sizeof(header->aborted_why) - 1);
    std::memcpy(header->aborted_why, why.data(), n);
    header->aborted_why[n] = '\0';
    store(&header->aborted_kind, kind);
    store(&header->aborted, static_cast<uint32_t>(rank_ + 1));  // release: kind and why are in place
  }
  for (int64_t q = 0; q < world_size_; ++q) {
    for (Phase phase : {Phase::kStaged, Phase::kReduced}) futex_wake_all(counter(q, phase));
  }
}

void ShmTransport::check_not_aborted(const std::string& where) const {
  const uint32_t aborted = load(&segment_->header->aborted);
  if (aborted == 0) return;
  const uint32_t kind = load(&segment_->header->aborted_kind);
  TORCH_CHECK(false, where, "rank ", aborted - 1, " failed",
              kind == kNoCollective ? "" : std::string(" ") + article_name(static_cast<transport::Collective>(kind)),
              " and aborted the transport: ", segment_->header->aborted_why);
}

}  // namespace pydist
