// fivefold plan: what a transformer costs and what each parallelism's formulas say of it, from a
// Hugging Face config.json or from flags, for published models at full size (no model is built).
//
//   fivefold plan --config config.json [--tokens 2e12] [--budget 1e23] [--dp 64] [--json]
//   fivefold plan --config llama.json --tp 8 --pp 4 --cp 4 --seq 8192 --micro-batch 2
//   fivefold plan --config deepseek-v3.json --ep 64 --dp 8
//
// Each section is its chapter's own plan terms: chapter 02 (parameters, FLOPs, time), 07 (a
// deepseek_v3 config's total and active parameters), 09 (ZeRO memory), 10 (tensor parallel), 11
// (pipeline), 12 (context parallel) and 13 (expert parallel). `fivefold train --plan N` predicts
// for the run itself instead, from the rank's part of the model built offline.

#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "02_flops_6np/flops.h"
#include "03_transformer/checkpoint.h"
#include "07_moe/moe.h"
#include "09_data_parallel/zero.h"
#include "10_tensor_parallel/layers.h"
#include "10_tensor_parallel/plan.h"
#include "11_pipeline_parallel/plan.h"
#include "12_context_parallel/plan.h"
#include "13_expert_parallel/plan.h"
#include "14_memory/plan.h"
#include "commands.h"
#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "plan_sections.h"

namespace fivefold::commands {

namespace {

// Chapter 13's section of a deepseek_v3 plan: what each of the ep ranks holds and sends.
void print_expert_parallel(const nlohmann::json& e) {
  std::printf(
      "expert parallel ep %lld: %lld of each MoE layer's experts per rank (%lld MoE layers); "
      "per rank %s parameters (%s in experts, %s replicated), %s fp32 training state\n",
      e["ep"].get<long long>(), e["experts_per_rank"].get<long long>(),
      e["moe_layers"].get<long long>(), si(e["parameters_per_rank"].get<double>()).c_str(),
      si(e["expert_parameters_per_rank"].get<double>()).c_str(),
      si(e["replicated_parameters"].get<double>()).c_str(),
      si(e["memory_per_rank_bytes"].get<double>(), "B").c_str());
  const auto& a = e["all_to_all_per_micro_batch"];
  std::printf(
      "                all-to-all per micro-batch of %lld tokens (even routing, fp32, forward "
      "and backward): %lld calls, %s handed over, %s to other ranks\n",
      e["micro_batch_tokens"].get<long long>(), a["calls"].get<long long>(),
      si(a["payload_bytes"].get<double>(), "B").c_str(),
      si(a["wire_bytes"].get<double>(), "B").c_str());
}

// `fivefold plan` for a deepseek_v3 config (MLA and experts, chapters 06-07), which chapter 02's
// shape does not describe: parameters total and active (count_parameters), the 6N rule on the
// active ones (the FLOPs a token costs), memory from the total (every expert is stored).
int plan_deepseek(const nlohmann::json& json, double tokens, double peak, double mfu,
                  int64_t devices, int64_t dp, int64_t ep, int64_t rows, int64_t seq,
                  ch14::Precision precision, bool as_json) {
  const auto config = ch03::config_from_json(json);
  const auto p = ch07::count_parameters(config);
  const int64_t micro_tokens = rows * seq;
  nlohmann::json out = {
      {"parameters", {{"total", p.total}, {"active", p.active}}},
      {"flops_per_token", {{"six_n_active", 6.0 * static_cast<double>(p.active)}}},
      {"memory_per_device_bytes", {{"total_without_activations", 16 * p.total}}}};
  if (tokens > 0) {
    const double flops = 6.0 * static_cast<double>(p.active) * tokens;
    out["training"] = {{"tokens", tokens},
                       {"flops", flops},
                       {"days", flops / (peak * mfu * static_cast<double>(devices)) / 86400}};
  }
  if (dp > 0) {
    out["zero"] = zero_memory(p.total, dp);
    out["zero_bf16"] = zero_memory(p.total, dp, ch14::bytes_per_number(ch14::Precision::Bf16));
  }
  out["activations"] = deepseek_activations(config, rows, seq, precision);
  if (ep > 0) {
    const auto e = ch13::expert_parallel_plan(config, ep, micro_tokens);
    out["expert_parallel"] = {{"ep", ep},
                              {"moe_layers", e.moe_layers},
                              {"experts_per_rank", e.experts_per_rank},
                              {"expert_parameters_per_rank", e.expert_parameters},
                              {"replicated_parameters", e.replicated_parameters},
                              {"parameters_per_rank", e.parameters_per_rank},
                              {"memory_per_rank_bytes", e.memory_bytes},
                              {"micro_batch_tokens", micro_tokens},
                              {"all_to_all_per_micro_batch",
                               {{"calls", e.per_micro_batch.calls},
                                {"payload_bytes", e.per_micro_batch.payload_bytes},
                                {"wire_bytes", e.per_micro_batch.wire_bytes}}}};
  }
  if (as_json) {
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("parameters      total %s   active per token %s (%.1f%%)\n",
              si(static_cast<double>(p.total)).c_str(), si(static_cast<double>(p.active)).c_str(),
              100.0 * static_cast<double>(p.active) / static_cast<double>(p.total));
  std::printf("FLOPs/token     training 6N on the active parameters: %s (attention not included)\n",
              si(6.0 * static_cast<double>(p.active)).c_str());
  std::printf(
      "memory/device   %s (fp32 weights 4 + gradients 4 + Adam 8 bytes for every "
      "parameter, all experts; activations not included)\n",
      si(16.0 * static_cast<double>(p.total), "B").c_str());
  if (dp > 0) {
    print_zero_memory(out["zero"], dp, "fp32 AdamW (weights + gradients + Adam)");
    print_zero_memory(out["zero_bf16"], dp, "bf16 weights + gradients, fp32 masters + Adam");
  }
  print_deepseek_activations(out["activations"]);
  if (ep > 0) print_expert_parallel(out["expert_parallel"]);
  if (out.contains("training")) {
    std::printf(
        "training        %s tokens: %s FLOPs; %.1f days on %lld devices at %s FLOP/s, "
        "MFU %.2f\n",
        si(tokens).c_str(), si(out["training"]["flops"].get<double>()).c_str(),
        out["training"]["days"].get<double>(), static_cast<long long>(devices), si(peak).c_str(),
        mfu);
  }
  return 0;
}

void declare_flags(ArgParser& args) {
  args.option("config", "",
              "config.json (Llama, GPT-2 or DeepSeek-V3 keys); or give the shape with the flags "
              "below");
  args.option("vocab", "32000", "vocabulary size").option("d-model", "", "hidden size");
  args.option("n-layers", "", "transformer blocks").option("n-heads", "", "query heads");
  args.option("n-kv-heads", "", "key/value heads (default: n-heads)");
  args.option("head-dim", "", "per head (default: d-model / n-heads)");
  args.option(
      "d-ff", "",
      "MLP hidden size (default: 4 d-model for --gpt2, else 8/3 d-model rounded up to 256)");
  args.flag("tied", "LM head shares the embedding")
      .flag("gpt2", "GPT-2 family: LayerNorm, GELU MLP, biases");
  args.option("seq", "", "context length (default: the config's maximum, else 2048)");
  args.option("tokens", "0", "training tokens, for total FLOPs and time");
  args.option("budget", "0", "a FLOP budget, for the compute-optimal (Chinchilla) split");
  args.option("peak", "989e12", "peak FLOP/s of one device (default: H100 SXM, bf16 dense)");
  args.option("mfu", "0.4", "model FLOPs utilisation to assume").option("devices", "1", "devices");
  args.option("dp", "0",
              "data-parallel ranks: adds per-rank memory for DDP and ZeRO-1/2/3 "
              "(chapter 09; fp32 AdamW)");
  args.option("tp", "0",
              "tensor-parallel ranks: adds per-rank parameters and memory, and the TP "
              "communication of one micro-batch (chapter 10; Llama-shaped models)");
  args.option("micro-batch", "1",
              "sequences per micro-batch, for --tp's and --pp's communication and activations");
  args.option("pp", "0",
              "pipeline ranks: adds each rank's layers and parameters, the bubble, the "
              "micro-batches of activations it keeps, their fp32 bytes, and what it sends per "
              "step (chapter 11; Llama-shaped models)");
  args.option("schedule", "1f1b", "with --pp: gpipe, 1f1b, interleaved or zb");
  args.option("virtual-stages", "1", "with --pp and --schedule interleaved: stages per rank");
  args.option("micro-batches", "8", "with --pp: micro-batches per step (m)");
  args.option("cp", "0",
              "context-parallel ranks: adds the keys and values each rank sends per layer and "
              "micro-batch (chapter 12; Llama-shaped models)");
  args.option("cp-layout", "zigzag", "with --cp: zigzag or contiguous");
  args.option("cp-attention", "ring", "with --cp: ring or allgather");
  args.option("ep", "0",
              "expert-parallel ranks: adds the experts and parameters each rank holds and the "
              "all-to-all bytes of one micro-batch of --micro-batch x --seq tokens (default seq "
              "4096) per rank (chapter 13; DeepSeek-V3-shaped models)");
  args.option("activation-budget", "0",
              "bytes the blocks' activations may take for one micro-batch: the recomputation "
              "with the fewest FLOPs that fits (chapter 14; 0: none asked)");
  args.option("precision", "fp32",
              "fp32 or bf16: what the activations per block are counted in (chapter 14)");
  args.flag("search",
            "chapter 15's planner: every layout of --cluster's devices for this model, "
            "--batch and --seq, fastest first (--top of them), with the step's compute, "
            "exposed communication per group, bubble, memory per device and MFU");
  args.path_option("cluster", "",
                   "with --search: the cluster's TOML description (presets in "
                   "chapters/15_trainer_5d/presets/clusters/)");
  args.option("batch", "0", "with --search: the global batch, in sequences");
  args.option("zero", "",
              "with --search: only this ZeRO stage (--tp, --pp, --cp, --dp, "
              "--schedule, --virtual-stages and --micro-batches, given, fix theirs)");
  args.option("recompute", "",
              "with --search: only this recomputation, none, selective or full (every block)");
  args.option("top", "5", "with --search: how many layouts to print");
  args.option("max-micro-batches", "512", "with --search: the most micro-batches to try");
  args.flag("json", "print JSON instead of a table");
  args.flag("no-progress", "with --search: no progress bar on stderr");
}

// The model the flags describe when no --config is given (Llama's shape, or GPT-2's with --gpt2).
ch02::TransformerShape shape_from_flags(const ArgParser& args) {
  FIVEFOLD_CHECK(args.given("d-model") && args.given("n-layers") && args.given("n-heads"),
                 "fivefold plan: give --config, or at least --d-model, --n-layers and --n-heads");
  ch02::TransformerShape shape;
  const bool gpt2 = args.on("gpt2");
  shape.vocab_size = args.integer("vocab");
  shape.d_model = args.integer("d-model");
  shape.n_layers = args.integer("n-layers");
  shape.n_heads = args.integer("n-heads");
  shape.n_kv_heads = args.given("n-kv-heads") ? args.integer("n-kv-heads") : shape.n_heads;
  FIVEFOLD_CHECK(args.given("head-dim") || shape.d_model % shape.n_heads == 0, "--d-model (",
                 shape.d_model, ") is not divisible by --n-heads (", shape.n_heads,
                 "): give --head-dim");
  shape.head_dim =
      args.given("head-dim") ? args.integer("head-dim") : shape.d_model / shape.n_heads;
  // Llama's rule: 2/3 of 4d for three matrices, rounded up to a multiple of 256.
  const int64_t llama_ff = ((8 * shape.d_model / 3 + 255) / 256) * 256;
  shape.d_ff = args.given("d-ff") ? args.integer("d-ff") : (gpt2 ? 4 * shape.d_model : llama_ff);
  shape.gated_mlp = !gpt2;
  shape.biases = gpt2;
  shape.layer_norm = gpt2;
  shape.tied_embeddings = args.on("tied");
  shape.validate();
  return shape;
}

// Parameters, FLOPs per token and memory (chapter 02's plan) as the readable table.
void print_model(const nlohmann::json& out, int64_t context) {
  const auto& p = out["parameters"];
  const auto& f = out["flops_per_token"];
  std::printf("parameters      total %s   embedding %s   non-embedding %s   in matmuls %s\n",
              si(p["total"]).c_str(), si(p["embedding"]).c_str(), si(p["non_embedding"]).c_str(),
              si(p["matmul_weights"]).c_str());
  std::printf("FLOPs/token     training %s (exact, context %lld)   6N %s   ratio %.3f\n",
              si(f["training"]).c_str(), static_cast<long long>(context), si(f["six_n"]).c_str(),
              f["training_over_six_n"].get<double>());
  const auto& c = f["forward_components"];
  std::printf("  forward       qkv %s  scores %s  values %s  out %s  mlp %s  lm_head %s\n",
              si(c["qkv"]).c_str(), si(c["attention_scores"]).c_str(),
              si(c["attention_values"]).c_str(), si(c["output_projection"]).c_str(),
              si(c["mlp"]).c_str(), si(c["lm_head"]).c_str());
  std::printf(
      "memory/device   %s (fp32 weights 4 + gradients 4 + Adam 8 bytes a parameter; "
      "activations not included; no sharding)\n",
      si(out["memory_per_device_bytes"]["total_without_activations"], "B").c_str());
}

// Training time and the compute-optimal split, where asked for.
void print_training(const nlohmann::json& out) {
  if (out.contains("training")) {
    const auto& t = out["training"];
    std::printf(
        "training        %s tokens: %s FLOPs (6ND: %s); %.1f days on %lld devices at %s FLOP/s, "
        "MFU %.2f\n",
        si(t["tokens"]).c_str(), si(t["flops"]).c_str(), si(t["flops_six_n"]).c_str(),
        t["days"].get<double>(), static_cast<long long>(t["devices"].get<int64_t>()),
        si(t["peak_flops_per_device"]).c_str(), t["mfu"].get<double>());
  }
  if (out.contains("budget")) {
    const auto& b = out["budget"];
    std::printf(
        "budget          %s FLOPs: compute-optimal %s parameters x %s tokens (Chinchilla, "
        "~20 tokens/parameter); this model: %s tokens\n",
        si(b["flops"]).c_str(), si(b["chinchilla_parameters"]).c_str(),
        si(b["chinchilla_tokens"]).c_str(), si(b["tokens_for_this_model"]).c_str());
  }
}

// A deepseek_v3 config.json: chapters 09 and 13's terms only (the others are Llama-shaped).
int plan_deepseek_config(const ArgParser& args, const nlohmann::json& config) {
  FIVEFOLD_CHECK(args.integer("dp") >= 0, "--dp must be >= 0");
  FIVEFOLD_CHECK(args.integer("pp") == 0,
                 "--pp: chapter 11's formulas are for Llama-shaped models");
  FIVEFOLD_CHECK(args.integer("cp") == 0,
                 "--cp: chapter 12's formulas are for Llama-shaped models");
  FIVEFOLD_CHECK(args.integer("tp") == 0,
                 "--tp: chapter 10's formulas are for Llama-shaped models (MLA and experts "
                 "split differently)");
  FIVEFOLD_CHECK(args.real("activation-budget") <= 0,
                 "--activation-budget: chapter 14's choice under a budget counts Llama-shaped "
                 "blocks; for MLA and experts compare the modes the plan prints");
  try {
    FIVEFOLD_CHECK(args.integer("ep") >= 0, "--ep must be >= 0");
    const int64_t seq = args.given("seq") ? args.integer("seq") : 4096;
    return plan_deepseek(config, args.real("tokens"), args.real("peak"), args.real("mfu"),
                         args.integer("devices"), args.integer("dp"), args.integer("ep"),
                         args.integer("micro-batch"), seq,
                         ch14::parse_precision(args.str("precision")), args.on("json"));
  } catch (const Error& e) {
    throw Error(args.str("config") + ": " + e.what());
  }
}

// The plan with each parallelism's section the flags ask for (--dp: ZeRO's memory in fp32 and bf16,
// --tp, --pp, --cp: chapters 10-12's terms) and chapter 14's activations, under the keys --json
// prints.
nlohmann::json with_layout_sections(const ArgParser& args, const nlohmann::json& out,
                                    const ch02::TransformerShape& shape, int64_t context) {
  auto result = out;
  const int64_t dp = args.integer("dp"), tp = args.integer("tp"), pp = args.integer("pp");
  const int64_t cp = args.integer("cp"), b = args.integer("micro-batch");
  FIVEFOLD_CHECK(dp >= 0, "--dp must be >= 0");
  const int64_t psi = tp > 0 ? ch10::parameters_per_rank(shape, static_cast<int>(tp))
                             : ch02::count_parameters(shape).total;
  if (dp > 0) {
    result["zero"] = zero_memory(psi, dp);
    result["zero_bf16"] = zero_memory(psi, dp, ch14::bytes_per_number(ch14::Precision::Bf16));
  }
  if (tp > 0) {
    ch03::ModelConfig heads;  // the trainer's refusal, in its words
    heads.n_heads = shape.n_heads;
    heads.n_kv_heads = shape.n_kv_heads;
    ch10::check_tensor_parallel(heads, static_cast<int>(tp), false);
    result["tensor_parallel"] = tensor_parallel_section(shape, tp, psi, b, context);
  }
  FIVEFOLD_CHECK(pp >= 0, "--pp must be >= 0");
  if (pp > 0)
    result["pipeline"] =
        pipeline_section(shape, pp, args.integer("virtual-stages"), args.integer("micro-batches"),
                         args.str("schedule"), b, context);
  FIVEFOLD_CHECK(cp >= 0, "--cp must be >= 0");
  if (cp > 0)
    result["context_parallel"] = context_parallel_section(shape, cp, args.str("cp-layout"),
                                                          args.str("cp-attention"), b, context);
  const auto precision = ch14::parse_precision(args.str("precision"));
  const ch14::ContextParallelShare cp_share{std::max<int64_t>(cp, 1), 0,
                                            ch12::parse_cp_layout(args.str("cp-layout")),
                                            ch12::parse_cp_attention(args.str("cp-attention"))};
  auto activations =
      ch14::activation_plan(shape, b, context, std::max<int64_t>(tp, 1), precision,
                            cp_share.ranks, cp_share.layout, cp_share.attention);
  if (!activations.empty()) {
    add_activation_choices(activations, shape, b, context, precision,
                           static_cast<int64_t>(args.real("activation-budget")), cp_share);
    result["activations"] = activations;
  }
  return result;
}

// The plan's text: the model, its activations, then each parallelism's section it holds, the
// training last.
void print_plan(const ArgParser& args, const nlohmann::json& result, int64_t context) {
  print_model(result, context);
  if (result.contains("activations")) print_activations(result["activations"]);
  if (result.contains("tensor_parallel")) print_tensor_parallel(result["tensor_parallel"], context);
  if (result.contains("pipeline")) print_pipeline(result["pipeline"], context);
  if (result.contains("context_parallel"))
    print_context_parallel(result["context_parallel"], context);
  if (result.contains("zero")) {
    const int64_t dp = args.integer("dp");
    print_zero_memory(result["zero"], dp, "fp32 AdamW (weights + gradients + Adam)");
    print_zero_memory(result["zero_bf16"], dp, "bf16 weights + gradients, fp32 masters + Adam");
  }
  print_training(result);
}

}  // namespace

int plan(int argc, char** argv) {
  ArgParser args("fivefold plan",
                 "Parameters, FLOPs per token (exact and 6N), training time and memory of a "
                 "transformer, from a Hugging Face config.json or from flags.");
  declare_flags(args);
  if (!args.parse(argc, argv)) return 0;
  FIVEFOLD_CHECK(args.integer("tp") >= 0, "--tp must be >= 0");
  FIVEFOLD_CHECK(args.integer("micro-batch") >= 1, "--micro-batch must be >= 1");
  if (!args.on("search")) {  // the planner's options, given without it, would be ignored
    for (const char* name : {"cluster", "batch", "zero", "recompute", "top", "max-micro-batches"})
      FIVEFOLD_CHECK(!args.given(name), "--", name, " is an option of --search (chapter 15's ",
                     "planner); add --search, or leave it out");
  }
  ch02::TransformerShape shape;
  int64_t context = 2048;
  if (args.given("config")) {
    const auto config = io::read_json(args.str("config"));
    if (config.is_object() && config.value("model_type", "") == "deepseek_v3") {
      if (args.on("search")) {  // chapter 15's planner: MLA and experts, every layout
        FIVEFOLD_CHECK(args.integer("ep") >= 0, "--ep must be >= 0");
        return plan_search(args, ch03::config_from_json(config),
                           args.given("seq") ? args.integer("seq") : 4096);
      }
      return plan_deepseek_config(args, config);
    }
    try {
      shape = ch02::shape_from_hf_config(config);
    } catch (const Error& e) {
      throw Error(args.str("config") + ": " + e.what());
    }
    for (const char* key : {"max_position_embeddings", "n_positions"}) {
      if (config.contains(key) && config[key].is_number_integer()) context = config[key];
    }
  } else {
    shape = shape_from_flags(args);
  }
  FIVEFOLD_CHECK(args.integer("ep") == 0,
                 "--ep: the model has no routed experts to distribute (give a DeepSeek-V3 "
                 "config.json, model_type deepseek_v3)");
  if (args.given("seq")) context = args.integer("seq");
  if (args.on("search")) return plan_search(args, llama_config(shape), context);
  const auto out = ch02::plan(shape, context, args.real("tokens"), args.real("budget"),
                              args.real("peak"), args.real("mfu"), args.integer("devices"));
  const auto result = with_layout_sections(args, out, shape, context);
  if (args.on("json")) {
    std::printf("%s\n", result.dump(2).c_str());
    return 0;
  }
  print_plan(args, result, context);
  return 0;
}

}  // namespace fivefold::commands
