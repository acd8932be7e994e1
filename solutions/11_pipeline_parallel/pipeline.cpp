// Chapter 11: stages, the channels between them, and the executor that runs a schedule.

#include "11_pipeline_parallel/pipeline.h"

#include <set>

#include "fivefold/error.h"
#include "fivefold/seed.h"
#include "fivefold/timer.h"

namespace fivefold::ch11 {

std::vector<std::pair<int64_t, int64_t>> stage_layers(int64_t n_layers, int64_t stages) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t first = 0;
  for (const int64_t size : split_sizes(n_layers, stages)) {
    out.emplace_back(first, first + size);
    first += size;
  }
  return out;
}

ch03::ModelPart stage_part(int64_t n_layers, int64_t ranks, int64_t virtual_stages, int64_t rank) {
  const auto layers = stage_layers(n_layers, ranks * virtual_stages);
  ch03::ModelPart part;
  part.first_layer = layers[static_cast<size_t>(rank)].first;
  part.last_layer = layers[static_cast<size_t>(rank)].second;
  for (int64_t c = 1; c < virtual_stages; ++c)
    part.more_layers.push_back(layers[static_cast<size_t>(c * ranks + rank)]);
  part.embedding = rank == 0;
  part.head = rank == ranks - 1;
  return part;
}

void check_pipeline(const ch03::ModelConfig& config, int64_t ranks, int64_t virtual_stages,
                    const std::string& schedule, int64_t micro_batches) {
  FIVEFOLD_CHECK(ranks >= 1, "--pp must be at least 1, got ", ranks);
  check_schedule(schedule, ranks, virtual_stages, micro_batches);  // refuses what cannot run
  FIVEFOLD_CHECK(ranks * virtual_stages <= config.n_layers, "--pp ", ranks, " x --virtual-stages ",
                 virtual_stages, " = ", ranks * virtual_stages, " stages, but the model has only ",
                 config.n_layers, " layers: every stage needs at least one");
}

PipelineLinks::PipelineLinks(dist::CommunicatorPtr pp_comm) : pp(std::move(pp_comm)) {
  const int p = pp->size(), r = pp->rank();
  if (p == 1) return;
  // Channel e joins ranks e and e + 1 (mod p). A split gives each rank one group, so the
  // channels are made in rounds of channels that share no rank: even e, then odd e, and for odd
  // p the last channel (p − 1 -> 0) alone. Ranks outside a round's channels group apart.
  auto round_of = [p](int e) { return (p % 2 == 1 && e == p - 1) ? 2 : e % 2; };
  for (const bool activations : {true, false}) {
    for (int round = 0; round < 3; ++round) {
      int color = 0;  // not in this round
      for (const int e : {r, (r - 1 + p) % p})
        if (round_of(e) == round) color = 1 + e;
      if (round == 2 && p % 2 == 0) continue;
      const std::string name = activations ? "pp-activations" : "pp-gradients";
      auto channel = pp->split(color, 0, name);
      if (color == 0) continue;
      const int e = color - 1;
      // Channel e carries activations e -> e + 1 and gradients e + 1 -> e.
      const bool sends_on_it = e == r;  // this rank is e, the lower end
      if (activations) (sends_on_it ? next_activations : previous_activations) = channel;
      if (!activations) (sends_on_it ? next_gradients : previous_gradients) = channel;
    }
  }
  // With p = 2, channel 0 (0 -> 1) and channel 1 (1 -> 0) join the same two ranks; both exist.
  ends = pp->split(r == 0 || r == p - 1 ? 1 : 0, 0, "pp-ends");
  if (r != 0 && r != p - 1) ends = nullptr;
}

// One (stage, micro-batch) in flight on this rank.
struct PipelineExecutor::Slot {
  torch::Tensor input;        // received activation (a leaf requiring its gradient); none at 0
  torch::Tensor output;       // the stage's output, or at the last stage the weighted loss
  torch::Tensor output_grad;  // received gradient of the output (none at the last stage)
  torch::Tensor input_grad;   // the gradient to send back
  ch03::WeightGradientStore weights;  // zero bubble: B's kept inputs of the weight gradients
  bool finished = false;              // its backward (B+W, or W) has run
};

PipelineExecutor::PipelineExecutor(ch03::Transformer model, std::shared_ptr<PipelineLinks> links,
                                   int64_t virtual_stages, ActivationShape shape)
    : model_(std::move(model)),
      links_(std::move(links)),
      virtual_stages_(virtual_stages),
      shape_(std::move(shape)) {
  const auto& config = model_->config();
  const int64_t p = links_->pp->size(), r = links_->pp->rank();
  layers_ = stage_layers(config.n_layers, p * virtual_stages_);
  if (!shape_) {
    shape_ = [d = config.d_model](const ch03::Batch& b) {
      return std::vector<int64_t>{b.inputs.size(0), b.inputs.size(1), d};
    };
  }
  // Each virtual stage's parameters: its blocks', the embedding on the first, the final norm
  // and the head on the last (a tied table is the embedding's, held by both ends).
  const int64_t last = p * virtual_stages_ - 1;
  for (int64_t c = 0; c < virtual_stages_; ++c) {
    const int64_t s = c * p + r;
    std::vector<torch::Tensor> weights;
    std::set<const void*> seen;
    auto add = [&](const std::vector<torch::Tensor>& params) {
      for (const auto& t : params)
        if (t.requires_grad() && seen.insert(t.unsafeGetTensorImpl()).second) weights.push_back(t);
    };
    for (int64_t i = layers_[static_cast<size_t>(s)].first;
         i < layers_[static_cast<size_t>(s)].second; ++i)
      add(model_->block(i).parameters());
    if (s == 0) add(model_->model->embed_tokens->parameters());
    if (s == last) {
      add(model_->model->norm->parameters());
      add(model_->lm_head->parameters());
      if (config.tied_embeddings) add(model_->model->embed_tokens->parameters());
    }
    weights_[s] = std::move(weights);
  }
}

torch::Tensor PipelineExecutor::received(
    std::map<std::pair<int64_t, int64_t>, dist::Work>& posted,
    std::map<std::pair<int64_t, int64_t>, torch::Tensor>& local, int64_t stage,
    int64_t micro_batch) {
  const std::pair<int64_t, int64_t> key{stage, micro_batch};
  torch::Tensor t;
  if (auto found = local.find(key); found != local.end()) {
    t = found->second;
    local.erase(found);
  } else {
    auto work = posted.find(key);
    FIVEFOLD_CHECK(work != posted.end(), "pipeline: nothing posted for stage ", stage,
                   ", micro-batch ", micro_batch);
    t = work->second.wait();
    posted.erase(work);
  }
  return t;
}

void PipelineExecutor::compute(const Action& a, const std::vector<ch03::Batch>& micro_batches,
                               double share) {
  const int64_t s = a.stage, j = a.micro_batch;
  const int64_t last = links_->pp->size() * virtual_stages_ - 1;
  const auto& batch = micro_batches[static_cast<size_t>(j)];
  const auto [first_layer, last_layer] = layers_[static_cast<size_t>(s)];
  auto& slot = slots_[{s, j}];
  if (a.kind == ActionKind::Forward) {
    // Every stage's auxiliary losses (chapter 07) count with the micro-batch's weight.
    ch03::LossWeightScope weight(share * batch.loss_weight);
    slot = std::make_shared<Slot>();
    torch::Tensor x;
    if (s == 0) {
      x = model_->embed(batch.inputs);
    } else {
      // The previous stage's output, as a leaf whose gradient this stage sends back.
      slot->input = received(activations_in_, local_activations_, s, j).requires_grad_(true);
      x = slot->input;
    }
    x = model_->forward_layers(x, ch03::batch_positions(batch), first_layer, last_layer);
    if (s == last) {
      // Weighted by the micro-batch's share of the rows: the sum is the mean over all of them.
      slot->output = model_->loss(x, batch.targets) * (share * batch.loss_weight);
      loss_ += slot->output.item<double>();
    } else {
      slot->output = x;
    }
    peak_in_flight_ = std::max(peak_in_flight_, ++in_flight_);
    return;
  }
  FIVEFOLD_CHECK(slot != nullptr, "pipeline: backward of micro-batch ", j, " at stage ", s,
                 " before its forward");
  if (a.kind == ActionKind::BackwardWeight) {
    // W: ∂L/∂W = (∂L/∂y)ᵀ·x for every linear map of the stage, from what B kept.
    slot->weights.flush();
    --in_flight_;
    return;
  }
  if (!slot->output_grad.defined() && s < last)
    slot->output_grad = received(gradients_in_, local_gradients_, s, j);
  const std::vector<torch::Tensor> grads =
      s < last ? std::vector<torch::Tensor>{slot->output_grad} : std::vector<torch::Tensor>{};
  if (a.kind == ActionKind::Backward) {
    torch::autograd::backward({slot->output}, grads);
    if (s > 0) slot->input_grad = slot->input.grad();
  } else if (a.kind == ActionKind::BackwardInput) {
    // B: the whole backward but the weight matrices' gradients, which every linear map keeps
    // the inputs of (x and ∂L/∂y) for W; the graph and the other activations go now.
    auto inputs = weights_.at(s);
    if (s > 0) inputs.push_back(slot->input);
    {
      ch03::DeferWeightGradients defer(slot->weights);
      torch::autograd::backward({slot->output}, grads, /*retain_graph=*/false,
                                /*create_graph=*/false, inputs);
    }
    if (s > 0) slot->input_grad = slot->input.grad();
    slot->output = slot->output_grad = slot->input = torch::Tensor();
  }
  if (a.kind != ActionKind::BackwardInput) --in_flight_;
}

double PipelineExecutor::run(const Schedule& schedule,
                             const std::vector<ch03::Batch>& micro_batches) {
  auto& pp = *links_->pp;
  FIVEFOLD_CHECK(schedule.ranks == pp.size() && schedule.virtual_stages == virtual_stages_ &&
                     schedule.micro_batches == static_cast<int64_t>(micro_batches.size()),
                 "pipeline: a schedule for p ", schedule.ranks, ", v ", schedule.virtual_stages,
                 ", m ", schedule.micro_batches, " cannot run on p ", pp.size(), ", v ",
                 virtual_stages_, ", m ", micro_batches.size());
  int64_t rows = 0;
  for (const auto& b : micro_batches) rows += b.inputs.size(0);
  loss_ = 0;
  in_flight_ = peak_in_flight_ = 0;
  timeline_.clear();
  const Timer clock;
  started_ = clock.started();
  auto seconds = [&] { return clock.seconds(); };
  const int64_t p = pp.size();
  for (const Action& a : schedule.lists[static_cast<size_t>(pp.rank())]) {
    const std::pair<int64_t, int64_t> key{a.stage, a.micro_batch};
    const auto& batch = micro_batches[static_cast<size_t>(a.micro_batch)];
    switch (a.kind) {
      case ActionKind::RecvActivation: {
        auto buffer = torch::empty(shape_(batch));
        activations_in_[key] = links_->previous_activations->recv_async(
            buffer, PipelineLinks::peer(*links_->previous_activations));
        break;
      }
      case ActionKind::RecvGradient: {
        auto buffer = torch::empty(shape_(batch));
        gradients_in_[key] = links_->next_gradients->recv_async(
            buffer, PipelineLinks::peer(*links_->next_gradients));
        break;
      }
      case ActionKind::SendActivation: {
        auto out = slots_.at(key)->output.detach().contiguous();
        sends_.emplace_back(links_->next_activations->send_async(
                                out, PipelineLinks::peer(*links_->next_activations)),
                            out);
        break;
      }
      case ActionKind::SendGradient: {
        auto& slot = slots_.at(key);
        auto grad = slot->input_grad.contiguous();
        sends_.emplace_back(links_->previous_gradients->send_async(
                                grad, PipelineLinks::peer(*links_->previous_gradients)),
                            grad);
        slot->input_grad = torch::Tensor();
        if (slot->finished) slots_.erase(key);  // backward done: nothing left
        break;
      }
      default: {
        // Wait for the input first, so the timeline shows compute, and idle time as gaps.
        if (a.kind == ActionKind::Forward && activations_in_.count(key) > 0)
          activations_in_.at(key).wait();
        if (a.kind != ActionKind::Forward && gradients_in_.count(key) > 0)
          gradients_in_.at(key).wait();
        const double start = seconds();
        compute(a, micro_batches,
                static_cast<double>(batch.inputs.size(0)) / static_cast<double>(rows));
        timeline_.push_back({a, start, seconds()});
        auto& slot = slots_.at(key);
        // Between two stages on this rank, tensors pass without communication.
        const int64_t last = p * virtual_stages_ - 1;
        if (a.kind == ActionKind::Forward && a.stage < last &&
            schedule.rank_of(a.stage + 1) == pp.rank())
          local_activations_[{a.stage + 1, a.micro_batch}] = slot->output.detach();
        if ((a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardInput) &&
            a.stage > 0 && schedule.rank_of(a.stage - 1) == pp.rank()) {
          local_gradients_[{a.stage - 1, a.micro_batch}] = slot->input_grad;
          slot->input_grad = torch::Tensor();
        }
        // Done with the micro-batch: its activations go; the input's gradient stays until sent.
        if (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardWeight) {
          slot->output = slot->input = slot->output_grad = torch::Tensor();
          slot->finished = true;
          if (!slot->input_grad.defined()) slots_.erase(key);
        }
      }
    }
  }
  for (auto& [work, tensor] : sends_) work.wait();
  sends_.clear();
  slots_.clear();
  FIVEFOLD_CHECK(activations_in_.empty() && gradients_in_.empty() && local_activations_.empty() &&
                     local_gradients_.empty(),
                 "pipeline: the schedule left tensors unused");
  // Only the last stage's rank computed the loss: it tells the others.
  auto loss = torch::tensor({loss_}, torch::kDouble);
  pp.broadcast(loss, static_cast<int>(schedule.rank_of(schedule.stages() - 1)));
  return loss.item<double>();
}

}  // namespace fivefold::ch11
