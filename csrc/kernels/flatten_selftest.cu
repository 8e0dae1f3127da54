// Standalone self-test of the flatten kernels: checks them against the CPU
// reference (counting wrong bytes) and times flatten against one cudaMemcpy
// device-to-device copy of the same bytes. Needs a GPU to run, none to build:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc csrc/kernels/flatten_kernels.cu
//        csrc/kernels/flatten_selftest.cu -o flatten_selftest  (one line)
//   ./flatten_selftest
//
//   flatten_selftest                  the production kernel (kProductionVariant)
//   flatten_selftest --variant all    every FlattenVariant, production first:
//                                     correctness and a bandwidth table each
//   flatten_selftest --variant NAME   one (warp-ranges, block-ranges, ...)
//   flatten_selftest --host           no GPU: the wide piece copy emulated on
//                                     the CPU (emulate_piece_copy) for every
//                                     alignment; also run first by the others
//
// (CMakeLists.txt builds it as `flatten_selftest`;
// benchmarks/gpu_flatten_variants.sh runs `--variant all`.) Exits 1 when any
// byte is wrong or a CUDA call fails. Not part of the Python extension:
// setup.py leaves files ending _selftest.cu out.
#include "kernels/flatten_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

using pydist::kernels::FlattenVariant;
using pydist::kernels::ScaledType;
using pydist::kernels::Segment;

namespace {

namespace k = pydist::kernels;

// make_case's `skew` that gives tensor i the skew i % 16 (every alignment).
constexpr int kSkewEach16 = -1;

// A list of tensors carved from one device pool, with the table that says where
// each lands in the flat buffer. `skew` bytes are added to every other tensor's
// address (kSkewEach16: i % 16 to tensor i) to exercise every alignment.
struct Case {
  std::vector<int64_t> bytes;       // per tensor
  std::vector<int64_t> pool_at;     // per tensor: byte offset in the pool
  std::vector<Segment> host_table;  // device pointers, filled once the pool exists
  int64_t flat_bytes = 0;
  int64_t pool_bytes = 0;
};

// `count` tensors of min_elems..max_elems elements of `elem` bytes, each a
// multiple of `multiple` elements.
Case make_case(int count, int64_t min_elems, int64_t max_elems, int elem, int skew, std::mt19937_64& rng,
               int64_t multiple = 1) {
  Case c;
  std::uniform_int_distribution<int64_t> dist(min_elems / multiple, max_elems / multiple);
  for (int i = 0; i < count; ++i) {
    const int64_t b = dist(rng) * multiple * elem;
    const int s = skew == kSkewEach16 ? i % 16 : ((i % 2) ? skew : 0);
    c.bytes.push_back(b);
    c.pool_at.push_back(c.pool_bytes + s);
    c.pool_bytes += (b + s + 511) / 512 * 512;  // 512-byte aligned, like torch's caching allocator
    c.flat_bytes += b;
  }
  return c;
}

void fill_table(Case& c, char* pool) {
  c.host_table.clear();
  int64_t offset = 0;
  for (size_t i = 0; i < c.bytes.size(); ++i) {
    c.host_table.push_back({pool + c.pool_at[i], offset, c.bytes[i]});
    offset += c.bytes[i];
  }
}

// Byte patterns that are finite numbers in every floating type: small
// integers; any bytes for elem 1 (plain copies only).
void fill_values(std::vector<char>& buf, int elem, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> v(-64, 64);
  for (size_t i = 0; i + elem <= buf.size(); i += elem) {
    float f = static_cast<float>(v(rng)) * 0.375f;
    if (elem == 1) buf[i] = static_cast<char>(v(rng));
    if (elem == 4) std::memcpy(&buf[i], &f, 4);
    if (elem == 8) { double d = f; std::memcpy(&buf[i], &d, 8); }
    if (elem == 2) { __half h = __float2half_rn(f); std::memcpy(&buf[i], &h, 2); }
  }
}

int64_t count_wrong(const std::vector<char>& got, const std::vector<char>& want) {
  int64_t wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) wrong += got[i] != want[i];
  return wrong;
}

// Host copy of every tensor of `c`, gathered from the device pool.
int gather_tensors(const Case& c, std::vector<char>& out) {
  out.assign(c.flat_bytes, 0);
  for (const Segment& s : c.host_table)
    PYDIST_CUDA_CHECK_RETURN(cudaMemcpy(out.data() + s.offset, s.tensor, s.bytes, cudaMemcpyDeviceToHost), 1);
  return 0;
}

// Flatten and unflatten of `variant`: the production one through the
// launchers the torch ops call (they stage the table), the others through
// the staged entry points after one synchronous copy of the table.
cudaError_t run_flatten(FlattenVariant variant, const Case& c, void* flat, void* table) {
  const int64_t n = static_cast<int64_t>(c.host_table.size());
  if (variant == k::kProductionVariant) return k::launch_flatten(c.host_table.data(), n, flat, c.flat_bytes, table, 0);
  cudaError_t err = cudaMemcpy(table, c.host_table.data(), k::segment_table_bytes(n), cudaMemcpyHostToDevice);
  return err != cudaSuccess ? err : k::launch_flatten_staged(n, flat, c.flat_bytes, table, variant, 0);
}

cudaError_t run_unflatten(FlattenVariant variant, const Case& c, const void* flat, void* table) {
  const int64_t n = static_cast<int64_t>(c.host_table.size());
  if (variant == k::kProductionVariant) return k::launch_unflatten(c.host_table.data(), n, flat, c.flat_bytes, table, 0);
  cudaError_t err = cudaMemcpy(table, c.host_table.data(), k::segment_table_bytes(n), cudaMemcpyHostToDevice);
  return err != cudaSuccess ? err : k::launch_unflatten_staged(n, flat, c.flat_bytes, table, variant, 0);
}

struct Spec {
  const char* name;
  int count;
  int64_t lo, hi;     // elements per tensor
  ScaledType type;
  int skew;           // see make_case
  double scale;
  bool bytes_only;    // byte-sized elements, any length: plain copies only (no scaled check)
  int flat_shift;     // the flat buffer starts this many bytes past an aligned address (bytes_only)
};

// One correctness case: flatten, plain unflatten, scaled unflatten (the
// production kernel's; "-" for the other variants and for bytes_only).
// Returns the number of wrong bytes, or -1 on a CUDA error.
int64_t check_case(const Spec& spec, FlattenVariant variant, std::mt19937_64& rng) {
  const int elem = spec.bytes_only ? 1 : k::scaled_type_size(spec.type);
  Case c = make_case(spec.count, spec.lo, spec.hi, elem, spec.skew, rng);
  char *pool = nullptr, *flat_alloc = nullptr, *table = nullptr;
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&pool, c.pool_bytes + 1), -1);
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&flat_alloc, c.flat_bytes + spec.flat_shift + 1), -1);
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&table, k::segment_table_bytes(spec.count) + 1), -1);
  char* flat = flat_alloc + spec.flat_shift;
  fill_table(c, pool);

  // Flatten: tensors hold values, flat is compared to the CPU reference.
  std::vector<char> values(c.flat_bytes), want(c.flat_bytes), got;
  fill_values(values, elem, rng);
  for (const Segment& s : c.host_table)
    PYDIST_CUDA_CHECK_RETURN(cudaMemcpy(s.tensor, values.data() + s.offset, s.bytes, cudaMemcpyHostToDevice), -1);
  std::vector<Segment> host_view = c.host_table;  // the same table over host memory, for the reference
  for (Segment& s : host_view) s.tensor = values.data() + s.offset;
  k::reference_flatten(host_view.data(), spec.count, want.data());
  PYDIST_CUDA_CHECK_RETURN(cudaMemset(flat_alloc, 0, c.flat_bytes + spec.flat_shift + 1), -1);
  PYDIST_CUDA_CHECK_RETURN(run_flatten(variant, c, flat, table), -1);
  got.resize(c.flat_bytes);
  PYDIST_CUDA_CHECK_RETURN(cudaMemcpy(got.data(), flat, c.flat_bytes, cudaMemcpyDeviceToHost), -1);
  const int64_t wrong_flatten = count_wrong(got, want);

  // Unflatten, plain: tensors zeroed, then must equal the flat bytes again.
  PYDIST_CUDA_CHECK_RETURN(cudaMemset(pool, 0, c.pool_bytes), -1);
  PYDIST_CUDA_CHECK_RETURN(run_unflatten(variant, c, flat, table), -1);
  if (gather_tensors(c, got)) return -1;
  const int64_t wrong_unflatten = count_wrong(got, want);

  // Unflatten, scaled: against the CPU reference in the same opmath.
  int64_t wrong_scaled = -1;
  if (!spec.bytes_only && variant == k::kProductionVariant) {
    std::vector<char> scaled(c.flat_bytes);
    for (Segment& s : host_view) s.tensor = scaled.data() + s.offset;
    k::reference_unflatten_scaled(host_view.data(), spec.count, want.data(), spec.type, spec.scale);
    PYDIST_CUDA_CHECK_RETURN(k::launch_unflatten_scaled(c.host_table.data(), spec.count, flat, c.flat_bytes, spec.type,
                                                        spec.scale, table, 0), -1);
    if (gather_tensors(c, got)) return -1;
    wrong_scaled = count_wrong(got, scaled);
  }

  char scaled_col[24] = "-";
  if (wrong_scaled >= 0) std::snprintf(scaled_col, sizeof(scaled_col), "%lld", static_cast<long long>(wrong_scaled));
  std::printf("%-30s %8d %12lld %6d %6d %10lld %10lld %10s\n", spec.name, spec.count,
              static_cast<long long>(c.flat_bytes), spec.skew, spec.flat_shift, static_cast<long long>(wrong_flatten),
              static_cast<long long>(wrong_unflatten), scaled_col);
  cudaFree(pool);
  cudaFree(flat_alloc);
  cudaFree(table);
  return wrong_flatten + wrong_unflatten + (wrong_scaled > 0 ? wrong_scaled : 0);
}

// Times `reps` calls of fn on stream 0 with events, three rounds; returns the
// best round's microseconds per call.
template <typename Fn>
float time_us(Fn fn, int reps) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 3; ++i) fn();  // warm up
  float best = -1;
  for (int round = 0; round < 3; ++round) {
    cudaEventRecord(start, 0);
    for (int i = 0; i < reps; ++i) fn();
    cudaEventRecord(stop, 0);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    const float us = ms * 1000.0f / reps;
    if (best < 0 || us < best) best = us;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

// One bandwidth row: `count` float32 tensors of lo..hi elements (multiples
// of `multiple` elements), the same tensors for every variant (rng seeded by
// `seed`). flat(us) is the launcher as the torch ops call it (table staged
// from pageable memory, then the kernel), kern(us) the kernel alone on a
// staged table. GB/s counts bytes read plus bytes written, as the CPU
// benchmark does; ratio = d2d time / flat time, kratio = d2d / kern.
struct Row {
  const char* label;
  int count;
  int64_t lo, hi, multiple;
  bool unflatten;
};

// *kratio_out = d2d / kern; *ratio_out = d2d / flat (0 where not timed).
int bench_row(const Row& row, FlattenVariant variant, uint64_t seed, double* kratio_out, double* ratio_out) {
  std::mt19937_64 rng(seed);
  Case c = make_case(row.count, row.lo, row.hi, 4, 0, rng, row.multiple);
  char *pool = nullptr, *flat = nullptr, *table = nullptr, *copy_src = nullptr;
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&pool, c.pool_bytes), 1);
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&flat, c.flat_bytes), 1);
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&copy_src, c.flat_bytes), 1);
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&table, k::segment_table_bytes(row.count)), 1);
  fill_table(c, pool);
  const int64_t n = row.count;
  cudaError_t err = cudaSuccess;
  const int reps = 20;
  auto keep = [&](cudaError_t e) { if (e != cudaSuccess && err == cudaSuccess) err = e; };
  float flat_us = 0;
  if (variant == k::kProductionVariant) {
    flat_us = time_us([&] {
      keep(row.unflatten ? k::launch_unflatten(c.host_table.data(), n, flat, c.flat_bytes, table, 0)
                         : k::launch_flatten(c.host_table.data(), n, flat, c.flat_bytes, table, 0));
    }, reps);
  }
  PYDIST_CUDA_CHECK_RETURN(
      cudaMemcpy(table, c.host_table.data(), k::segment_table_bytes(n), cudaMemcpyHostToDevice), 1);
  const float kern_us = time_us([&] {
    keep(row.unflatten ? k::launch_unflatten_staged(n, flat, c.flat_bytes, table, variant, 0)
                       : k::launch_flatten_staged(n, flat, c.flat_bytes, table, variant, 0));
  }, reps);
  const float copy_us = time_us([&] {
    keep(cudaMemcpyAsync(flat, copy_src, c.flat_bytes, cudaMemcpyDeviceToDevice, 0));
  }, reps);
  PYDIST_CUDA_CHECK_RETURN(err, 1);
  PYDIST_CUDA_CHECK_RETURN(cudaDeviceSynchronize(), 1);
  const double rw = 2.0 * static_cast<double>(c.flat_bytes);
  char flat_col[16] = "-", ratio_col[16] = "-";
  if (flat_us > 0) {
    std::snprintf(flat_col, sizeof(flat_col), "%.1f", flat_us);
    std::snprintf(ratio_col, sizeof(ratio_col), "%.2f", copy_us / flat_us);
  }
  std::printf("%-12s %7d %12lld %9s %9.1f %10.1f %9.1f %10.1f %7s %7.2f\n", row.label, row.count,
              static_cast<long long>(c.flat_bytes), flat_col, kern_us, rw / kern_us / 1e3, copy_us, rw / copy_us / 1e3,
              ratio_col, copy_us / kern_us);
  *kratio_out = copy_us / kern_us;
  *ratio_out = flat_us > 0 ? copy_us / flat_us : 0;
  cudaFree(pool);
  cudaFree(flat);
  cudaFree(copy_src);
  cudaFree(table);
  return 0;
}

// --- the host emulation (no GPU) --------------------------------------------------

// emulate_piece_copy for every source and destination alignment modulo 16,
// lengths around the wide threshold and the trip sizes, 4 and 8 vectors a
// lane per trip (kWarpRanges, kWarpRangesU8*), teams of 1, 2 and 8
// warps: every byte must arrive, no byte outside the piece may change, and
// the split must hold (see emulate_piece_copy). Returns wrong bytes plus
// violations.
int64_t host_check() {
  const int64_t lengths[] = {0, 1, 15, 16, 17, 31, 255, 256, 257, 300, 511, 512, 527, 1000, 2047, 2048,
                             2049, 2064, 4095, 4096, 4111, 6000, 16400};
  const int warps[] = {1, 2, 8};
  const int unrolls[] = {4, 8};  // production, kWarpRangesU8*
  constexpr int64_t kCap = 16400 + 64;
  std::vector<uint4> src_store(kCap / 16 + 2), dst_store(kCap / 16 + 2);  // 16-byte aligned
  char* src_base = reinterpret_cast<char*>(src_store.data());
  char* dst_base = reinterpret_cast<char*>(dst_store.data());
  std::mt19937_64 rng(99);
  for (size_t i = 0; i < src_store.size() * 16; ++i) src_base[i] = static_cast<char>(rng());
  int64_t wrong = 0, cases = 0;
  for (int unroll : unrolls)
    for (int w : warps)
      for (int64_t n : lengths)
        for (int ds = 0; ds < 16; ++ds)
          for (int ss = 0; ss < 16; ++ss) {
            std::memset(dst_base, 0x5a, dst_store.size() * 16);
            wrong += k::emulate_piece_copy(dst_base + ds, src_base + ss, n, w, unroll);
            for (int64_t i = 0; i < static_cast<int64_t>(dst_store.size() * 16); ++i) {
              const bool inside = i >= ds && i < ds + n;
              wrong += dst_base[i] != (inside ? src_base[ss + i - ds] : static_cast<char>(0x5a));
            }
            ++cases;
          }
  std::printf("# host emulation of the wide piece copy: %lld cases, %lld wrong bytes or violations\n",
              static_cast<long long>(cases), static_cast<long long>(wrong));
  return wrong;
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--host | --variant all|", argv0);
  for (int v = 0; v < k::kFlattenVariants; ++v)
    std::fprintf(stderr, "%s%s", v ? "|" : "", k::flatten_variant_name(static_cast<FlattenVariant>(v)));
  std::fprintf(stderr, "]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  bool host_only = false;
  std::vector<FlattenVariant> variants = {k::kProductionVariant};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--host") == 0) {
      host_only = true;
    } else if (std::strcmp(argv[i], "--variant") == 0 && i + 1 < argc) {
      const char* name = argv[++i];
      variants.clear();
      for (int v = 0; v < k::kFlattenVariants; ++v)
        if (std::strcmp(name, "all") == 0 || std::strcmp(name, k::flatten_variant_name(static_cast<FlattenVariant>(v))) == 0)
          variants.push_back(static_cast<FlattenVariant>(v));
      if (variants.empty()) return usage(argv[0]);
      // The production variant first: the table's first block is what the torch ops run.
      std::stable_partition(variants.begin(), variants.end(),
                            [](FlattenVariant v) { return v == k::kProductionVariant; });
    } else {
      return usage(argv[0]);
    }
  }
  const int64_t host_wrong = host_check();
  if (host_only) return host_wrong == 0 ? 0 : 1;

  int device = 0;
  cudaDeviceProp prop;
  PYDIST_CUDA_CHECK_RETURN(cudaGetDevice(&device), 1);
  PYDIST_CUDA_CHECK_RETURN(cudaGetDeviceProperties(&prop, device), 1);
  std::printf("# flatten_selftest on %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);

  const Spec specs[] = {
      {"f32 aligned, 1/8", 100, 256, 65536, ScaledType::kFloat32, 0, 0.125, false, 0},
      {"f32 odd sizes, 1/3", 1000, 1, 999, ScaledType::kFloat32, 0, 1.0 / 3.0, false, 0},
      {"f32 skewed 4B, 1/3", 300, 1, 5000, ScaledType::kFloat32, 4, 1.0 / 3.0, false, 0},
      {"f64 odd sizes, 1/7", 500, 1, 3000, ScaledType::kFloat64, 8, 1.0 / 7.0, false, 0},
      {"f16 odd sizes, 1/3", 500, 1, 3000, ScaledType::kFloat16, 2, 1.0 / 3.0, false, 0},
      {"bf16 odd sizes, 1/3", 500, 1, 3000, ScaledType::kBFloat16, 6, 1.0 / 3.0, false, 0},
      {"f32 10000 tiny, 1/4", 10000, 0, 40, ScaledType::kFloat32, 0, 0.25, false, 0},
      {"f32 one huge, 1/3", 1, 1 << 24, 1 << 24, ScaledType::kFloat32, 0, 1.0 / 3.0, false, 0},
      {"bytes, every skew", 700, 0, 9000, ScaledType::kFloat32, kSkewEach16, 1.0, true, 0},
      {"bytes, every skew, flat+3", 700, 0, 9000, ScaledType::kFloat32, kSkewEach16, 1.0, true, 3},
      {"bytes, every skew, flat+13", 300, 200, 70000, ScaledType::kFloat32, kSkewEach16, 1.0, true, 13},
      {"bytes, 5000 tiny, flat+7", 5000, 0, 300, ScaledType::kFloat32, kSkewEach16, 1.0, true, 7},
  };
  const Row rows[] = {
      {"flatten", 10, 256, 65536, 1, false},      {"flatten", 100, 256, 65536, 1, false},
      {"flatten", 1000, 256, 65536, 1, false},    {"flatten", 2000, 256, 65536, 1, false},
      {"flatten", 10000, 256, 65536, 1, false},   {"flatten-a16", 2000, 256, 65536, 4, false},
      {"unflatten", 2000, 256, 65536, 1, true},   {"flat-small", 20000, 1, 2000, 1, false},
  };
  int64_t wrong = host_wrong;
  // Per variant: kratio at 2000 and 10000 tensors and at 2000 aligned ones, ratio (launcher) at 2000.
  std::vector<double> ratio_2000(variants.size()), ratio_10000(variants.size()), ratio_a16(variants.size()),
      launcher_2000(variants.size());
  for (size_t vi = 0; vi < variants.size(); ++vi) {
    const FlattenVariant variant = variants[vi];
    std::printf("#\n# === variant %s%s ===\n", k::flatten_variant_name(variant),
                variant == k::kProductionVariant ? " (production)" : "");
    std::printf("# correctness: wrong bytes vs the CPU reference\n");
    std::printf("%-30s %8s %12s %6s %6s %10s %10s %10s\n", "# case", "count", "bytes", "skew", "flat+", "#flatten",
                "#unflatten", "#scaled");
    std::mt19937_64 rng(1234);
    for (const Spec& s : specs) {
      int64_t w = check_case(s, variant, rng);
      if (w < 0) return 1;
      wrong += w;
    }
    std::printf("# bandwidth: float32 tensors (256-64k elements; flat-small: 1-2000) vs one D2D cudaMemcpy\n");
    std::printf("# GB/s counts bytes read + written; flat(us) and ratio include staging the table (production "
                "launcher only), kern(us) and kratio the kernel alone\n");
    std::printf("%-12s %7s %12s %9s %9s %10s %9s %10s %7s %7s\n", "# row", "count", "bytes", "flat(us)", "kern(us)",
                "kern GB/s", "d2d(us)", "d2d GB/s", "ratio", "kratio");
    for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); ++r) {
      double ratio = 0, launcher = 0;
      if (bench_row(rows[r], variant, 1000 + r, &ratio, &launcher)) return 1;
      if (r == 3) ratio_2000[vi] = ratio, launcher_2000[vi] = launcher;
      if (r == 4) ratio_10000[vi] = ratio;
      if (r == 5) ratio_a16[vi] = ratio;
    }
  }
  std::printf("#\n# summary: D2D copy time / kernel time (kratio; target >= 0.85); the last column with the\n"
              "# table staged as the torch ops do (ratio; production launcher only)\n");
  std::printf("%-20s %10s %10s %14s %16s\n", "# variant", "2000", "10000", "2000 aligned", "2000 launcher");
  for (size_t vi = 0; vi < variants.size(); ++vi) {
    char launcher[16] = "-";
    if (launcher_2000[vi] > 0) std::snprintf(launcher, sizeof(launcher), "%.2f", launcher_2000[vi]);
    std::printf("%-20s %10.2f %10.2f %14.2f %16s\n", k::flatten_variant_name(variants[vi]), ratio_2000[vi],
                ratio_10000[vi], ratio_a16[vi], launcher);
  }
  std::printf("#\n# %s: %lld wrong bytes\n", wrong == 0 ? "PASSED" : "FAILED", static_cast<long long>(wrong));
  return wrong == 0 ? 0 : 1;
}
