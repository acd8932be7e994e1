#pragma once
/// @file consolidate.h
/// @brief Named tensors held in pieces across ranks (a pipeline stage's layers, an
/// expert-parallel rank's experts), brought together into one map, for checkpoints and
/// comparisons that see the whole model.

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "fivefold/dist.h"
#include "fivefold/io.h"

namespace fivefold {

/// Every rank's `mine` in one map, on every rank of `comm` (collective). Ranks may hold different
/// names; a name held by several ranks (a tied embedding on the first and the last stage) is
/// taken from the lowest rank that holds it. Two all-gathers exchange the names, shapes and dtypes
/// (as JSON), then each tensor is broadcast from its rank. Costs the whole map's memory on every
/// rank: meant for the models this course trains. With `root` (a rank of `comm`), the map is
/// `root`'s alone: each tensor is sent there instead, and the other ranks get an empty map.
io::TensorMap gather_named_tensors(const io::TensorMap& mine, dist::Communicator& comm,
                                   int root = -1);

/// Every rank's `mine`, in rank order, on every rank of `comm` (collective: two all-gathers, the
/// lengths then the bytes).
std::vector<std::string> all_gather_strings(const std::string& mine, dist::Communicator& comm);

/// The first non-empty `mine` in rank order, on every rank of `comm` ("" when all are empty):
/// how one rank's refusal (the writer's verdict on a file it alone can see) becomes every rank's,
/// so that all refuse together. Collective (all_gather_strings).
std::string first_said(const std::string& mine, dist::Communicator& comm);

/// Every rank's `mine`, in rank order, on every rank of `comm`: how JSON crosses ranks (its text
/// through all_gather_strings). Collective.
std::vector<nlohmann::json> all_gather_json(const nlohmann::json& mine, dist::Communicator& comm);

/// The entries of `map` that belong to the parameters named in `names`: a weight under its own
/// name, or AdamW's state under the parameter's name and ".exp_avg", ".exp_avg_sq" or ".step".
/// What a process holding part of a model keeps of a whole checkpoint or optimizer state.
io::TensorMap select_parameters(const io::TensorMap& map, const std::set<std::string>& names);

}  // namespace fivefold
