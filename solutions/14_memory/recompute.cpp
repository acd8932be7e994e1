// Chapter 14: what is recomputed, installed in a model through chapter 03's two slots (the layer
// runner for whole blocks, the attention kernel for the attention core).
#include "14_memory/recompute.h"

#include "fivefold/error.h"

namespace fivefold::ch14 {

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::None;
  if (name == "full") return Recompute::Full;
  if (name == "selective") return Recompute::Selective;
  throw Error("recompute: '" + name + "' is not one of none, full, selective");
}

std::string to_string(Recompute mode) {
  switch (mode) {
    case Recompute::Full:
      return "full";
    case Recompute::Selective:
      return "selective";
    case Recompute::None:
      break;
  }
  return "none";
}

namespace {
// `t`, or a copy of it where it views only part of its storage.
torch::Tensor own_storage(const torch::Tensor& t) {
  const auto bytes = static_cast<size_t>(t.numel()) * t.element_size();
  return t.storage().nbytes() > bytes ? t.clone(c10::MemoryFormat::Contiguous) : t;
}
}  // namespace

RecomputedAttentionKernel::RecomputedAttentionKernel(
    std::shared_ptr<const ch03::AttentionKernel> inner)
    : inner_(std::move(inner)) {
  FIVEFOLD_CHECK(inner_ != nullptr, "RecomputedAttentionKernel: no kernel to wrap");
}

ch03::AttentionOutput RecomputedAttentionKernel::compute(const torch::Tensor& q,
                                                         const torch::Tensor& k,
                                                         const torch::Tensor& v,
                                                         const torch::Tensor& q_positions,
                                                         const torch::Tensor& k_positions,
                                                         double scale) const {
  const auto inner = inner_;
  // A kernel that takes narrow inputs reads k and v only as its products' operands: where those
  // are narrower than fp32 (chapter 14's bf16; MLA's k arrives in fp32), keep k and v so, each in
  // storage of its own (MLA's v is a view of kv_b_proj's whole output).
  std::vector<torch::Tensor> kept;
  if (inner->takes_narrow_inputs()) {
    const auto narrow = [](const torch::Tensor& t) {
      const auto operand = ch03::matmul_operand(t);
      return operand.element_size() < 4 ? own_storage(operand) : torch::Tensor();
    };
    kept = {torch::Tensor(), narrow(k), narrow(v)};
  }
  const auto out = checkpoint(
      [inner, q_positions, k_positions, scale](const std::vector<torch::Tensor>& in) {
        const auto o = inner->attend(in[0], in[1], in[2], q_positions, k_positions, scale);
        return std::vector<torch::Tensor>{o.output, o.lse};
      },
      {q, k, v}, kept);
  return {out[0], out[1]};
}

bool recomputes_block(const RecomputeConfig& config, int64_t layer) {
  return config.mode == Recompute::Full && layer % config.every == 0;
}

bool recomputes_attention(const RecomputeConfig& config, int64_t layer) {
  return config.mode == Recompute::Selective || recomputes_block(config, layer);
}

void apply_recompute(ch03::Transformer& model, const RecomputeConfig& config) {
  FIVEFOLD_CHECK(config.every >= 1, "recompute: every must be >= 1, got ", config.every);
  // The attention kernels as they were before any recomputation was installed.
  for (const auto& item : model->named_modules()) {
    auto* layer = dynamic_cast<ch03::AttentionLayer*>(item.value().get());
    if (layer == nullptr || layer->kernel == nullptr) continue;
    if (const auto* wrapped = dynamic_cast<const RecomputedAttentionKernel*>(layer->kernel.get()))
      layer->kernel = wrapped->inner();
    if (config.mode == Recompute::Selective)
      layer->kernel = std::make_shared<const RecomputedAttentionKernel>(layer->kernel);
  }
  if (config.mode != Recompute::Full) {
    model->set_layer_runner({});
    return;
  }
  model->set_layer_runner([config](ch03::BlockImpl& block, int64_t layer, const torch::Tensor& x,
                                   const torch::Tensor& positions) {
    if (!recomputes_block(config, layer)) return block.forward(x, positions);
    const auto region = [&block, positions](const std::vector<torch::Tensor>& in) {
      return std::vector<torch::Tensor>{block.forward(in[0], positions)};
    };
    return checkpoint(region, {x})[0];
  });
}

}  // namespace fivefold::ch14
