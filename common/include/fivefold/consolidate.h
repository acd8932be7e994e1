#pragma once
/// @file consolidate.h
/// @brief Named tensors held in pieces across ranks (a pipeline stage's layers, an
/// expert-parallel rank's experts), brought together into one map, for checkpoints and
/// comparisons that see the whole model.

#include <string>
#include <vector>

#include "fivefold/dist.h"
#include "fivefold/io.h"

namespace fivefold {

/// Every rank's `mine` in one map, on every rank of `comm` (collective). Ranks may hold different
/// names; a name held by several ranks (a tied embedding on the first and the last stage) is
/// taken from the lowest rank that holds it. Two all-gathers exchange the names, shapes and dtypes
/// (as JSON), then each tensor is broadcast from its rank. Costs the whole map's memory on every
/// rank: meant for checkpoints of the models this course trains.
io::TensorMap gather_named_tensors(const io::TensorMap& mine, dist::Communicator& comm);

/// Every rank's `mine`, in rank order, on every rank of `comm` (collective: two all-gathers, the
/// lengths then the bytes).
std::vector<std::string> all_gather_strings(const std::string& mine, dist::Communicator& comm);

}  // namespace fivefold
