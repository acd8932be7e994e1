// fivefold tokenize / compare: a user's corpus into tokens, and two runs side by side.
//
//   fivefold tokenize ...   runs fivefold-tokenize (programs/tokenize.cpp) with the same options
//   fivefold compare --runs runs/5d,runs/single --labels 5D,single [--svg curves.svg]

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "runtime/report.h"
#include "commands.h"
#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/log.h"

namespace fivefold::commands {

int tokenize(int argc, char** argv) {
  // SentencePiece's library carries its own copy of protobuf, which cannot share a process with
  // LibTorch's: the tokenizer is a separate program beside this one, which this runs.
  const auto self = std::filesystem::read_symlink("/proc/self/exe");
  const std::string tool = (self.parent_path() / "fivefold-tokenize").string();
  FIVEFOLD_CHECK(std::filesystem::exists(tool), "fivefold tokenize: '", tool,
                 "' is missing (build the fivefold-tokenize target)");
  std::vector<char*> args{const_cast<char*>(tool.c_str())};
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  execv(tool.c_str(), args.data());
  throw Error("fivefold tokenize: cannot run '" + tool + "': " + std::strerror(errno));
}

int compare(int argc, char** argv) {
  ArgParser args("fivefold compare",
                 "Compares the training curves (loss and gradient norm by step, from "
                 "metrics.jsonl) of a run with a reference run: a table, the largest relative "
                 "differences, optionally an SVG plot of every run given. Exits 1 when the loss "
                 "or the gradient norm differs by more than --tolerance (relative).");
  args.option("runs", "", "run folders (or metrics.jsonl files), comma-separated; the last is "
              "the reference");
  args.option("labels", "", "names for the runs, comma-separated (default: the folders)");
  args.option("svg", "", "write an SVG plot of the loss curves here");
  args.option("rows", "10", "table rows (evenly spaced steps)");
  args.option("tolerance", "0",
              "largest relative difference of the loss and of the gradient norm accepted (0: "
              "report only)");
  args.option("check-steps", "0",
              "apply --tolerance to the first this many steps only (0: all); fp32 runs in other "
              "layouts drift apart as training goes on");
  if (!args.parse(argc, argv)) return 0;
  const auto runs = args.strings("runs");
  FIVEFOLD_CHECK(runs.size() >= 2, "fivefold compare: --runs needs at least two runs");
  auto labels = args.strings("labels");
  if (labels.empty()) labels = runs;
  FIVEFOLD_CHECK(labels.size() == runs.size(), "fivefold compare: ", labels.size(),
                 " labels for ", runs.size(), " runs");
  std::vector<runtime::Curve> curves;
  for (size_t i = 0; i < runs.size(); ++i)
    curves.push_back(runtime::read_curve(runs[i], labels[i]));
  const runtime::Curve& reference = curves.back();
  const double tolerance = args.real("tolerance");
  const int64_t check_steps = args.integer("check-steps");
  FIVEFOLD_CHECK(check_steps >= 0, "--check-steps must be >= 0");
  bool within = true;
  for (size_t i = 0; i + 1 < curves.size(); ++i) {
    const auto d = runtime::compare_curves(curves[i], reference);
    std::printf("%s\n", runtime::curve_table(curves[i], reference, args.integer("rows")).c_str());
    std::printf("%s vs %s over %lld steps: loss differs by at most %.2e (relative, at step "
                "%lld), gradient norm by at most %.2e\n",
                curves[i].label.c_str(), reference.label.c_str(),
                static_cast<long long>(d.steps), d.max_loss_relative,
                static_cast<long long>(d.worst_step), d.max_norm_relative);
    if (tolerance <= 0) continue;
    runtime::Curve checked = curves[i];  // the steps --tolerance applies to
    while (check_steps > 0 && !checked.steps.empty() && checked.steps.back() > check_steps) {
      checked.steps.pop_back();
      checked.loss.pop_back();
      checked.grad_norm.pop_back();
    }
    const auto c = runtime::compare_curves(checked, reference);
    const bool ok = c.max_loss_relative <= tolerance && c.max_norm_relative <= tolerance;
    std::printf("%s: over %s%lld steps the loss is within %.2e and the gradient norm within "
                "%.2e of %s's (tolerance %g)\n",
                ok ? "ok" : "FAILED", check_steps > 0 ? "the first " : "",
                static_cast<long long>(c.steps), c.max_loss_relative, c.max_norm_relative,
                reference.label.c_str(), tolerance);
    within = within && ok;
  }
  std::printf("\n");
  if (!args.str("svg").empty()) {
    io::write_file_atomic(args.str("svg"), runtime::svg_plot(curves, "training loss by step"));
    std::printf("wrote %s\n", args.str("svg").c_str());
  }
  if (!within) {
    std::fprintf(stderr, "fivefold compare: the curves differ by more than --tolerance %g\n",
                 tolerance);
    return 1;
  }
  return 0;
}

}  // namespace fivefold::commands
