// fivefold plan --search: the layouts of a cluster for a model, fastest first (chapter 15's
// planner), as a table or JSON.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "07_moe/moe.h"
#include "14_memory/recompute.h"
#include "15_trainer_5d/planner.h"
#include "fivefold/cli.h"
#include "fivefold/consolidate.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/log.h"
#include "fivefold/progress.h"
#include "fivefold/runtime.h"
#include "plan_sections.h"
#include "runtime/calibrate.h"
#include "runtime/cluster.h"
#include "runtime/fast.h"
#include "runtime/settings.h"

namespace fivefold::commands {

ch03::ModelConfig llama_config(const ch02::TransformerShape& shape) {
  FIVEFOLD_CHECK(shape.gated_mlp && !shape.layer_norm && !shape.biases,
                 "fivefold plan --search: the planner models Llama-shaped models (RMSNorm, "
                 "SwiGLU, no biases), not --gpt2");
  ch03::ModelConfig config;
  config.vocab_size = shape.vocab_size;
  config.d_model = shape.d_model;
  config.n_layers = shape.n_layers;
  config.n_heads = shape.n_heads;
  config.n_kv_heads = shape.n_kv_heads;
  config.head_dim = shape.head_dim;
  config.d_ff = shape.d_ff;
  config.tied_embeddings = shape.tied_embeddings;
  config.rope_theta = 10000;
  return config;
}

namespace {

nlohmann::json candidate_json(const ch15::Candidate& c) {
  const ch15::StepEstimate& e = c.estimate;
  return {{"layout", c.layout.describe()},
          {"dp", c.layout.dp},
          {"tp", c.layout.tp},
          {"pp", c.layout.pp},
          {"cp", c.layout.cp},
          {"ep", c.layout.ep},
          {"zero", c.layout.zero},
          {"sequence_parallel", c.layout.sequence_parallel},
          {"schedule", c.layout.schedule},
          {"virtual_stages", c.layout.virtual_stages},
          {"micro_batches", c.micro_batches},
          {"recompute", ch14::to_string(c.recompute)},
          {"step_s", e.step},
          {"compute_s", e.compute},
          {"exposed_s", e.exposed},
          {"bubble_s", e.bubble},
          {"state_bytes", e.state_bytes},
          {"activation_bytes", e.activation_bytes},
          {"mfu", e.mfu},
          {"tokens_per_second", e.tokens_per_second}};
}

// What the flags fix of the layouts searched (0 or unset: any), and how many to keep.
ch15::SearchLimits search_limits(const ArgParser& args) {
  const int64_t top = args.integer("top");
  FIVEFOLD_CHECK(top >= 1, "--top must be >= 1");
  ch15::SearchLimits limits;
  limits.keep = top;
  limits.max_micro_batches = args.integer("max-micro-batches");
  limits.dp = args.integer("dp");
  limits.tp = args.integer("tp");
  limits.pp = args.integer("pp");
  limits.cp = args.integer("cp");
  limits.ep = args.integer("ep");
  if (args.given("zero")) limits.zero = static_cast<int>(args.integer("zero"));
  if (args.given("schedule")) limits.schedule = args.str("schedule");
  if (args.given("virtual-stages")) limits.virtual_stages = args.integer("virtual-stages");
  if (args.given("micro-batches")) limits.micro_batches = args.integer("micro-batches");
  if (args.given("recompute")) limits.recompute = ch14::parse_recompute(args.str("recompute"));
  return limits;
}

// The search's table: the cluster, the workload, then the best layouts, fastest first, with each
// parallelism's exposed communication (ep's column only for a model with routed experts).
void print_search(const ch15::Cluster& cluster, const ch15::Workload& work,
                  ch14::Precision precision, const ch15::Search& found) {
  std::printf("cluster   %s: %lld devices, %lld a node, %s each\n", cluster.name.c_str(),
              static_cast<long long>(cluster.devices),
              static_cast<long long>(cluster.devices_per_node),
              si(cluster.memory_bytes, "B").c_str());
  std::printf(
      "workload  batch %lld x seq %lld, %s: %lld layouts the trainer accepts, %lld fit "
      "in memory\n",
      static_cast<long long>(work.batch), static_cast<long long>(work.seq_len),
      ch14::to_string(precision).c_str(), static_cast<long long>(found.valid),
      static_cast<long long>(found.fit));
  FIVEFOLD_CHECK(!found.best.empty(), "fivefold plan --search: no layout of ", cluster.devices,
                 " devices fits this model in ", si(cluster.memory_bytes, "B"), " a device (",
                 found.dropped, " tried)");
  const bool experts = ch07::has_routed_experts(work.model);
  std::printf("%4s  %-9s %-9s %-9s %-9s %-9s%s %-9s %-9s %-9s %-6s %s\n", "#", "step s", "compute",
              "tp", "cp", "pp", experts ? " ep       " : "", "dp", "bubble", "memory", "MFU",
              "layout");
  for (size_t i = 0; i < found.best.size(); ++i) {
    const ch15::Candidate& c = found.best[i];
    const ch15::StepEstimate& e = c.estimate;
    char ep[16] = "";
    if (experts)
      std::snprintf(ep, sizeof ep, " %-9.3g", e.exposed.count("ep") ? e.exposed.at("ep") : 0.0);
    std::printf(
        "%4zu  %-9.4g %-9.4g %-9.3g %-9.3g %-9.3g%s %-9.3g %-9.3g %-9s %-6.3f %s, m %lld, "
        "recompute %s\n",
        i + 1, e.step, e.compute, e.exposed.at("tp"), e.exposed.at("cp"), e.exposed.at("pp"), ep,
        e.exposed.at("dp"), e.bubble, si(static_cast<double>(e.memory_bytes()), "B").c_str(), e.mfu,
        c.layout.describe().c_str(), static_cast<long long>(c.micro_batches),
        ch14::to_string(c.recompute).c_str());
  }
}

}  // namespace

int plan_search(const ArgParser& args, const ch03::ModelConfig& model, int64_t context) {
  FIVEFOLD_CHECK(args.given("cluster"),
                 "fivefold plan --search: give --cluster FILE (presets in "
                 "chapters/15_trainer_5d/presets/clusters/)");
  FIVEFOLD_CHECK(args.integer("batch") >= 1,
                 "fivefold plan --search: give --batch, the global "
                 "batch in sequences");
  ch15::Cluster cluster = runtime::read_cluster(args.str("cluster"));
  if (args.given("devices")) cluster.devices = args.integer("devices");
  ch15::Workload work;
  work.model = model;
  work.seq_len = context;
  work.batch = args.integer("batch");
  work.block_activations = [](auto&&... block) {  // the training run's fast kernels
    return runtime::block_activation_bytes(block...);
  };
  const auto precision = ch14::parse_precision(args.str("precision"));
  ch15::SearchLimits limits = search_limits(args);
  // Progress on stderr (a search of millions of layouts takes minutes): the splits of the devices
  // (tp, cp, pp, ep) done, the layouts priced and fitting so far.
  std::unique_ptr<ProgressBar> bar;
  limits.progress = [&bar, &args](int64_t done, int64_t total, const ch15::Search& so_far) {
    if (!bar) bar = std::make_unique<ProgressBar>(total, "search", !args.on("no-progress"));
    const std::string status =
        std::to_string(so_far.valid) + " layouts, " + std::to_string(so_far.fit) + " fit";
    bar->update(done, status);
    if (done == total) bar->finish(status);
  };
  const ch15::Search found = ch15::search_layouts(work, cluster, precision, limits);
  if (args.on("json")) {
    nlohmann::json out = {{"cluster", cluster.name},
                          {"devices", cluster.devices},
                          {"valid", found.valid},
                          {"fit", found.fit},
                          {"dropped_for_memory", found.dropped},
                          {"best", nlohmann::json::array()}};
    for (const auto& candidate : found.best) out["best"].push_back(candidate_json(candidate));
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  print_search(cluster, work, precision, found);
  return 0;
}

namespace {

// Why a file cannot be written at `path` (its folder missing or not writable, or `path` a
// folder), or "" when it can.
std::string unwritable(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (fs::is_directory(path, error)) return "--cluster-out '" + path + "' is a folder: give a file";
  const fs::path folder =
      fs::path(path).parent_path().empty() ? fs::path(".") : fs::path(path).parent_path();
  if (!fs::is_directory(folder, error))
    return "--cluster-out '" + path + "': the folder '" + folder.string() + "' does not exist";
  if (::access(folder.c_str(), W_OK) != 0)
    return "--cluster-out '" + path + "': the folder '" + folder.string() + "' is not writable";
  return "";
}

}  // namespace

int calibrate(int argc, char** argv) {
  ArgParser args("fivefold calibrate",
                 "This machine as chapter 15's planner describes a cluster, measured on the ranks "
                 "of the job (under mpirun, one rank a device): the step's product rate in fp32 "
                 "and bf16 (every rank training the model alone, at once), each of the step's "
                 "product shapes alone (a product's latency) and the memory's bandwidth, the "
                 "attention kernel's rate, the links' latency "
                 "and bandwidth (all-reduces and ring send/receives), the memory each rank may "
                 "use. Writes the cluster file `fivefold plan --search --cluster` reads.");
  args.option("cluster-out", "", "where to write the cluster's TOML file (required)");
  args.option("timed-steps", "10", "steps timed in each precision (after one warm-up step)");
  args.option("sizes", "4096,65536,1048576,4194304", "message sizes in bytes");
  runtime::declare_run_flags(args);  // the model, --seq and --batch of the step that is timed
  if (!args.parse(argc, argv)) return 0;
  FIVEFOLD_CHECK(!args.str("cluster-out").empty(), "fivefold calibrate: give --cluster-out FILE");
  FIVEFOLD_CHECK(!args.given("out"),
                 "fivefold calibrate: it trains nothing it keeps: "
                 "leave out --out (the cluster goes to --cluster-out)");
  runtime::CalibrationOptions options;
  options.run = runtime::run_from_flags(args);
  options.run.model.validate();
  options.steps = args.integer("timed-steps");
  FIVEFOLD_CHECK(options.steps >= 1, "--timed-steps must be at least 1");
  options.sizes = args.integers("sizes");
  FIVEFOLD_CHECK(options.sizes.size() >= 2,
                 "--sizes needs two message sizes or more (a line "
                 "through their times gives a link's latency and bandwidth)");
  for (const int64_t size : options.sizes)
    FIVEFOLD_CHECK(size >= 4, "--sizes: each message holds one float at least, got ", size);
  Runtime runtime;
  // Rank 0 writes the file: its verdict on where, agreed by every rank before minutes of
  // measuring.
  const std::string refused = first_said(
      runtime.world()->rank() == 0 ? unwritable(args.str("cluster-out")) : "", *runtime.world());
  FIVEFOLD_CHECK(refused.empty(), refused);
  const runtime::Calibration found = runtime::calibrate(runtime.world(), options);
  if (runtime.world()->rank() == 0) {
    io::write_file_atomic(args.str("cluster-out"), "# fivefold calibrate (" +
                                                       std::to_string(runtime.world()->size()) +
                                                       " ranks): " + found.measured.dump() + "\n" +
                                                       runtime::cluster_toml(found.cluster));
    log0() << "wrote " << args.str("cluster-out") << ": fp32 "
           << si(found.cluster.matmul_flops_fp32) << "FLOP/s, bf16 "
           << si(found.cluster.matmul_flops_bf16) << "FLOP/s a rank; latency "
           << found.cluster.intra_node.latency * 1e6 << " us, "
           << si(found.cluster.intra_node.bandwidth, "B/s");
    const auto& line = found.measured["product_line"];
    log0() << found.measured["products"].size() / 2
           << " product shapes alone: " << si(line["fp32"]["rate"].get<double>())
           << "FLOP/s fp32 + " << found.cluster.product_latency_fp32 * 1e6
           << " us a product (every shape within "
           << std::lround(100 * line["fp32"]["worst_error"].get<double>()) << "%), "
           << si(line["bf16"]["rate"].get<double>()) << "FLOP/s bf16 + "
           << found.cluster.product_latency_bf16 * 1e6 << " us (within "
           << std::lround(100 * line["bf16"]["worst_error"].get<double>()) << "%); memory "
           << si(found.cluster.memory_bandwidth, "B/s");
  }
  return 0;
}

}  // namespace fivefold::commands
