#pragma once
// `fivefold plan`'s sections for chapters 09-14: each builds its chapter's plan terms as JSON (what
// --json prints) and prints them as the readable table's lines. plan_command.cpp reads the flags,
// builds chapter 02's plan and calls the sections asked for.

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "02_flops_6np/flops.h"
#include "03_transformer/model.h"
#include "14_memory/plan.h"
#include "14_memory/precision.h"

namespace fivefold {
class ArgParser;
}

namespace fivefold::commands {

/// Chapter 03's model config for a Llama-shaped chapter 02 shape (what resolve_layout checks);
/// throws fivefold::Error for GPT-2's shape, which chapter 03 does not build.
ch03::ModelConfig llama_config(const ch02::TransformerShape& shape);

/// `fivefold plan --search` (search_command.cpp): chapter 15's planner over --cluster's layouts
/// for `model` (Llama, or DeepSeek-V3's MLA and experts) at `context` tokens, printed fastest
/// first.
int plan_search(const ArgParser& args, const ch03::ModelConfig& model, int64_t context);

/// 1234567 -> "1.23 M" (for the readable table), with `unit` after the prefix.
std::string si(double value, const char* unit = "");

/// Chapter 09: what each of `dp` data-parallel ranks keeps per ZeRO stage (0: DDP) for psi
/// parameters with AdamW: `param_bytes` 4 in fp32, 2 in bf16 beside fp32 master weights.
nlohmann::json zero_memory(int64_t psi, int64_t dp, int64_t param_bytes = 4);
/// The table's line for zero_memory's figures; `what` names the precision.
void print_zero_memory(const nlohmann::json& zero, int64_t dp, const char* what);

/// Chapter 10: each tp rank's parameters and memory, and the communication of one micro-batch of
/// b sequences, with and without sequence parallelism.
nlohmann::json tensor_parallel_section(const ch02::TransformerShape& shape, int64_t tp, int64_t psi,
                                       int64_t b, int64_t context);
/// The table's lines for tensor_parallel_section.
void print_tensor_parallel(const nlohmann::json& t, int64_t context);

/// Chapter 11: each pipeline rank's layers, parameters, activations in flight and sends per step.
nlohmann::json pipeline_section(const ch02::TransformerShape& shape, int64_t pp, int64_t v,
                                int64_t m, const std::string& schedule, int64_t b, int64_t context);
/// The table's lines for pipeline_section.
void print_pipeline(const nlohmann::json& pl, int64_t context);

/// Chapter 12: each context-parallel rank's tokens, activations and what it sends.
nlohmann::json context_parallel_section(const ch02::TransformerShape& shape, int64_t cp,
                                        const std::string& layout_name,
                                        const std::string& attention_name, int64_t b,
                                        int64_t context);
/// The table's lines for context_parallel_section.
void print_context_parallel(const nlohmann::json& c, int64_t context);

/// Chapter 14: what a dense and a MoE block of a deepseek_v3 config keep for a micro-batch of
/// `rows` x `seq` tokens in `precision`, with each recomputation, for the lesson's kernels
/// (ch14::deepseek_block_activation_bytes) and the trainer's fast ones
/// (runtime::block_activation_bytes); empty where not derived.
nlohmann::json deepseek_activations(const ch03::ModelConfig& config, int64_t rows, int64_t seq,
                                    ch14::Precision precision);
/// Its line of the table (none when empty).
void print_deepseek_activations(const nlohmann::json& a);

/// Adds to `activations` (ch14::activation_plan's) what the trainer's fast kernels keep a block
/// (runtime::block_activation_bytes: on one device, and on rank 0 of the tp and cp groups
/// activation_plan holds, `cp` laid out as `cp_share` says) and, with `budget` > 0, the
/// recomputation that fits it (ch14::recompute_under_budget, or why none does).
void add_activation_choices(nlohmann::json& activations, const ch02::TransformerShape& shape,
                            int64_t rows, int64_t seq, ch14::Precision precision, int64_t budget,
                            const ch14::ContextParallelShare& cp_share = {});

/// Chapter 14: the table's lines for ch14::activation_plan (what a block keeps, a step's FLOPs,
/// in each recomputation mode).
void print_activations(const nlohmann::json& a);

}  // namespace fivefold::commands
