// libgomp's parallel region for the fast paths' loops (runtime/parallel.h): its entry points looked
// up once in the process (dlsym), where LibTorch has already loaded the library.

#include "runtime/parallel.h"

#include <dlfcn.h>

namespace fivefold::runtime {

namespace {

// libgomp's ABI (GCC's OpenMP runtime, stable since GCC 4.9): GOMP_parallel(fn, data,
// num_threads, flags) runs fn(data) on a team (num_threads 0: the team omp_set_num_threads
// chose) and returns when every thread has; omp_get_thread_num and omp_get_num_threads inside.
struct Gomp {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
};

const Gomp& gomp() {
  static const Gomp found = [] {
    Gomp g;
    g.parallel = reinterpret_cast<decltype(g.parallel)>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
    g.thread_num =
        reinterpret_cast<decltype(g.thread_num)>(dlsym(RTLD_DEFAULT, "omp_get_thread_num"));
    g.num_threads =
        reinterpret_cast<decltype(g.num_threads)>(dlsym(RTLD_DEFAULT, "omp_get_num_threads"));
    if (!g.parallel || !g.thread_num || !g.num_threads) g = Gomp{};
    return g;
  }();
  return found;
}

}  // namespace

bool run_parallel_region(RegionBody body, void* data) {
  const Gomp& g = gomp();
  if (g.parallel == nullptr) return false;
  // Team size 0: the team ATen's operations get (num_threads would rebuild libgomp's pool at each
  // change of size, which is why ATen never passes it either).
  g.parallel(body, data, 0, 0);
  return true;
}

int thread_number() { return gomp().thread_num(); }

int team_size() { return gomp().num_threads(); }

}  // namespace fivefold::runtime
