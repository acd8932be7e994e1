// The heart of chapter 09: what happens when backward has produced a parameter's gradient.

#include "09_data_parallel/ddp.h"

namespace fivefold::ch09 {

void DistributedDataParallel::mark_ready(size_t index) {
  if (ready_[index]) return;  // a parameter's accumulator runs once per backward
  ready_[index] = true;
  ++ready_in_bucket_[bucket_of_[index]];
  // Launch complete buckets strictly in order, so every rank issues the same all-reduces in the
  // same order whatever order its hooks fire in.
  while (next_bucket_ < buckets_.size() &&
         ready_in_bucket_[next_bucket_] == static_cast<int64_t>(buckets_[next_bucket_].size())) {
    launch(next_bucket_++);
  }
}

}  // namespace fivefold::ch09
