// A counting CPU allocator: wraps LibTorch's default one and keeps the live and peak byte counts.

#include "fivefold/memory.h"

#include <c10/core/CPUAllocator.h>
#include <sys/resource.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#include "fivefold/error.h"

namespace fivefold {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_largest{0};  // the largest single allocation
std::atomic<bool> g_installed{false};
std::atomic<uint64_t> g_generation{0};  // which tracker an allocation belongs to

// Live tracked allocations: pointer -> its bytes, the default allocator's deleter, and the
// generation of the tracker that counted it (a later tracker must not subtract it). The data
// pointer doubles as the context, as LibTorch's own CPU allocator does: some kernels rely on it
// (Allocator::raw_allocate asserts data == context).
std::mutex g_mutex;
struct Allocation {
  int64_t bytes;
  c10::DeleterFnPtr free_data;
  uint64_t generation;
};

std::unordered_map<void*, Allocation>& live() {
  static auto* table = new std::unordered_map<void*, Allocation>();
  return *table;  // never destroyed: storage may be freed during static destruction
}

void release(void* data) {
  Allocation entry;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = live().find(data);
    if (it == live().end()) return;  // cannot happen: every pointer we hand out is recorded
    entry = it->second;
    live().erase(it);
  }
  if (entry.generation == g_generation.load()) g_current -= entry.bytes;
  entry.free_data(data);  // free through the default allocator
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) const override {
    c10::DataPtr inner = c10::GetDefaultCPUAllocator()->allocate(bytes);
    void* data = inner.get();
    const c10::DeleterFnPtr free_data = inner.get_deleter();
    inner.release_context();  // we free it ourselves, in release()
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      live()[data] = {static_cast<int64_t>(bytes), free_data, g_generation.load()};
    }
    const int64_t now = (g_current += static_cast<int64_t>(bytes));
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
    }
    int64_t largest = g_largest.load();
    while (static_cast<int64_t>(bytes) > largest &&
           !g_largest.compare_exchange_weak(largest, static_cast<int64_t>(bytes))) {
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
};

CountingAllocator g_counting;
c10::Allocator* g_previous = nullptr;
constexpr uint8_t kPriority = 100;  // above the default's, so SetCPUAllocator takes it

}  // namespace

MemoryTracker::MemoryTracker() {
  FIVEFOLD_CHECK(!g_installed.exchange(true), "MemoryTracker: only one may be alive at a time");
  g_generation += 1;  // allocations of earlier trackers no longer count
  g_current = 0;
  g_peak = 0;
  g_largest = 0;
  g_previous = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&g_counting, kPriority);
}

MemoryTracker::~MemoryTracker() {
  c10::SetCPUAllocator(g_previous, kPriority);  // same priority: allowed to replace it back
  g_installed = false;
}

int64_t MemoryTracker::current_bytes() const { return g_current.load(); }

int64_t MemoryTracker::peak_bytes() const { return g_peak.load(); }

void MemoryTracker::reset_peak() {
  g_peak = g_current.load();
  g_largest = 0;
}

int64_t MemoryTracker::largest_allocation_bytes() const { return g_largest.load(); }

int64_t peak_resident_bytes() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

}  // namespace fivefold
