#pragma once
/// @file adamw_state.h
/// @brief AdamW's state under the parameters' names, for checkpoints. LibTorch keys an
/// optimizer's per-parameter state by the address of the parameter's storage, which means nothing
/// to another process or to a later run; a checkpoint names each entry after its parameter
/// instead: `{name}.exp_avg`, `{name}.exp_avg_sq` (float32, the parameter's shape) and
/// `{name}.step` (int64). Names, not positions in a list, so that a run with another layout (other
/// shards, other stages) can read it. Chapter 03's checkpoints and every parallel step use it.

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "fivefold/io.h"

namespace fivefold::adamw {

/// Parameters with their names: what an optimizer steps, in the order it holds them.
using NamedParameters = std::vector<std::pair<std::string, torch::Tensor>>;

/// `module`'s parameters under their names (named_parameters(), frozen ones included).
NamedParameters parameters_by_name(const torch::nn::Module& module);

/// The state `optimizer` holds for `params` (name, the tensor it steps), under the names above.
/// Parameters without state yet (no step taken) are left out.
io::TensorMap state_by_name(const NamedParameters& params, torch::optim::AdamW& optimizer);

/// Checks a state in state_by_name's layout (read from `source`) against `params`: each parameter
/// with an `{name}.exp_avg` has its three entries, the moments with the parameter's shape, and
/// every entry belongs to one of them. Throws fivefold::Error naming `source`. Returns, per
/// parameter, whether the state has it (a parameter not stepped yet has none).
std::vector<bool> check_state(const io::TensorMap& state, const std::string& source,
                              const NamedParameters& params);

/// Restores a state written by state_by_name into `optimizer`, whose parameters are `params`
/// (check_state first: its errors name `source`). A parameter given state and no gradient gets a
/// zero gradient, as it would have had in the run never interrupted.
void load_state(const io::TensorMap& state, const std::string& source,
                const NamedParameters& params, torch::optim::AdamW& optimizer);

}  // namespace fivefold::adamw
