#pragma once
/// @file memory.h
/// @brief Measured memory: the bytes of CPU tensor storage allocated while a MemoryTracker is
/// alive and not yet freed, and their peak. Chapters compare these with their memory formulas
/// (activations kept for backward, ZeRO's sharded states).

#include <cstdint>

namespace fivefold {

/// Installs a counting CPU allocator for its lifetime. Counts storages allocated while it is
/// alive (their bytes exactly as requested) until they are freed, whenever that happens. Storage
/// allocated before it was created is not counted. One tracker may be alive at a time.
class MemoryTracker {
 public:
  MemoryTracker();
  ~MemoryTracker();
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;
  /// Bytes allocated since construction and still alive.
  int64_t current_bytes() const;
  /// Highest current_bytes() since construction or the last reset_peak().
  int64_t peak_bytes() const;
  /// The largest single storage allocated since construction or the last reset_peak() (chapter
  /// 10: the full logits never exist on a tensor-parallel rank).
  int64_t largest_allocation_bytes() const;
  /// Sets the peak to the current value, and forgets the largest allocation.
  void reset_peak();
};

/// The process's peak resident memory so far (the operating system's high-water mark: tensors,
/// LibTorch's own and MPI's buffers, code), in bytes. What the trainer reports per rank.
int64_t peak_resident_bytes();

}  // namespace fivefold
