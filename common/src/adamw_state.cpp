// AdamW's state under the parameters' names (adamw_state.h).

#include "fivefold/adamw_state.h"

#include <set>

#include "fivefold/error.h"

namespace fivefold::adamw {

namespace {

// LibTorch keys an optimizer's per-parameter state by the address of the parameter's storage.
std::string state_key(const torch::Tensor& p) {
  return c10::guts::to_string(p.unsafeGetTensorImpl());
}

const char* const kSuffixes[] = {".exp_avg", ".exp_avg_sq", ".step"};

}  // namespace

NamedParameters parameters_by_name(const torch::nn::Module& module) {
  NamedParameters params;
  for (const auto& item : module.named_parameters()) params.emplace_back(item.key(), item.value());
  return params;
}

io::TensorMap state_by_name(const NamedParameters& params, torch::optim::AdamW& optimizer) {
  io::TensorMap tensors;
  for (const auto& [name, p] : params) {
    auto found = optimizer.state().find(state_key(p));
    if (found == optimizer.state().end()) continue;
    const auto& state = static_cast<const torch::optim::AdamWParamState&>(*found->second);
    tensors[name + ".exp_avg"] = state.exp_avg();
    tensors[name + ".exp_avg_sq"] = state.exp_avg_sq();
    tensors[name + ".step"] = torch::tensor(state.step(), torch::kLong);
  }
  return tensors;
}

std::vector<bool> check_state(const io::TensorMap& state, const std::string& source,
                              const NamedParameters& params) {
  std::vector<bool> has(params.size(), false);
  size_t used = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    const auto& [name, p] = params[k];
    if (!state.count(name + ".exp_avg")) continue;  // no step taken for this parameter yet
    for (const char* suffix : kSuffixes) {
      auto found = state.find(name + suffix);
      FIVEFOLD_CHECK(found != state.end(), "optimizer state '", source, "': '", name, suffix,
                     "' is missing");
      const bool scalar = std::string(suffix) == ".step";
      FIVEFOLD_CHECK(scalar ? found->second.numel() == 1 : found->second.sizes() == p.sizes(),
                     "optimizer state '", source, "': '", name, suffix, "' has shape ",
                     found->second.sizes(), ", the parameter has ", p.sizes());
      ++used;
    }
    has[k] = true;
  }
  if (used != state.size()) {
    std::set<std::string> known;
    for (const auto& [name, p] : params)
      for (const char* suffix : kSuffixes) known.insert(name + suffix);
    for (const auto& [name, tensor] : state) {
      FIVEFOLD_CHECK(known.count(name), "optimizer state '", source, "': '", name,
                     "' belongs to no parameter of this model");
    }
  }
  return has;
}

void load_state(const io::TensorMap& state, const std::string& source,
                const NamedParameters& params, torch::optim::AdamW& optimizer) {
  const std::vector<bool> has = check_state(state, source, params);
  for (size_t k = 0; k < params.size(); ++k) {
    if (!has[k]) continue;
    const std::string& name = params[k].first;
    auto adam = std::make_unique<torch::optim::AdamWParamState>();
    adam->step(state.at(name + ".step").item<int64_t>());
    adam->exp_avg(state.at(name + ".exp_avg").to(torch::kFloat).clone());
    adam->exp_avg_sq(state.at(name + ".exp_avg_sq").to(torch::kFloat).clone());
    optimizer.state()[state_key(params[k].second)] = std::move(adam);
    // It had a gradient before the checkpoint. LibTorch's zero_grad zeroes a gradient rather than
    // dropping it, so in the run never interrupted AdamW keeps stepping this parameter (momentum
    // and weight decay) even in a step whose tokens do not reach it (an expert no token chose):
    // give it the zero gradient it would have, or the resumed run would skip it there.
    auto& p = params[k].second;
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
  }
}

}  // namespace fivefold::adamw
