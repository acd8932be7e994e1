#pragma once
/// @file parallel.h
/// @brief The fast paths' loops on ATen's threads (runtime/src: avx512.cpp, rows.cpp, fast.cpp,
/// matmul.cpp).
///
/// Why not at::parallel_for: it is a header template whose parallel region is an
/// `#pragma omp parallel` compiled into the caller, and only where the caller is compiled with
/// OpenMP (_OPENMP); this project's sources are not, so at::parallel_for runs its whole range on
/// the calling thread. Compiling them with OpenMP would not help either: clang (the presets'
/// compiler) emits calls into LLVM's libomp, a second pool of threads beside the libgomp that
/// Debian's LibTorch and oneDNN run on, and two pools spinning on two cores slow each other.
/// parallel_chunks opens its region through libgomp's own entry point, GOMP_parallel (what GCC
/// emits for `#pragma omp parallel`), found in the process at run time: the same team of threads
/// as ATen's operations, the same count (at::set_num_threads). Where the process has no libgomp,
/// the range runs on the calling thread (as at::parallel_for does in this project's sources).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace fivefold::runtime {

/// What a parallel region runs: body(data) on every thread of the team; the thread's number
/// and the team's size from thread_number() and team_size() inside it.
using RegionBody = void (*)(void* data);

/// Runs body(data) on every thread of libgomp's team (ATen's threads) and returns when all have;
/// false (nothing run) where the process has no libgomp.
bool run_parallel_region(RegionBody body, void* data);
/// Inside a region: this thread's number (0 the caller).
int thread_number();
/// Inside a region: how many threads its team has.
int team_size();

/// f(first, last) over [begin, end) split into one contiguous chunk per thread of ATen's team
/// (fewer where a chunk would fall under `grain` numbers), as at::parallel_for splits it; the
/// whole range on the calling thread when it is one grain or less, inside another parallel
/// region, or with no libgomp. Inside f, at::get_thread_num() is the thread's number, as under
/// at::parallel_for. f must not throw.
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  struct Job {
    int64_t begin, end, grain;
    const F* f;
  } job{begin, end, std::max<int64_t>(grain, 1), &f};
  auto body = [](void* data) {
    const Job& j = *static_cast<const Job*>(data);
    const int64_t n = j.end - j.begin;
    const int64_t threads = std::min<int64_t>(team_size(), (n + j.grain - 1) / j.grain);
    const int64_t chunk = (n + threads - 1) / threads, first = j.begin + thread_number() * chunk;
    if (thread_number() < threads && first < j.end) {
      const at::internal::ThreadIdGuard id(thread_number());  // at::get_thread_num() inside f
      (*j.f)(first, std::min(j.end, first + chunk));
    }
  };
  if (end - begin <= job.grain || at::get_num_threads() == 1 || at::in_parallel_region() ||
      !run_parallel_region(body, &job)) {
    f(begin, end);
  }
}

}  // namespace fivefold::runtime
