// The small things of fivefold_common: argument parsing, per-name seeding and shards, tensor
// comparison reports, reading the launcher's environment, and the BLAS check.

#include <filesystem>
#include <fstream>
#include <cstdlib>

#include "fivefold/blas.h"
#include "fivefold/cli.h"
#include "fivefold/dist.h"
#include "fivefold/error.h"
#include "fivefold/memory.h"
#include "fivefold/runtime.h"
#include "fivefold/seed.h"
#include "fivefold/svg.h"
#include "fivefold/trace.h"
#include "testing.h"

using fivefold::Error;
namespace trace = fivefold::trace;
namespace svg = fivefold::svg;

namespace {
fivefold::ArgParser make_parser() {
  fivefold::ArgParser parser("prog", "test program");
  parser.option("steps", "10", "optimizer steps").option("lr", "3e-4", "learning rate");
  parser.option("ranks", "2,4", "rank counts")
      .option("name", "", "a name")
      .flag("json", "print JSON");
  return parser;
}

bool parse(fivefold::ArgParser& parser, std::vector<const char*> args) {
  args.insert(args.begin(), "prog");
  return parser.parse(static_cast<int>(args.size()), args.data());
}
}  // namespace

TEST(ArgParser, DefaultsValuesAndFlags) {
  auto parser = make_parser();
  ASSERT_TRUE(parse(parser, {"--steps", "25", "--lr=0.01", "--json"}));
  EXPECT_EQ(parser.integer("steps"), 25);
  EXPECT_DOUBLE_EQ(parser.real("lr"), 0.01);
  EXPECT_TRUE(parser.on("json"));
  EXPECT_EQ(parser.integers("ranks"), (std::vector<int64_t>{2, 4}));
  EXPECT_TRUE(parser.given("steps"));
  EXPECT_FALSE(parser.given("ranks"));
  EXPECT_NE(parser.help().find("--steps VALUE"), std::string::npos);
  EXPECT_NE(parser.help().find("(default: 10)"), std::string::npos);
}

TEST(ArgParser, BadInputIsAClearError) {
  auto unknown = make_parser();
  EXPECT_THROW(parse(unknown, {"--stpes", "3"}), Error);
  auto missing = make_parser();
  EXPECT_THROW(parse(missing, {"--steps"}), Error);
  auto stray = make_parser();
  EXPECT_THROW(parse(stray, {"oops"}), Error);
  auto flag_value = make_parser();
  EXPECT_THROW(parse(flag_value, {"--json=maybe"}), Error);
  auto not_int = make_parser();
  ASSERT_TRUE(parse(not_int, {"--steps", "12x", "--ranks", "2,x"}));
  EXPECT_TRUE(fivefold::testing::throws_error_containing([&] { not_int.integer("steps"); },
                                                         "--steps expects an integer, got '12x'"));
  EXPECT_THROW(not_int.integers("ranks"), Error);
  EXPECT_THROW(not_int.str("undeclared"), Error);
}

TEST(ArgParser, ConfigFileValuesYieldToTheCommandLine) {
  const auto dir = std::filesystem::temp_directory_path() / "fivefold-cli-config";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "run.toml").string();
  {
    std::ofstream file(path);
    file << "# a comment\nsteps = 40\nlr = 0.5\nname = \"from the file\"\njson = true\n";
  }
  auto parser = make_parser();
  parser.config_file("settings");
  ASSERT_TRUE(parse(parser, {"--config", path.c_str(), "--lr", "0.25"}));
  EXPECT_EQ(parser.integer("steps"), 40);          // from the file
  EXPECT_DOUBLE_EQ(parser.real("lr"), 0.25);        // the command line wins
  EXPECT_EQ(parser.str("name"), "from the file");
  EXPECT_TRUE(parser.on("json"));
  EXPECT_TRUE(parser.given("steps"));               // set by the file counts as given
  EXPECT_FALSE(parser.given("ranks"));
  EXPECT_NE(parser.help().find("--config FILE"), std::string::npos);

  // Every setting written out reads back to the same values; a flag set false stays off.
  const std::string again = (dir / "again.toml").string();
  {
    std::ofstream file(again);
    file << parser.settings_toml();
  }
  auto reread = make_parser();
  reread.config_file("settings");
  ASSERT_TRUE(parse(reread, {"--config", again.c_str(), "--json=false"}));
  EXPECT_EQ(reread.integer("steps"), 40);
  EXPECT_DOUBLE_EQ(reread.real("lr"), 0.25);
  EXPECT_EQ(reread.str("name"), "from the file");
  EXPECT_EQ(reread.integers("ranks"), (std::vector<int64_t>{2, 4}));
  EXPECT_FALSE(reread.on("json"));

  // A misspelt key is an error naming it; so is a file that does not exist.
  const std::string typo = (dir / "typo.toml").string();
  {
    std::ofstream file(typo);
    file << "stpes = 3\n";
  }
  auto bad = make_parser();
  bad.config_file("settings");
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { parse(bad, {"--config", typo.c_str()}); }, "unknown setting 'stpes'"));
  auto missing = make_parser();
  missing.config_file("settings");
  EXPECT_THROW(parse(missing, {"--config", "/nonexistent/run.toml"}), Error);
  // Without config_file(), --config is an unknown option.
  auto plain = make_parser();
  EXPECT_THROW(parse(plain, {"--config", path.c_str()}), Error);
}

TEST(Seeding, DependsOnSeedAndNameOnly) {
  EXPECT_EQ(fivefold::seed_for(1, "model.layers.0.mlp.up_proj.weight"),
            fivefold::seed_for(1, "model.layers.0.mlp.up_proj.weight"));
  EXPECT_NE(fivefold::seed_for(1, "a"), fivefold::seed_for(2, "a"));
  EXPECT_NE(fivefold::seed_for(1, "model.layers.0.mlp.up_proj.weight"),
            fivefold::seed_for(1, "model.layers.1.mlp.up_proj.weight"));
  auto a = torch::randn({8, 8}, fivefold::generator_for(7, "w"));
  auto b = torch::randn({8, 8}, fivefold::generator_for(7, "w"));
  auto c = torch::randn({8, 8}, fivefold::generator_for(7, "v"));
  EXPECT_TENSOR_EQ(a, b);
  EXPECT_FALSE(torch::equal(a, c));
}

TEST(Seeding, ShardsAreSlicesOfTheFullTensor) {
  auto full = torch::randn({12, 8}, fivefold::generator_for(3, "w"));
  for (int64_t parts : {1, 2, 3, 4}) {
    std::vector<torch::Tensor> rows;
    for (int64_t i = 0; i < parts; ++i) rows.push_back(fivefold::shard(full, 0, i, parts));
    EXPECT_TENSOR_EQ(torch::cat(rows, 0), full);
  }
  EXPECT_TENSOR_EQ(fivefold::shard(full, -1, 1, 2), full.narrow(1, 4, 4));
  // 12 rows into 5 parts: 3, 3, 2, 2, 2 (torch::tensor_split's rule), which concatenate back.
  EXPECT_EQ(fivefold::split_sizes(12, 5), (std::vector<int64_t>{3, 3, 2, 2, 2}));
  EXPECT_EQ(fivefold::split_offset(12, 3, 5), 8);
  std::vector<torch::Tensor> uneven;
  for (int64_t i = 0; i < 5; ++i) uneven.push_back(fivefold::shard(full, 0, i, 5));
  EXPECT_TENSOR_EQ(torch::cat(uneven), full);
  for (int64_t i = 0; i < 5; ++i)
    EXPECT_TENSOR_EQ(fivefold::shard(full, 0, i, 5), full.tensor_split(5)[static_cast<size_t>(i)]);
  EXPECT_THROW(fivefold::shard(full, 2, 0, 2), Error);  // no dimension 2
  EXPECT_THROW(fivefold::shard(full, 0, 4, 4), Error);  // no part 4 of 4
}

TEST(CompareTensors, ReportsTheWorstElement) {
  auto expected = torch::zeros({2, 3});
  auto actual = expected.clone();
  actual[1][2] = 0.5;
  auto diff = fivefold::compare_tensors(actual, expected, 1e-3, 0);
  EXPECT_FALSE(diff.close);
  EXPECT_EQ(diff.bad_count, 1);
  EXPECT_EQ(diff.where, "[1, 2]");
  EXPECT_DOUBLE_EQ(diff.max_abs_error, 0.5);
  EXPECT_NE(diff.report().find("[1, 2]"), std::string::npos);
  EXPECT_TRUE(fivefold::compare_tensors(actual, expected, 0.6, 0).close);
  EXPECT_TRUE(fivefold::compare_tensors(actual, actual, 0, 0).close);
  // NaN is close to nothing, itself included, unless the caller asks.
  EXPECT_FALSE(fivefold::compare_tensors(torch::full({2}, NAN), torch::full({2}, NAN), 0, 0).close);
  EXPECT_FALSE(fivefold::compare_tensors(torch::full({2}, NAN), torch::full({2}, NAN), 1, 1).close);
  EXPECT_TRUE(
      fivefold::compare_tensors(torch::full({2}, NAN), torch::full({2}, NAN), 0, 0, true).close);
  EXPECT_FALSE(
      fivefold::compare_tensors(torch::full({2}, NAN), torch::zeros({2}), 1, 1, true).close);
  EXPECT_FALSE(fivefold::compare_tensors(torch::full({2}, NAN), torch::zeros({2}), 1, 1).close);
  EXPECT_TRUE(fivefold::compare_tensors(torch::zeros({3}), torch::zeros({2}), 1, 1).shape_mismatch);
}

TEST(CompareTensors, AssertionsEvaluateEachArgumentOnce) {
  int calls = 0;
  auto counted = [&calls] {
    ++calls;
    return torch::ones({2});
  };
  EXPECT_TENSOR_EQ(counted(), counted());
  EXPECT_EQ(calls, 2);
  EXPECT_TENSOR_CLOSE(counted(), counted(), 0, 0);
  EXPECT_EQ(calls, 4);
}

namespace {
// Sets environment variables for one test and restores them afterwards.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::vector<std::pair<std::string, std::string>> vars) {
    for (const char* name : kLauncherVars) {
      if (const char* old = std::getenv(name)) saved_.emplace_back(name, old);
      unsetenv(name);
    }
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const char* name : kLauncherVars) unsetenv(name);
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }

 private:
  static constexpr const char* kLauncherVars[] = {"OMPI_COMM_WORLD_SIZE",
                                                  "OMPI_COMM_WORLD_RANK",
                                                  "OMPI_COMM_WORLD_LOCAL_RANK",
                                                  "OMPI_COMM_WORLD_LOCAL_SIZE",
                                                  "OMPI_MCA_ess_base_jobid",
                                                  "SLURM_PROCID",
                                                  "SLURM_NTASKS",
                                                  "SLURM_LOCALID",
                                                  "SLURM_JOB_ID",
                                                  "SLURM_STEP_ID",
                                                  "SLURM_NNODES",
                                                  "SLURM_NTASKS_PER_NODE",
                                                  "RANK",
                                                  "WORLD_SIZE",
                                                  "LOCAL_RANK",
                                                  "LOCAL_WORLD_SIZE",
                                                  "MASTER_ADDR",
                                                  "MASTER_PORT"};
  std::vector<std::pair<std::string, std::string>> saved_;
};
}  // namespace

TEST(LaunchEnvironment, ReadsEachLauncher) {
  {
    ScopedEnv env({{"OMPI_COMM_WORLD_SIZE", "8"},
                   {"OMPI_COMM_WORLD_RANK", "5"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                   {"OMPI_MCA_ess_base_jobid", "123"}});
    auto info = fivefold::read_launch_environment();
    EXPECT_EQ(info.launcher, "mpirun");
    EXPECT_EQ(info.rank, 5);
    EXPECT_EQ(info.size, 8);
    EXPECT_EQ(info.local_rank, 1);
    EXPECT_EQ(info.local_size, 4);
    EXPECT_EQ(info.job_id, "ompi-123");
  }
  {
    ScopedEnv env({{"SLURM_PROCID", "3"},
                   {"SLURM_NTASKS", "4"},
                   {"SLURM_LOCALID", "3"},
                   {"SLURM_JOB_ID", "77"}});
    auto info = fivefold::read_launch_environment();
    EXPECT_EQ(info.launcher, "srun");
    EXPECT_EQ(info.rank, 3);
    EXPECT_EQ(info.size, 4);
    EXPECT_EQ(info.job_id, "slurm-77.0");
  }
  {
    ScopedEnv env({{"RANK", "1"},
                   {"WORLD_SIZE", "2"},
                   {"LOCAL_RANK", "1"},
                   {"LOCAL_WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", "29511"}});
    auto info = fivefold::read_launch_environment();
    EXPECT_EQ(info.launcher, "torchrun");
    EXPECT_EQ(info.rank, 1);
    EXPECT_EQ(info.master_addr, "127.0.0.1");
    EXPECT_EQ(info.master_port, 29511);
  }
  {
    ScopedEnv env({});
    auto info = fivefold::read_launch_environment();
    EXPECT_EQ(info.launcher, "single");
    EXPECT_EQ(info.size, 1);
  }
}

TEST(LaunchEnvironment, InconsistentValuesAreErrors) {
  {
    ScopedEnv env({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
    EXPECT_THROW(fivefold::read_launch_environment(), Error);
  }
  {
    ScopedEnv env({{"RANK", "one"}, {"WORLD_SIZE", "2"}});
    EXPECT_THROW(fivefold::read_launch_environment(), Error);
  }
  {
    ScopedEnv env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}});
    EXPECT_THROW(fivefold::read_launch_environment(), Error);
  }
}

// An offline communicator knows its place and refuses every operation, split included, with an
// error naming the group; a rank outside the group is refused when it is made.
TEST(OfflineCommunicator, KnowsItsPlaceAndRefusesToCommunicate) {
  namespace dist = fivefold::dist;
  const auto comm = dist::offline_communicator(2, 4, "tp");
  EXPECT_EQ(comm->rank(), 2);
  EXPECT_EQ(comm->size(), 4);
  EXPECT_EQ(comm->name(), "tp");
  EXPECT_STREQ(dist::backend_name(comm->backend()), "offline");
  auto t = torch::ones({3});
  EXPECT_TRUE(fivefold::testing::throws_error_containing([&] { comm->all_reduce(t); },
                                                         "all_reduce on 'tp': an offline"));
  EXPECT_TRUE(fivefold::testing::throws_error_containing([&] { comm->all_gather(t); },
                                                         "cannot communicate"));
  EXPECT_TRUE(fivefold::testing::throws_error_containing([&] { comm->split(0, 0, "x"); },
                                                         "offline communicator (rank 2 of 4"));
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { comm->all_reduce_async(t).wait(); }, "cannot communicate"));
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [] { dist::offline_communicator(4, 4, "tp"); }, "rank 4 of 4"));
}

TEST(Blas, OpenBlasIsInUse) {
  // scripts/setup.sh installs libopenblas0-openmp; without it matmul is ~15x slower.
  const auto info = fivefold::detect_blas();
  EXPECT_FALSE(info.library.empty()) << "no BLAS library mapped";
  EXPECT_FALSE(info.reference) << "reference BLAS in use: " << info.library;
  EXPECT_GT(fivefold::measure_matmul_gflops(128), 0.0);
}

TEST(MemoryTracker, CountsLiveStorageAndPeak) {
  auto before = torch::ones({100});  // allocated before the tracker: never counted
  fivefold::MemoryTracker tracker;
  EXPECT_EQ(tracker.current_bytes(), 0);
  {
    auto a = torch::empty({1000});                    // 4000 bytes
    auto b = torch::empty({10, 10}, torch::kDouble);  // 800 bytes
    auto view = a.narrow(0, 0, 10);                   // a view: no storage of its own
    EXPECT_EQ(tracker.current_bytes(), 4800);
  }
  EXPECT_EQ(tracker.current_bytes(), 0);
  EXPECT_EQ(tracker.peak_bytes(), 4800);
  tracker.reset_peak();
  EXPECT_EQ(tracker.peak_bytes(), 0);
  before.mul_(2);  // in place on untracked storage: only the scalar's temporary, freed at once
  EXPECT_EQ(tracker.current_bytes(), 0);
  EXPECT_THROW(fivefold::MemoryTracker second, fivefold::Error);
}

TEST(MemoryTracker, StorageOutlivingTheTrackerIsReleasedCleanly) {
  torch::Tensor kept;
  {
    fivefold::MemoryTracker tracker;
    kept = torch::empty({64});
  }
  kept = torch::Tensor();  // freed after the tracker is gone: no crash, no count
  fivefold::MemoryTracker again;
  EXPECT_EQ(again.current_bytes(), 0);
}

TEST(MemoryTracker, StorageFromAnEarlierTrackerFreedLaterIsNotCounted) {
  torch::Tensor from_first;
  {
    fivefold::MemoryTracker first;
    from_first = torch::empty({256});  // 1024 bytes, counted by the first tracker only
  }
  fivefold::MemoryTracker second;
  auto own = torch::empty({10});  // 40 bytes
  from_first = torch::Tensor();   // freed now: not the second tracker's storage
  EXPECT_EQ(second.current_bytes(), 40);
}

// The timeline records only between start() and stop(); start() forgets the last recording;
// spans and recorded events come out as Chrome complete events in microseconds.
TEST(Trace, RecordsSpansOnlyWhileRecording) {
  { trace::Span ignored("before", "test"); }
  trace::start();
  { trace::Span span("step 1", "train"); }
  trace::record("send pp", "comm", 0.5, 0.25, trace::kWorker, {{"bytes", 64}});
  trace::stop();
  { trace::Span ignored("after", "test"); }
  const auto json = trace::chrome_trace(3);
  std::vector<nlohmann::json> complete;
  for (const auto& e : json["traceEvents"])
    if (e["ph"] == "X") complete.push_back(e);
  ASSERT_EQ(complete.size(), 2u);
  EXPECT_EQ(complete[0]["name"], "step 1");
  EXPECT_EQ(complete[0]["tid"], trace::kMain);
  EXPECT_GE(complete[0]["dur"].get<double>(), 0.0);
  EXPECT_EQ(complete[1]["name"], "send pp");
  EXPECT_EQ(complete[1]["pid"], 3);
  EXPECT_EQ(complete[1]["tid"], trace::kWorker);
  EXPECT_DOUBLE_EQ(complete[1]["ts"].get<double>(), 0.5e6);
  EXPECT_DOUBLE_EQ(complete[1]["dur"].get<double>(), 0.25e6);
  EXPECT_EQ(complete[1]["args"]["bytes"], 64);
  trace::start();
  trace::stop();
  for (const auto& e : trace::chrome_trace(0)["traceEvents"]) EXPECT_NE(e["ph"], "X");
}

// Any list of events (chapter 11's pipeline timelines) goes through the same writer: the process
// and its lanes named, each event a complete one in microseconds.
TEST(Trace, WritesAnyEventsAsChromeTrace) {
  const auto json = trace::chrome_trace({{"F 0", "F", 1, 0.002, 0.001, {{"stage", 1}}}}, 7,
                                        "pipeline", {{0, "rank 0"}, {1, "rank 1"}});
  const auto& events = json["traceEvents"];
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0]["name"], "process_name");
  EXPECT_EQ(events[0]["args"]["name"], "pipeline");
  EXPECT_EQ(events[2]["args"]["name"], "rank 1");
  EXPECT_EQ(events[3]["ph"], "X");
  EXPECT_EQ(events[3]["pid"], 7);
  EXPECT_EQ(events[3]["tid"], 1);
  EXPECT_DOUBLE_EQ(events[3]["ts"].get<double>(), 2000.0);
  EXPECT_DOUBLE_EQ(events[3]["dur"].get<double>(), 1000.0);
  EXPECT_EQ(events[3]["args"]["stage"], 1);
}

// One SVG writer for every picture: shapes in order, text escaped, tooltips; a line chart puts
// each series where its values say, with its label in the legend.
TEST(Svg, DrawsShapesAndLineCharts) {
  svg::Document picture(100, 50, 11);
  picture.rect(1, 2, 3, 4, "#fff", "", "F <0> & B");
  picture.text(5, 6, "a < b");
  const std::string doc = picture.str();
  EXPECT_EQ(doc.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"100\" height=\"50\"", 0),
            0u);
  EXPECT_NE(doc.find("<title>F &lt;0&gt; &amp; B</title></rect>"), std::string::npos);
  EXPECT_NE(doc.find(">a &lt; b</text>"), std::string::npos);
  EXPECT_EQ(doc.substr(doc.size() - 7), "</svg>\n");

  svg::LineChart chart;
  chart.title = "loss";
  chart.series = {{"run a", {0, 10}, {1, 2}, "", ""}, {"run b", {0, 10}, {2, 1}, "#123456", ""}};
  chart.y_min = 0;
  chart.y_max = 4;
  const std::string plot = svg::line_chart(chart);
  // 720 x 420 with margins 70 / 20 / 40 / 50: x 0 -> 70, x 10 -> 700; y 0 -> 370, y 4 -> 40.
  EXPECT_NE(plot.find("points=\"70.0,287.5 700.0,205.0 \""), std::string::npos) << plot;
  EXPECT_NE(plot.find("stroke=\"#123456\" stroke-width=\"1.8\" points=\"70.0,205.0 700.0,287.5 \""),
            std::string::npos);
  EXPECT_NE(plot.find(">run a</text>"), std::string::npos);
  EXPECT_NE(plot.find(">run b</text>"), std::string::npos);
  chart.series.clear();
  EXPECT_THROW(svg::line_chart(chart), Error);
  chart.series = {{"empty", {}, {}, "", ""}};
  EXPECT_THROW(svg::line_chart(chart), Error);
}
