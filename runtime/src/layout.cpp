// A run in chapter 15's layouts.

#include "runtime/layout.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "07_moe/moe.h"
#include "09_data_parallel/zero.h"
#include "12_context_parallel/context_parallel.h"
#include "15_trainer_5d/predict.h"
#include "fivefold/consolidate.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/log.h"
#include "runtime/fast.h"
#include "runtime/report.h"

namespace fivefold::runtime {

void declare_layout_flags(ArgParser& args) {
  args.option("dp", "", "data-parallel ranks (default: the world size / (tp x pp x cp))");
  args.option("zero", "0",
              "with --dp > 1: 0 DDP, 1 shard AdamW's state, 2 and the gradients, 3 and the "
              "parameters (ZeRO, chapter 09)");
  args.option("tp", "1",
              "tensor-parallel ranks (chapter 10): each matrix split over them; tp divides the "
              "heads and the key/value heads");
  args.flag("sequence-parallel",
            "with --tp > 1: norms and residuals on each rank's part of the sequence (chapter 10)");
  args.option("pp", "1",
              "pipeline ranks (chapter 11): the layers cut into consecutive stages, as even as "
              "they split");
  args.option("schedule", "1f1b",
              "with --pp > 1: gpipe, 1f1b, interleaved (--virtual-stages, accum a multiple of "
              "pp) or zb (zero-bubble ZB-H1)");
  args.option("virtual-stages", "1",
              "with --schedule interleaved: stages per pipeline rank (pp x this <= layers)");
  args.option("cp", "1",
              "context-parallel ranks (chapter 12): each holds part of every sequence's tokens; "
              "keys and values travel between them");
  args.option("cp-layout", "zigzag",
              "with --cp > 1: zigzag (chunks r and 2cp-1-r of 2cp: equal causal work; seq a "
              "multiple of 2cp) or contiguous (consecutive slices, uneven allowed)");
  args.option("cp-attention", "ring",
              "with --cp > 1: ring (keys and values passed around, overlapped with compute) or "
              "allgather (gathered whole before attention)");
  args.option("ep", "1",
              "expert-parallel ranks (chapter 13): each MoE layer's routed experts split over "
              "them, tokens sent to their experts by all-to-all; ep divides dp x cp and the "
              "experts; with --dp, --cp, --tp, --pp and --zero");
}

ch15::Layout layout_from_flags(const ArgParser& args) {
  ch15::Layout layout;
  layout.dp = args.given("dp") ? args.integer("dp") : 0;
  layout.tp = args.integer("tp");
  layout.pp = args.integer("pp");
  layout.cp = args.integer("cp");
  layout.ep = args.integer("ep");
  layout.zero = static_cast<int>(args.integer("zero"));
  layout.sequence_parallel = args.on("sequence-parallel");
  layout.schedule = args.str("schedule");
  layout.virtual_stages = args.integer("virtual-stages");
  layout.cp_layout = ch12::parse_cp_layout(args.str("cp-layout"));
  layout.cp_attention = ch12::parse_cp_attention(args.str("cp-attention"));
  // The defaults themselves may stand, as in a settings.toml read back on one process.
  const ch15::Layout defaults;
  FIVEFOLD_CHECK(layout.pp > 1 || (layout.schedule == defaults.schedule &&
                                   layout.virtual_stages == defaults.virtual_stages),
                 "--schedule and --virtual-stages choose how a pipeline runs: they need --pp 2 "
                 "or more");
  FIVEFOLD_CHECK(layout.cp > 1 || (layout.cp_layout == defaults.cp_layout &&
                                   layout.cp_attention == defaults.cp_attention),
                 "--cp-layout and --cp-attention choose how context parallelism splits and "
                 "attends: they need --cp 2 or more");
  return layout;
}

ch15::Workload workload_of(const RunConfig& run) {
  ch15::Workload work{run.model, run.seq_len, run.batch, run.micro_batches,
                      run.fast ? TiledCausalAttentionKernel::kDefaultTile : 0,
                      recompute_config(run), nullptr};
  if (run.fast)  // fast.h: the fast kernels'
    work.block_activations = [](auto&&... block) { return block_activation_bytes(block...); };
  work.precision = ch14::parse_precision(run.precision);
  return work;
}

int64_t available_memory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

void check_fits_in_memory(const RunConfig& run, const ch15::Layout& layout, int local_ranks,
                          int64_t world_size) {
  const int64_t available = available_memory();
  if (available <= 0) return;
  const ch14::Precision precision = ch14::parse_precision(run.precision);
  const int64_t psi = ch07::count_parameters(run.model).total;
  const int64_t dp = layout.dp * layout.cp;
  const bool bf16 = precision == ch14::Precision::Bf16;
  const auto m = ch09::zero_memory_formula(psi, dp, layout.zero, ch14::bytes_per_number(precision));
  const double per_rank = static_cast<double>(m.parameters + m.gradients + m.optimizer);
  const double need = per_rank * local_ranks;
  const double gb = 1e9, free = static_cast<double>(available);
  FIVEFOLD_CHECK(need <= free, "the model has ", psi,
                 " parameters: its weights, gradients and AdamW state (",
                 bf16 ? "bf16, with fp32 master weights" : "fp32", ") take ", per_rank / gb,
                 " GB per rank (ZeRO-", layout.zero, " over ", dp, " ranks) x ", local_ranks,
                 " ranks on this machine = ", need / gb, " GB, more than the ", free / gb,
                 " GB available (activations not counted); use a smaller model, more ranks or a "
                 "higher --zero stage");
  // Under ZeRO-3 a rank holds 1/N of everything while it trains, but the last step's evaluation
  // gathers the whole model on every rank (full_model: 4 bytes a parameter), and a checkpoint
  // AdamW's moments too, on the writer alone (8 more: the others send it their shards and hold
  // nothing more, optimizer_state_for_writer; counted on every machine, the writer's or not).
  if (layout.zero == 3) {
    const double whole = 4.0 * static_cast<double>(psi);
    const double gathered = whole * local_ranks + (run.out_dir.empty() ? 0.0 : 2 * whole);
    const double at_save = need + gathered;
    FIVEFOLD_CHECK(at_save <= free, "ZeRO-3 holds ", per_rank / gb, " GB of state a rank, but ",
                   run.out_dir.empty() ? "the evaluation gathers the whole model on every rank"
                                       : "each checkpoint gathers the whole model on every rank "
                                         "and AdamW's moments on the writer",
                   ", ", gathered / gb, " GB more on this machine: ", at_save / gb, " GB for its ",
                   local_ranks, " ranks, more than the ", free / gb,
                   " GB available; use fewer ranks a machine (more machines) or a "
                   "smaller model");
  }
  // What every rank's blocks keep for backward (pipeline stage 0 keeps the most under 1F1B),
  // over the world: a machine holds its local ranks' share, at least the mean over machines.
  int64_t kept = 0;
  try {
    const ch15::Workload work = workload_of(run);
    for (int64_t rank = 0; rank < world_size; ++rank)
      kept += ch15::predicted_activations(layout, work, rank, precision).peak();
  } catch (const Error&) {
    return;  // no formula for this architecture and recomputation
  }
  const double share = static_cast<double>(local_ranks) / static_cast<double>(world_size);
  const double activations = static_cast<double>(kept) * share;
  const double with_kept = need + activations;
  FIVEFOLD_CHECK(with_kept <= free, "the weights, gradients and AdamW state take ", need / gb,
                 " GB for the ", local_ranks,
                 " ranks on this machine, and the blocks' "
                 "activations ",
                 activations / gb,
                 " GB more (chapter 14's formulas: ", run.batch / (layout.dp * run.micro_batches),
                 " rows of ", run.seq_len, " tokens a micro-batch, --recompute ", run.recompute,
                 ", ", run.precision, "): ", with_kept / gb, " GB, more than the ", free / gb,
                 " GB available; use --recompute full, more --accum (smaller micro-batches), a "
                 "shorter --seq or more ranks");
}

nlohmann::json run_inputs(const RunConfig& run, const ch15::Layout& layout, bool resume) {
  auto fingerprint = [](const std::string& path) -> nlohmann::json {
    try {
      return io::file_fingerprint(path);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
  };
  nlohmann::json inputs = {{"settings", run_to_json(run)},
                           {"layout", layout.describe()},
                           {"kernels", run.fast ? "the fast paths" : "the lesson's"}};
  if (!run.data.path.empty()) inputs["data '" + run.data.path + "'"] = fingerprint(run.data.path);
  if (resume) {
    try {
      const std::string checkpoint = resolve_checkpoint(run.out_dir);
      inputs["checkpoint"] = {
          {"folder", std::filesystem::path(checkpoint).filename().string()},
          {"trainer_state.json", fingerprint(checkpoint + "/trainer_state.json")}};
    } catch (const std::exception& e) {
      inputs["checkpoint"] = std::string(e.what());
    }
  }
  return inputs;
}

namespace {

// Where `a` (rank 0's) and `b` (rank `r`'s) differ, objects compared key by key: "key: rank 0
// A, rank r B".
void differences(const nlohmann::json& a, const nlohmann::json& b, const std::string& at,
                 const std::string& r, std::vector<std::string>& out) {
  if (a.is_object() && b.is_object()) {
    std::set<std::string> keys;
    for (const auto& item : a.items()) keys.insert(item.key());
    for (const auto& item : b.items()) keys.insert(item.key());
    for (const auto& key : keys)
      differences(a.contains(key) ? a[key] : nlohmann::json(),
                  b.contains(key) ? b[key] : nlohmann::json(), at.empty() ? key : at + "." + key, r,
                  out);
  } else if (a != b) {
    auto shown = [](const nlohmann::json& v) {
      return v.is_null() ? std::string("(none)") : v.is_string() ? v.get<std::string>() : v.dump();
    };
    out.push_back(at + ": rank 0 " + shown(a) + ", rank " + r + " " + shown(b));
  }
}

}  // namespace

void agree_on_inputs(const nlohmann::json& mine, dist::Communicator& world) {
  const std::vector<nlohmann::json> all =
      all_gather_json({{"inputs", mine}, {"host", io::host_name()}}, world);
  for (size_t r = 1; r < all.size(); ++r) {
    std::vector<std::string> said;
    differences(all[0]["inputs"], all[r]["inputs"], "", std::to_string(r), said);
    if (said.empty()) continue;
    std::string list;
    for (const auto& line : said) list += (list.empty() ? "" : "; ") + line;
    throw Error("rank " + std::to_string(r) + " (on " + all[r]["host"].get<std::string>() +
                ") reads other inputs than rank 0 (on " + all[0]["host"].get<std::string>() +
                "): " + list +
                ". Every process must read the same files: put --data, --config, "
                "--model-config and --out where every machine sees the same ones (one file "
                "system they share), or copy them alike");
  }
}

void use_layout(const ch15::Layout& layout, const dist::CommunicatorPtr& world, RunConfig& run) {
  // Before the first collective (apply_layout's), on every rank alike.
  FIVEFOLD_CHECK(run.recompute_stages >= 0 && run.recompute_stages <= layout.pp,
                 "--recompute-stages ", run.recompute_stages, " names more pipeline stages than "
                 "the layout has (--pp ", layout.pp, ")");
  const ch15::RankSetup setup = ch15::apply_layout(layout, world);
  run.build_model = setup.build_model;
  run.make_step = setup.make_step;
  run.after_step = setup.after_step;
  run.placement = {setup.data_rank, setup.data_ranks, setup.processes, setup.writer,
                   layout.place(world->rank()).pp, world};
}

namespace {

// This rank's measurement beside the predictions for its part of the model, built again here
// offline (what `fivefold train --plan` counts).
RankMeasurement measure_against_plan(const ch15::Layout& layout, const ch15::Workload& work,
                                     int64_t rank, const StepMeter& meter, int64_t steps) {
  ch03::Transformer held_model = meter.held();
  const ch15::TrainableCounts counted = ch15::count_trainable(held_model);
  ch15::HeldParameters held;
  static_cast<ch15::TrainableCounts&>(held) = counted;
  try {
    held = ch15::rank_parameters(layout, work, rank);
  } catch (const Error&) {
    // a part that cannot be built offline: the run's own counts, and no tp prediction
  }
  if (held.elements != counted.elements || held.tensors != counted.tensors)
    log(LogLevel::Warn) << "the plan's part of the model holds " << held.elements
                        << " parameters in " << held.tensors << " tensors, the run's "
                        << counted.elements << " in " << counted.tensors
                        << ": the predictions below follow the plan's";
  RankMeasurement mine = measure_rank(meter.training_comm());
  mine.predicted_bytes = ch15::predicted_run_traffic(layout, work, rank, held, steps,
                                                     meter.steps_after_whole_model());
  if (steps > 0) {
    mine.state_bytes = meter.state().total();
    mine.matmul_flops = meter.step_flops();
  }
  if (held.elements > 0)
    mine.predicted_state_bytes =
        ch15::predicted_state_bytes(layout, held, work.precision).total();
  try {
    mine.predicted_matmul_flops = ch15::predicted_flops(layout, work, rank, held).total();
  } catch (const Error&) {
    // no matrices known (a part not built offline) or experts with a capacity: not predicted
  }
  mine.flops_exact_per_rank = layout.ep == 1;  // under ep each rank computes what it was sent
  return mine;
}

}  // namespace

void report_measurements(const ch15::Layout& layout, const dist::CommunicatorPtr& world,
                         const RunConfig& run, const StepMeter& meter, int64_t steps) {
  const auto measured = gather_measurements(
      world, measure_against_plan(layout, workload_of(run), world->rank(), meter, steps));
  if (!run.placement.writer || steps == 0) return;
  log0() << "measured over " << steps << " training steps (payload bytes handed to each "
         << "communicator; evaluation and checkpoints not counted), beside chapters 09-13's "
         << "formulas (per training step; '-': no formula here; '~': ep's balanced-routing "
         << "expectation):\n"
         << measurement_table(measured, steps);
  if (run.out_dir.empty()) return;
  nlohmann::json report = measurement_json(measured, steps);
  report["layout"] = layout.describe();
  report["steps"] = steps;
  io::write_json(run.out_dir + "/measured.json", report);
}

}  // namespace fivefold::runtime
