// `fivefold plan`'s sections for chapters 09-14 (plan_sections.h): each chapter's plan terms as
// JSON, and as the readable table's lines.

#include "plan_sections.h"

#include <cmath>
#include <cstdio>
#include <utility>

#include "07_moe/moe.h"
#include "09_data_parallel/zero.h"
#include "10_tensor_parallel/plan.h"
#include "11_pipeline_parallel/plan.h"
#include "12_context_parallel/plan.h"
#include "14_memory/plan.h"
#include "fivefold/error.h"
#include "runtime/fast.h"

namespace fivefold::commands {

// 1234567 -> "1.23 M" (for the readable table).
std::string si(double value, const char* unit) {
  const char* prefixes[] = {"", " K", " M", " G", " T", " P", " E", " Z", " Y"};
  int i = 0;
  while (std::abs(value) >= 1000 && i < 8) {
    value /= 1000;
    ++i;
  }
  char text[64];
  std::snprintf(text, sizeof(text), "%.3g%s%s", value, prefixes[i], unit);
  return text;
}

// Chapter 09: what each of `dp` data-parallel ranks keeps per ZeRO stage (0: DDP) for psi
// parameters with AdamW, parameters of `param_bytes` (4: fp32; 2: bf16 beside fp32 master
// weights, chapter 14), as plan's JSON writes it.
nlohmann::json zero_memory(int64_t psi, int64_t dp, int64_t param_bytes) {
  nlohmann::json zero;
  for (int stage = 0; stage <= 3; ++stage) {
    const auto m = ch09::zero_memory_formula(psi, dp, stage, param_bytes);
    zero[std::to_string(stage)] = {{"parameters", m.parameters},
                                   {"gradients", m.gradients},
                                   {"optimizer", m.optimizer},
                                   {"total", m.parameters + m.gradients + m.optimizer}};
  }
  return zero;
}

// The table's line for zero_memory's figures (`what`: the precision, in words).
void print_zero_memory(const nlohmann::json& zero, int64_t dp, const char* what) {
  std::printf("memory/rank     dp %lld, %s:", static_cast<long long>(dp), what);
  const char* names[] = {"DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"};
  for (int stage = 0; stage <= 3; ++stage)
    std::printf("  %s %s", names[stage], si(zero[std::to_string(stage)]["total"], "B").c_str());
  std::printf("\n");
}

// Chapter 10: each tp rank's parameters and memory, and the communication of one micro-batch of
// b sequences, with and without sequence parallelism.
nlohmann::json tensor_parallel_section(const ch02::TransformerShape& shape, int64_t tp, int64_t psi,
                                       int64_t b, int64_t context) {
  nlohmann::json traffic;
  for (bool sp : {false, true}) {
    const auto t = ch10::tensor_parallel_traffic(shape, static_cast<int>(tp), b, context, sp);
    nlohmann::json ops;
    const std::pair<const char*, ch10::Traffic> kinds[] = {{"all_reduce", t.all_reduce},
                                                           {"all_gather", t.all_gather},
                                                           {"reduce_scatter", t.reduce_scatter}};
    for (const auto& [name, k] : kinds) {
      ops[name] = {
          {"calls", k.calls}, {"payload_bytes", k.payload_bytes}, {"wire_bytes", k.wire_bytes}};
    }
    ops["wire_bytes"] = t.wire_bytes();
    traffic[sp ? "sequence_parallel" : "plain"] = ops;
  }
  return {{"tp", tp},
          {"parameters_per_rank", psi},
          {"memory_per_rank_bytes", 16 * psi},
          {"micro_batch", {{"sequences", b}, {"tokens", b * context}}},
          {"communication_per_micro_batch", traffic},
          {"sequence_parallel_activation_savings_bytes",
           ch10::sequence_parallel_activation_savings(shape, static_cast<int>(tp), 0, b, context)}};
}

// Chapter 14: what a block keeps for backward, in each recomputation mode, with the lesson's
// kernels and with the trainer's fast ones.
nlohmann::json deepseek_activations(const ch03::ModelConfig& config, int64_t rows, int64_t seq,
                                    ch14::Precision precision) {
  const auto moe = ch07::MoeConfig::from_json(config.extensions);
  nlohmann::json a = {{"rows", rows}, {"tokens", seq}, {"precision", to_string(precision)}};
  const bool routed = ch07::has_routed_experts(config);
  try {  // the first dense and the first MoE layer, where the model has them
    for (int64_t layer = 0; layer < config.n_layers; ++layer) {
      const char* kind = routed && moe.is_moe_layer(layer) ? "moe_block" : "dense_block";
      if (a.contains(kind)) continue;
      for (auto mode : {ch14::Recompute::None, ch14::Recompute::Selective, ch14::Recompute::Full}) {
        a[kind]["lesson"][to_string(mode)] = ch14::deepseek_block_activation_bytes(
            config, layer, rows, seq, mode, {}, {}, precision);
        a[kind]["fast_paths"][to_string(mode)] =
            runtime::block_activation_bytes(config, layer, rows, seq, precision, mode);
      }
    }
  } catch (const Error&) {  // routing the formula does not count (capacity, auxiliary loss)
    return nlohmann::json::object();
  }
  return a;
}

void print_deepseek_activations(const nlohmann::json& a) {
  if (a.empty()) return;
  auto modes = [](const nlohmann::json& bytes) {
    return "none " + si(bytes["none"].get<double>(), "B") + ", selective " +
           si(bytes["selective"].get<double>(), "B") + ", full " +
           si(bytes["full"].get<double>(), "B");
  };
  std::printf("activations     per block, micro-batch of %lld x %lld tokens (%s; chapter 14):\n",
              a["rows"].get<long long>(), a["tokens"].get<long long>(),
              a["precision"].get<std::string>().c_str());
  for (const auto& [kind, name] : {std::pair{"dense_block", "dense"}, {"moe_block", "MoE"}}) {
    if (!a.contains(kind)) continue;
    std::printf("  %-5s the lesson's kernels: %s\n", name, modes(a[kind]["lesson"]).c_str());
    std::printf("        the fast kernels (the trainer's default): %s\n",
                modes(a[kind]["fast_paths"]).c_str());
  }
}

void add_activation_choices(nlohmann::json& activations, const ch02::TransformerShape& shape,
                            int64_t rows, int64_t seq, ch14::Precision precision, int64_t budget,
                            const ch14::ContextParallelShare& cp_share) {
  auto fast = [&](const ch14::TensorParallelShare& tp, const ch14::ContextParallelShare& cp) {
    nlohmann::json bytes;
    for (auto mode : {ch14::Recompute::None, ch14::Recompute::Selective, ch14::Recompute::Full})
      bytes[to_string(mode)] =
          runtime::block_activation_bytes(shape, rows, seq, precision, mode, tp, cp);
    return bytes;
  };
  activations["fast_paths"] = runtime::block_activation_bytes(shape, rows, seq, precision);
  activations["fast_paths_by_mode"] = fast({}, {});
  int64_t t = 1;
  if (activations.contains("tensor_parallel")) {
    t = activations["tensor_parallel"]["ranks"].get<int64_t>();
    activations["tensor_parallel"]["fast_paths"] = {{"plain", fast({t, 0, false}, {})},
                                                    {"sequence_parallel", fast({t, 0, true}, {})}};
  }
  if (activations.contains("context_parallel")) {
    auto& c = activations["context_parallel"];
    c["fast_paths"] = fast({}, cp_share);
    if (c.contains("with_tensor_parallel"))
      c["with_tensor_parallel"]["fast_paths"] = {
          {"plain", fast({t, 0, false}, cp_share)},
          {"sequence_parallel", fast({t, 0, true}, cp_share)}};
  }
  if (budget <= 0) return;
  try {
    const auto c = ch14::recompute_under_budget(shape, rows, seq, budget, precision);
    activations["under_budget"] = {{"budget", budget},
                                   {"recompute", to_string(c.config.mode)},
                                   {"every", c.config.every},
                                   {"bytes", c.bytes},
                                   {"training_flops_per_token", c.flops_per_token}};
  } catch (const Error& e) {
    activations["under_budget"] = {{"budget", budget}, {"error", e.what()}};
  }
}

void print_activations(const nlohmann::json& a) {
  auto modes = [](const nlohmann::json& bytes) {
    return "none " + si(bytes["none"].get<double>(), "B") + ", selective " +
           si(bytes["selective"].get<double>(), "B") + ", full " +
           si(bytes["full"].get<double>(), "B");
  };
  std::printf(
      "activations per block, micro-batch of %lld x %lld tokens (%s, the lesson's "
      "kernels; chapter 14): %s\n",
      a["rows"].get<long long>(), a["tokens"].get<long long>(),
      a["precision"].get<std::string>().c_str(), modes(a["bytes_per_block"]).c_str());
  std::printf(
      "  with the training run's fast kernels (tiled attention, fused SwiGLU and RMSNorm; the "
      "default): %s\n",
      modes(a["fast_paths_by_mode"]).c_str());
  if (a.contains("tensor_parallel")) {
    const auto& t = a["tensor_parallel"];
    std::printf("  tp %lld rank 0: %s; with sequence parallelism: %s\n",
                t["ranks"].get<long long>(), modes(t["plain"]).c_str(),
                modes(t["sequence_parallel"]).c_str());
    std::printf("    with the fast kernels: %s; with sequence parallelism: %s\n",
                modes(t["fast_paths"]["plain"]).c_str(),
                modes(t["fast_paths"]["sequence_parallel"]).c_str());
  }
  if (a.contains("context_parallel")) {
    const auto& c = a["context_parallel"];
    std::printf("  cp %lld, each rank: %s\n", c["ranks"].get<long long>(),
                modes(c["bytes"]).c_str());
    std::printf("    with the fast kernels: %s\n", modes(c["fast_paths"]).c_str());
    if (c.contains("with_tensor_parallel")) {
      const auto& w = c["with_tensor_parallel"];
      std::printf("  cp %lld x tp %lld rank 0: %s; with sequence parallelism: %s\n",
                  c["ranks"].get<long long>(), a["tensor_parallel"]["ranks"].get<long long>(),
                  modes(w["plain"]).c_str(), modes(w["sequence_parallel"]).c_str());
      std::printf("    with the fast kernels: %s; with sequence parallelism: %s\n",
                  modes(w["fast_paths"]["plain"]).c_str(),
                  modes(w["fast_paths"]["sequence_parallel"]).c_str());
    }
  }
  if (a.contains("under_budget")) {
    const auto& u = a["under_budget"];
    if (u.contains("error")) {
      std::printf("  within %s: %s\n", si(u["budget"].get<double>(), "B").c_str(),
                  u["error"].get<std::string>().c_str());
    } else {
      const std::string every = u["recompute"] == "full" && u["every"].get<int64_t>() > 1
                                    ? " every " + std::to_string(u["every"].get<int64_t>())
                                    : "";
      std::printf("  within %s: --recompute %s%s, the blocks keep %s, %s FLOPs per token\n",
                  si(u["budget"].get<double>(), "B").c_str(),
                  u["recompute"].get<std::string>().c_str(), every.c_str(),
                  si(u["bytes"].get<double>(), "B").c_str(),
                  si(u["training_flops_per_token"].get<double>()).c_str());
    }
  }
  const auto& f = a["training_flops_per_token"];
  std::printf("  training FLOPs per token: none %s, selective %s, full %s\n",
              si(f["none"].get<double>()).c_str(), si(f["selective"].get<double>()).c_str(),
              si(f["full"].get<double>()).c_str());
}

// Chapter 11: each pipeline rank's layers, parameters, activations in flight and sends per step.
nlohmann::json pipeline_section(const ch02::TransformerShape& shape, int64_t pp, int64_t v,
                                int64_t m, const std::string& schedule, int64_t b,
                                int64_t context) {
  FIVEFOLD_CHECK(pp * v <= shape.n_layers, "--pp ", pp, " x --virtual-stages ", v,
                 " stages, but the model has only ", shape.n_layers, " layers");
  const auto plan = ch11::pipeline_plan(shape, pp, v, m, schedule, b, context);
  nlohmann::json ranks = nlohmann::json::array();
  for (int64_t r = 0; r < pp; ++r) {
    const auto& rank = plan.ranks[static_cast<size_t>(r)];
    const auto t = ch11::pipeline_traffic(pp, v, m, r, b * m, context, shape.d_model);
    ranks.push_back({{"layers", rank.layers},
                     {"parameters", rank.parameters},
                     {"memory_bytes", 16 * rank.parameters},
                     {"peak_micro_batches_in_flight", rank.peak_in_flight},
                     {"activation_bytes_per_micro_batch", rank.activation_bytes},
                     {"peak_activation_bytes", rank.peak_activation_bytes},
                     {"sends_per_step", t.sends},
                     {"send_bytes_per_step", t.payload_bytes}});
  }
  return {{"pp", pp},           {"schedule", schedule},       {"virtual_stages", v},
          {"micro_batches", m}, {"micro_batch_sequences", b}, {"bubble", plan.bubble},
          {"ranks", ranks}};
}

// Chapter 12: each context-parallel rank's tokens, activations and what it sends.
nlohmann::json context_parallel_section(const ch02::TransformerShape& shape, int64_t cp,
                                        const std::string& layout_name,
                                        const std::string& attention_name, int64_t b,
                                        int64_t context) {
  using namespace ch12;
  const auto layout = parse_cp_layout(layout_name);
  const auto attention = parse_cp_attention(attention_name);
  check_context_parallel(context, cp, layout);
  nlohmann::json ranks = nlohmann::json::array();
  for (int64_t r = 0; r < cp; ++r) {
    const auto t = context_parallel_traffic(cp, r, b, context, shape.n_kv_heads, shape.head_dim,
                                            shape.head_dim, layout, attention);
    nlohmann::json ops;
    const std::pair<const char*, CpOps> kinds[] = {{"all_gather", t.all_gather},
                                                   {"send_recv", t.send_recv},
                                                   {"reduce_scatter", t.reduce_scatter}};
    int64_t bytes = 0;
    for (const auto& [name, k] : kinds) {
      ops[name] = {{"calls", k.calls}, {"payload_bytes", k.payload_bytes}};
      bytes += k.payload_bytes;
    }
    ranks.push_back(
        {{"tokens", shard_size(context, cp, r, layout)},
         {"activation_bytes", cp_activation_bytes(shape, cp, r, b, context, layout, attention)},
         {"per_layer", ops},
         {"bytes_per_layer", bytes},
         {"bytes_per_micro_batch", bytes * shape.n_layers}});
  }
  return {{"cp", cp},
          {"layout", layout_name},
          {"attention", attention_name},
          {"micro_batch_sequences", b},
          {"ranks", ranks}};
}

void print_tensor_parallel(const nlohmann::json& t, int64_t context) {
  const auto b = t["micro_batch"]["sequences"].get<long long>();
  std::printf(
      "tensor parallel tp %lld: %s parameters per rank, %s per rank (fp32 AdamW, "
      "activations not included)\n",
      t["tp"].get<long long>(), si(t["parameters_per_rank"].get<double>()).c_str(),
      si(t["memory_per_rank_bytes"].get<double>(), "B").c_str());
  for (const char* mode : {"plain", "sequence_parallel"}) {
    const auto& c = t["communication_per_micro_batch"][mode];
    std::printf(
        "  %-17s per micro-batch of %lld x %lld tokens (fp32): all-reduce %lld x, "
        "all-gather %lld x, reduce-scatter %lld x; %s handed over, %s on the wire per "
        "rank\n",
        mode, b, static_cast<long long>(context), static_cast<long long>(c["all_reduce"]["calls"]),
        static_cast<long long>(c["all_gather"]["calls"]),
        static_cast<long long>(c["reduce_scatter"]["calls"]),
        si(c["all_reduce"]["payload_bytes"].get<double>() +
               c["all_gather"]["payload_bytes"].get<double>() +
               c["reduce_scatter"]["payload_bytes"].get<double>(),
           "B")
            .c_str(),
        si(c["wire_bytes"].get<double>(), "B").c_str());
  }
  std::printf(
      "  sequence parallelism keeps %s fewer activation bytes per micro-batch on rank 0 "
      "(fp32: what the norms keep, and their outputs, for the tokens other ranks hold)\n",
      si(t["sequence_parallel_activation_savings_bytes"].get<double>(), "B").c_str());
}

void print_pipeline(const nlohmann::json& pl, int64_t context) {
  std::printf(
      "pipeline        pp %lld, %s, v %lld, m %lld: bubble %.1f%% of the time (F = B = W); "
      "per step, micro-batches of %lld x %lld tokens:\n",
      pl["pp"].get<long long>(), pl["schedule"].get<std::string>().c_str(),
      static_cast<long long>(pl["virtual_stages"]), static_cast<long long>(pl["micro_batches"]),
      100 * pl["bubble"].get<double>(), pl["micro_batch_sequences"].get<long long>(),
      static_cast<long long>(context));
  for (size_t r = 0; r < pl["ranks"].size(); ++r) {
    const auto& rank = pl["ranks"][r];
    std::string layers;
    for (const auto& range : rank["layers"]) {
      layers += (layers.empty() ? "" : ", ") + std::to_string(range[0].get<int64_t>()) + "-" +
                std::to_string(range[1].get<int64_t>() - 1);
    }
    std::string one;
    for (const auto& bytes : rank["activation_bytes_per_micro_batch"]) {
      one += (one.empty() ? "" : " / ") + si(bytes.get<double>(), "B");
    }
    std::printf(
        "  rank %zu  layers %-10s %s parameters (%s fp32 AdamW); activations %lld in "
        "flight x %s = %s; %lld sends, %s\n",
        r, layers.c_str(), si(rank["parameters"].get<double>()).c_str(),
        si(rank["memory_bytes"].get<double>(), "B").c_str(),
        static_cast<long long>(rank["peak_micro_batches_in_flight"]), one.c_str(),
        si(rank["peak_activation_bytes"].get<double>(), "B").c_str(),
        static_cast<long long>(rank["sends_per_step"]),
        si(rank["send_bytes_per_step"].get<double>(), "B").c_str());
  }
}

void print_context_parallel(const nlohmann::json& c, int64_t context) {
  std::printf(
      "context parallel cp %lld, %s, %s attention; per micro-batch of %lld x %lld tokens "
      "(fp32; activations kept for backward, bytes sent forward and backward):\n",
      c["cp"].get<long long>(), c["layout"].get<std::string>().c_str(),
      c["attention"].get<std::string>().c_str(), c["micro_batch_sequences"].get<long long>(),
      static_cast<long long>(context));
  for (size_t r = 0; r < c["ranks"].size(); ++r) {
    const auto& rank = c["ranks"][r];
    std::printf(
        "  rank %zu  %lld tokens; activations %s; sends %s per layer, %s per "
        "micro-batch\n",
        r, static_cast<long long>(rank["tokens"]),
        si(rank["activation_bytes"].get<double>(), "B").c_str(),
        si(rank["bytes_per_layer"].get<double>(), "B").c_str(),
        si(rank["bytes_per_micro_batch"].get<double>(), "B").c_str());
  }
}

}  // namespace fivefold::commands
