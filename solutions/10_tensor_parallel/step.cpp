// Chapter 10: the tensor-parallel training step, and gathering slices into whole tensors by name.

#include "10_tensor_parallel/step.h"

#include <utility>
#include <vector>

#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch10 {

namespace {

// The slice description of `key`: a parameter's own, or its optimizer moments' (which are shaped
// as the parameter). Null when `key` is whole.
const ch03::TensorShard* shard_of(const std::string& key,
                                  const std::map<std::string, ch03::TensorShard>& shards) {
  for (const std::string suffix : {"", ".exp_avg", ".exp_avg_sq"}) {
    if (key.size() <= suffix.size() ||
        key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const auto found = shards.find(key.substr(0, key.size() - suffix.size()));
    if (found != shards.end()) return &found->second;
  }
  return nullptr;
}

}  // namespace

io::TensorMap gather_shards(const io::TensorMap& local,
                            const std::map<std::string, ch03::TensorShard>& shards,
                            dist::Communicator& tp, bool to_rank0) {
  io::TensorMap whole;
  const bool keep = !to_rank0 || tp.rank() == 0;
  for (const auto& [name, t] : local) {  // a std::map: the same order on every rank
    const ch03::TensorShard* s = shard_of(name, shards);
    if (s == nullptr) {
      if (keep) whole[name] = t;
      continue;
    }
    // count parts over tp.size() ranks: rank r holds part r / sharing (sharing = 1 but for a
    // key/value head shared by several ranks).
    FIVEFOLD_CHECK(tp.size() % s->count == 0 && s->index == tp.rank() / (tp.size() / s->count),
                   "gather_shards: ", name, " is part ", s->index, " of ", s->count,
                   ", not this tp rank's");
    const int sharing = tp.size() / static_cast<int>(s->count);
    std::vector<int64_t> sizes;
    for (int r = 0; r < tp.size(); ++r)
      sizes.push_back(split_sizes(s->full_size, s->count)[static_cast<size_t>(r / sharing)]);
    auto gathered = dist::all_gather_along(tp, t, s->dim, sizes).split_with_sizes(sizes, s->dim);
    if (!keep) continue;
    std::vector<torch::Tensor> parts;  // one copy of each part: the first sharing rank's
    for (int r = 0; r < tp.size(); r += sharing) parts.push_back(gathered[static_cast<size_t>(r)]);
    whole[name] = torch::cat(parts, s->dim).contiguous();
  }
  return whole;
}

io::TensorMap slice_shards(const io::TensorMap& whole,
                           const std::map<std::string, ch03::TensorShard>& shards) {
  io::TensorMap local;
  for (const auto& [name, t] : whole) {
    const ch03::TensorShard* s = shard_of(name, shards);
    if (s == nullptr) {
      local[name] = t;
      continue;
    }
    FIVEFOLD_CHECK(t.dim() > s->dim && t.size(s->dim) == s->full_size, "slice_shards: ", name,
                   " has shape ", t.sizes(), ", expected ", s->full_size, " along dimension ",
                   s->dim);
    local[name] = shard(t, s->dim, s->index, s->count).contiguous();
  }
  return local;
}

io::TensorMap named_weights(ch03::Transformer& model) {
  io::TensorMap weights;
  for (const auto& item : model->named_parameters()) weights[item.key()] = item.value().detach();
  return weights;
}

void load_slices(ch03::Transformer& model, const io::TensorMap& weights) {
  io::TensorMap wanted;  // only the names this model holds
  for (const auto& item : model->named_parameters()) {
    const auto found = weights.find(item.key());
    FIVEFOLD_CHECK(found != weights.end(), "load_slices: no weights for ", item.key());
    wanted[item.key()] = found->second;
  }
  const auto mine = slice_shards(wanted, model->parameter_shards());
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters()) item.value().copy_(mine.at(item.key()));
}

ch09::ModelParallelGroups tensor_parallel_groups(ch03::Transformer& model,
                                                 const TensorParallel& tp) {
  ch09::ModelParallelGroups groups;
  if (tp.size() == 1) return groups;
  groups.norm = {tp.comm};  // each tp rank adds the squares of its slices
  for (const auto& [name, group] : partial_gradient_parameters(model, tp))
    groups.partial.emplace(name, group);
  const auto shards = model->parameter_shards();
  for (const auto& item : model->named_parameters()) {
    // A whole (replicated) tensor is the same on every tp rank: counted once, on tp rank 0. A
    // slice shared by tp / count ranks (a key/value head) is counted by the first of them.
    const auto found = shards.find(item.key());
    const int sharing =
        found == shards.end() ? tp.size() : tp.size() / static_cast<int>(found->second.count);
    if (tp.rank() % sharing != 0) groups.counted_elsewhere.insert(item.key());
  }
  return groups;
}

ch03::Transformer& ModelPartStep::full_model() {
  const auto whole = gather(named_weights(inner_->full_model()), false);  // ZeRO-3: over dp first
  if (!full_) full_ = whole_(inner_->model()->config(), ch03::ModelPart{});
  load_slices(full_, whole);
  return full_;
}

TensorParallelStep::TensorParallelStep(ch03::Transformer model, TensorParallelPtr tp,
                                       dist::CommunicatorPtr dp, int stage,
                                       const ch03::TrainConfig& config, ch03::ModelBuilder whole,
                                       const ch09::StepHooks& hooks)
    : ModelPartStep(std::move(whole)), tp_(std::move(tp)), shards_(model->parameter_shards()) {
  auto groups = tensor_parallel_groups(model, *tp_);
  if (hooks.adapt_groups) hooks.adapt_groups(model, groups);
  inner_ = std::make_unique<ch09::DataParallelStep>(std::move(model), std::move(dp), stage, config,
                                                    std::move(groups));
}

io::TensorMap TensorParallelStep::gather(const io::TensorMap& mine, bool to_rank0) {
  return gather_shards(mine, shards_, *tp_->comm, to_rank0);
}

io::TensorMap TensorParallelStep::select(const io::TensorMap& whole) {
  return slice_shards(whole, shards_);
}

ch03::StepFactory tensor_parallel_step(TensorParallelPtr tp, dist::CommunicatorPtr dp, int stage,
                                       ch03::ModelBuilder whole, ch09::StepHooks hooks) {
  return [tp, dp, stage, whole, hooks](ch03::Transformer model, const ch03::TrainConfig& config) {
    // This rank's slice, holding the slices of the model the run built or loaded.
    auto local = make_model(model->config(), tp);
    if (hooks.adapt_model) hooks.adapt_model(local);
    load_slices(local, named_weights(model));
    return std::unique_ptr<ch03::TrainingStep>(
        new TensorParallelStep(local, tp, dp, stage, config, whole, hooks));
  };
}

}  // namespace fivefold::ch10
