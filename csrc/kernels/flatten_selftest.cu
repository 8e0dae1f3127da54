// Standalone self-test of the flatten kernels: checks them against the CPU
// reference (counting wrong bytes) and times flatten against one cudaMemcpy
// device-to-device copy of the same bytes. Needs a GPU to run, none to build:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc csrc/kernels/flatten_kernels.cu \
//        csrc/kernels/flatten_selftest.cu -o flatten_selftest && ./flatten_selftest
//
// (CMakeLists.txt builds it as `flatten_selftest`.) Exits 1 when any byte is
// wrong or a CUDA call fails. Not part of the Python extension: setup.py
// leaves files ending _selftest.cu out.
#include "kernels/flatten_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

using pydist::kernels::ScaledType;
using pydist::kernels::Segment;

namespace {

// A list of tensors carved from one device pool, with the table that says where
// each lands in the flat buffer. `skew` bytes are added to every other tensor's
// address to exercise the narrower load widths.
struct Case {
  std::vector<int64_t> bytes;       // per tensor
  std::vector<int64_t> pool_at;     // per tensor: byte offset in the pool
  std::vector<Segment> host_table;  // device pointers, filled once the pool exists
  int64_t flat_bytes = 0;
  int64_t pool_bytes = 0;
};

Case make_case(int count, int64_t min_elems, int64_t max_elems, int elem, int skew, std::mt19937_64& rng) {
  Case c;
  std::uniform_int_distribution<int64_t> dist(min_elems, max_elems);
  for (int i = 0; i < count; ++i) {
    int64_t b = dist(rng) * elem;
    c.bytes.push_back(b);
    c.pool_at.push_back(c.pool_bytes + ((i % 2) ? skew : 0));
    c.pool_bytes += (b + skew + 511) / 512 * 512;  // 512-byte aligned, like torch's caching allocator
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

// Byte patterns that are finite numbers in every floating type: small integers.
void fill_values(std::vector<char>& buf, int elem, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> v(-64, 64);
  for (size_t i = 0; i + elem <= buf.size(); i += elem) {
    float f = static_cast<float>(v(rng)) * 0.375f;
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
int gather_tensors(const Case& c, const char* pool, std::vector<char>& out) {
  out.assign(c.flat_bytes, 0);
  for (const Segment& s : c.host_table)
    PYDIST_CUDA_CHECK_RETURN(cudaMemcpy(out.data() + s.offset, s.tensor, s.bytes, cudaMemcpyDeviceToHost), 1);
  return 0;
}

// One correctness case: flatten, plain unflatten, scaled unflatten. Returns the
// number of wrong bytes, or -1 on a CUDA error.
int64_t check_case(const char* name, int count, int64_t lo, int64_t hi, ScaledType type, int skew, double scale,
                   std::mt19937_64& rng) {
  const int elem = pydist::kernels::scaled_type_size(type);
  Case c = make_case(count, lo, hi, elem, skew, rng);
  char *pool = nullptr, *flat = nullptr, *table = nullptr;
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&pool, c.pool_bytes + 1), -1);
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&flat, c.flat_bytes + 1), -1);
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&table, pydist::kernels::segment_table_bytes(count) + 1), -1);
  fill_table(c, pool);

  // Flatten: tensors hold values, flat is compared to the CPU reference.
  std::vector<char> values(c.flat_bytes), want(c.flat_bytes), got;
  fill_values(values, elem, rng);
  for (const Segment& s : c.host_table)
    PYDIST_CUDA_CHECK_RETURN(cudaMemcpy(s.tensor, values.data() + s.offset, s.bytes, cudaMemcpyHostToDevice), -1);
  std::vector<Segment> host_view = c.host_table;  // the same table over host memory, for the reference
  for (Segment& s : host_view) s.tensor = values.data() + s.offset;
  pydist::kernels::reference_flatten(host_view.data(), count, want.data());
  PYDIST_CUDA_CHECK_RETURN(pydist::kernels::launch_flatten(c.host_table.data(), count, flat, c.flat_bytes, table, 0), -1);
  got.resize(c.flat_bytes);
  PYDIST_CUDA_CHECK_RETURN(cudaMemcpy(got.data(), flat, c.flat_bytes, cudaMemcpyDeviceToHost), -1);
  const int64_t wrong_flatten = count_wrong(got, want);

  // Unflatten, plain: tensors zeroed, then must equal the flat bytes again.
  PYDIST_CUDA_CHECK_RETURN(cudaMemset(pool, 0, c.pool_bytes), -1);
  PYDIST_CUDA_CHECK_RETURN(pydist::kernels::launch_unflatten(c.host_table.data(), count, flat, c.flat_bytes, table, 0), -1);
  if (gather_tensors(c, pool, got)) return -1;
  const int64_t wrong_unflatten = count_wrong(got, want);

  // Unflatten, scaled: against the CPU reference in the same opmath.
  std::vector<char> scaled(c.flat_bytes);
  for (Segment& s : host_view) s.tensor = scaled.data() + s.offset;
  pydist::kernels::reference_unflatten_scaled(host_view.data(), count, want.data(), type, scale);
  PYDIST_CUDA_CHECK_RETURN(pydist::kernels::launch_unflatten_scaled(c.host_table.data(), count, flat, c.flat_bytes,
                                                                    type, scale, table, 0), -1);
  if (gather_tensors(c, pool, got)) return -1;
  const int64_t wrong_scaled = count_wrong(got, scaled);

  std::printf("%-28s %8d %12lld %6d %10lld %10lld %10lld\n", name, count, static_cast<long long>(c.flat_bytes), skew,
              static_cast<long long>(wrong_flatten), static_cast<long long>(wrong_unflatten),
              static_cast<long long>(wrong_scaled));
  cudaFree(pool);
  cudaFree(flat);
  cudaFree(table);
  return wrong_flatten + wrong_unflatten + wrong_scaled;
}

// Times `reps` calls of fn on stream 0 with events; returns microseconds per call.
template <typename Fn>
float time_us(Fn fn, int reps) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 3; ++i) fn();  // warm up
  cudaEventRecord(start, 0);
  for (int i = 0; i < reps; ++i) fn();
  cudaEventRecord(stop, 0);
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms * 1000.0f / reps;
}

// Bandwidth row: `count` float32 tensors of lo..hi elements. GB/s counts bytes
// read plus bytes written, as the CPU benchmark does.
int bench_row(int count, int64_t lo, int64_t hi, std::mt19937_64& rng) {
  Case c = make_case(count, lo, hi, 4, 0, rng);
  char *pool = nullptr, *flat = nullptr, *table = nullptr, *copy_src = nullptr;
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&pool, c.pool_bytes), 1);
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&flat, c.flat_bytes), 1);
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&copy_src, c.flat_bytes), 1);
  PYDIST_CUDA_CHECK_RETURN(cudaMalloc(&table, pydist::kernels::segment_table_bytes(count)), 1);
  fill_table(c, pool);
  cudaError_t err = cudaSuccess;
  const int reps = 20;
  float flat_us = time_us([&] {
    cudaError_t e = pydist::kernels::launch_flatten(c.host_table.data(), count, flat, c.flat_bytes, table, 0);
    if (e != cudaSuccess) err = e;
  }, reps);
  float copy_us = time_us([&] {
    cudaError_t e = cudaMemcpyAsync(flat, copy_src, c.flat_bytes, cudaMemcpyDeviceToDevice, 0);
    if (e != cudaSuccess) err = e;
  }, reps);
  PYDIST_CUDA_CHECK_RETURN(err, 1);
  PYDIST_CUDA_CHECK_RETURN(cudaDeviceSynchronize(), 1);
  const double rw = 2.0 * static_cast<double>(c.flat_bytes);
  std::printf("%8d %12lld %10.1f %10.1f %10.1f %10.1f %8.2f\n", count, static_cast<long long>(c.flat_bytes), flat_us,
              rw / flat_us / 1e3, copy_us, rw / copy_us / 1e3, copy_us / flat_us);
  cudaFree(pool);
  cudaFree(flat);
  cudaFree(copy_src);
  cudaFree(table);
  return 0;
}

}  // namespace

int main() {
  int device = 0;
  cudaDeviceProp prop;
  PYDIST_CUDA_CHECK_RETURN(cudaGetDevice(&device), 1);
  PYDIST_CUDA_CHECK_RETURN(cudaGetDeviceProperties(&prop, device), 1);
  std::printf("# flatten_selftest on %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  std::mt19937_64 rng(1234);

  std::printf("#\n# correctness: wrong bytes vs the CPU reference\n");
  std::printf("%-28s %8s %12s %6s %10s %10s %10s\n", "# case", "count", "bytes", "skew", "#flatten", "#unflatten",
              "#scaled");
  struct Spec { const char* name; int count; int64_t lo, hi; ScaledType type; int skew; double scale; };
  const Spec specs[] = {
      {"f32 aligned, 1/8", 100, 256, 65536, ScaledType::kFloat32, 0, 0.125},
      {"f32 odd sizes, 1/3", 1000, 1, 999, ScaledType::kFloat32, 0, 1.0 / 3.0},
      {"f32 skewed 4B, 1/3", 300, 1, 5000, ScaledType::kFloat32, 4, 1.0 / 3.0},
      {"f64 odd sizes, 1/7", 500, 1, 3000, ScaledType::kFloat64, 8, 1.0 / 7.0},
      {"f16 odd sizes, 1/3", 500, 1, 3000, ScaledType::kFloat16, 2, 1.0 / 3.0},
      {"bf16 odd sizes, 1/3", 500, 1, 3000, ScaledType::kBFloat16, 6, 1.0 / 3.0},
      {"f32 10000 tiny, 1/4", 10000, 0, 40, ScaledType::kFloat32, 0, 0.25},
      {"f32 one huge, 1/3", 1, 1 << 24, 1 << 24, ScaledType::kFloat32, 0, 1.0 / 3.0},
  };
  int64_t wrong = 0;
  for (const Spec& s : specs) {
    int64_t w = check_case(s.name, s.count, s.lo, s.hi, s.type, s.skew, s.scale, rng);
    if (w < 0) return 1;
    wrong += w;
  }

  std::printf("#\n# bandwidth: flatten of float32 tensors of 256-64k elements vs one D2D cudaMemcpy\n");
  std::printf("# GB/s counts bytes read + bytes written\n");
  std::printf("%8s %12s %10s %10s %10s %10s %8s\n", "# count", "bytes", "flat(us)", "flat GB/s", "d2d(us)", "d2d GB/s",
              "ratio");
  const int counts[] = {10, 100, 1000, 2000, 10000};
  for (int count : counts)
    if (bench_row(count, 256, 65536, rng)) return 1;

  std::printf("#\n# %s: %lld wrong bytes\n", wrong == 0 ? "PASSED" : "FAILED", static_cast<long long>(wrong));
  return wrong == 0 ? 0 : 1;
}
