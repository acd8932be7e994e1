// Chapter 11's benchmark: each pipeline schedule on the real model over every rank (pp = the world
// size, dp 1): the measured step time and tokens/s, each rank's idle share of the last step from
// its executed timeline, against the simulator's bubble with unit costs. Writes each schedule's
// timeline as Chrome trace JSON and SVG (executed and simulated) into --out.
//
//   mpirun -np 2 -x OMP_NUM_THREADS=1 -x OMP_WAIT_POLICY=passive build/bin/bench_pp_schedules
//   benchmarks/run_pp_schedules.sh build        (one process, then pp 2 and pp 4)
//
// Step times are medians of --steps steps after 1 warm-up step, the slowest rank's.

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "runtime/pipeline_trace.h"
#include "bench_model.h"
#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"

using namespace fivefold;
using namespace fivefold::ch03;

namespace {

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  FIVEFOLD_CHECK(out.good(), "cannot write ", path);
  out << text;
}

int run(int argc, char** argv) {
  ArgParser args("bench_pp_schedules",
                 "Step time and idle share of every pipeline schedule (pp = the world size), "
                 "against the simulated bubble; traces and pictures into --out.");
  args.option("steps", "3", "timed steps per schedule");
  args.option("d-model", "256", "hidden size").option("n-layers", "8", "blocks");
  args.option("seq", "128", "tokens per row").option("batch", "16", "batch (rows)");
  args.option("micro-batches", "8", "micro-batches per step (m)");
  args.option("out", "pp_schedules", "folder for the traces and pictures");
  if (!args.parse(argc, argv)) return 0;
  FIVEFOLD_CHECK(args.integer("steps") >= 1, "--steps must be at least 1");
  Runtime runtime;
  auto world = runtime.world();
  const int p = world->size();
  auto config = bench::bench_model(args.integer("d-model"), args.integer("n-layers"));
  config.rope_theta = 10000;
  const int64_t batch = args.integer("batch"), seq = args.integer("seq"),
                m = args.integer("micro-batches");
  FIVEFOLD_CHECK(m >= 1 && batch % m == 0, "--micro-batches ", m, " must divide --batch ", batch);
  const std::string out = args.str("out");
  if (world->rank() == 0) {
    std::filesystem::create_directories(out);
    std::printf(
        "pp %d (%d thread(s) each); d_model %lld, %lld layers, batch %lld x %lld in %lld "
        "micro-batches\n",
        p, torch::get_num_threads(), static_cast<long long>(config.d_model),
        static_cast<long long>(config.n_layers), static_cast<long long>(batch),
        static_cast<long long>(seq), static_cast<long long>(m));
    std::printf("%-12s %3s %10s %11s %14s %14s %10s\n", "schedule", "v", "step ms", "tokens/s",
                "idle mean", "idle max", "simulated");
  }
  const TokenDataset data(ByteTokenizer::encode(synthetic_corpus(0, Split::Train, 3000)));
  const BatchSampler sampler(data, seq, batch, 0);
  auto dp = world->split(world->rank(), 0, "dp");  // every rank alone: dp 1
  auto links = std::make_shared<ch11::PipelineLinks>(world);
  for (const auto& name : ch11::schedule_names()) {
    const int64_t v = name == "interleaved" ? 2 : 1;
    if (p * v > config.n_layers || (name == "interleaved" && m % p != 0)) continue;
    ch11::PipelineLayout layout;
    layout.links = links;
    layout.dp = dp;
    layout.model_parallel = world;
    layout.schedule = name;
    layout.virtual_stages = v;
    TrainConfig t;
    auto step = ch11::pipeline_parallel_step(layout, ch07::make_model)(ch07::make_model(config), t);
    std::vector<double> times;
    for (int64_t s = 0; s < args.integer("steps") + 1; ++s) {
      const auto rows = sampler.batch(s);
      std::vector<Batch> micro;
      const auto inputs = rows.inputs.chunk(m), targets = rows.targets.chunk(m);
      for (int64_t i = 0; i < m; ++i)
        micro.push_back({inputs[static_cast<size_t>(i)], targets[static_cast<size_t>(i)]});
      world->barrier();
      Timer timer;
      step->step(micro, s);
      auto seconds = torch::tensor({timer.seconds()}, torch::kDouble);
      world->all_reduce(seconds, dist::ReduceOp::Max);  // the slowest rank's step
      if (s >= 1) times.push_back(seconds.item<double>());
    }
    const double median = fivefold::median(times);
    const auto& executor = dynamic_cast<ch11::PipelineParallelStep&>(*step).executor();
    const auto timelines = runtime::gather_timelines(executor, *world);
    const auto simulation = ch11::simulate(ch11::make_schedule(name, p, v, m));
    if (world->rank() == 0) {
      const auto idle = runtime::idle_shares(timelines);
      double mean = 0;
      for (double x : idle) mean += x / static_cast<double>(idle.size());
      std::printf("%-12s %3lld %10.1f %11.0f %13.1f%% %13.1f%% %9.1f%%\n", name.c_str(),
                  static_cast<long long>(v), median * 1e3,
                  static_cast<double>(batch * seq) / median, 100 * mean,
                  100 * *std::max_element(idle.begin(), idle.end()), 100 * simulation.bubble());
      const std::string stem = out + "/pp" + std::to_string(p) + "-" + name;
      write(stem + ".trace.json", runtime::chrome_trace(timelines).dump());
      write(stem + ".svg",
            runtime::timeline_svg(timelines, name + ", pp " + std::to_string(p) + ", m " +
                                              std::to_string(m) + ": executed (seconds)"));
      write(stem + "-simulated.svg",
            runtime::timeline_svg(runtime::simulated_timelines(simulation),
                               name + ", pp " + std::to_string(p) + ", m " + std::to_string(m) +
                                   ": simulated, F = B = W = 1"));
    }
  }
  if (world->rank() == 0)
    std::printf("traces (open in https://ui.perfetto.dev) and pictures in %s/\n", out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fivefold::run_guarded("bench_pp_schedules", [&] { return run(argc, argv); });
}
