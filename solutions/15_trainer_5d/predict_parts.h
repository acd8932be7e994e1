#pragma once
// Chapter 15's predictions, the parts their files share (predict.cpp, traffic.cpp): not part of
// the chapter's contract (predict.h).
#include <cstdint>
#include <vector>

#include "15_trainer_5d/predict.h"

namespace fivefold::ch15 {

// What one rank of a layout computes on in a step of `run`.
struct RankWork {
  Layout::Place at;
  int64_t rows = 0;             // its data-parallel rank's rows, all micro-batches
  int64_t cp_positions = 0;     // the positions of each row: its cp slice, what tp gathers
  int64_t positions = 0;        // of those, under sequence parallelism its tp part (else all)
  std::vector<int64_t> layers;  // the layers of its virtual stages
  bool first_stage = false;     // holds the embedding
  bool last_stage = false;      // holds the head
};

// The rank `world_rank` of `layout`'s share of a step of `run`.
RankWork work_of(const Layout& layout, const Workload& run, int64_t world_rank);

// ZeRO-3's S: each unit's elements padded to a multiple of the n data-parallel ranks, summed.
int64_t padded_units(const HeldParameters& held, int64_t n);

}  // namespace fivefold::ch15
