// fivefold: the command-line program. Subcommands arrive with the chapters that build them.
//
//   fivefold info                 what this process sees: launcher, rank, backend, threads, BLAS
//   mpirun -np 4 fivefold info    the same on every rank (checks a launch works)
//   fivefold plan --config config.json [--tokens 2e12] [--budget 1e23] [--dp 64] [--json]
//                                 parameters, FLOPs, training time and memory (chapter 02;
//                                 deepseek_v3 configs: total and active parameters, chapter 07)
//   fivefold train / generate / eval
//                                 the chapters' model, in any layout (programs/model_commands.cpp)
//   fivefold tokenize / compare   a corpus into token ids; runs' curves side by side
//                                 (programs/data_commands.cpp)

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "02_flops_6np/flops.h"
#include "03_transformer/checkpoint.h"
#include "07_moe/moe.h"
#include "09_data_parallel/zero.h"
#include "10_tensor_parallel/plan.h"
#include "11_pipeline_parallel/plan.h"
#include "12_context_parallel/plan.h"
#include "13_expert_parallel/plan.h"
#include "commands.h"
#include "fivefold/blas.h"
#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/log.h"
#include "fivefold/runtime.h"

namespace {

int info(int argc, char** argv) {
  fivefold::ArgParser args("fivefold info",
                           "Prints what this process sees of the job and the machine.");
  if (!args.parse(argc, argv)) return 0;
  fivefold::Runtime runtime;
  auto world = runtime.world();
  const auto& launch = runtime.launch();
  const auto blas = fivefold::detect_blas();
  fivefold::log() << "launcher " << launch.launcher << ", backend "
                  << backend_name(world->backend()) << ", rank " << world->rank() << "/"
                  << world->size() << ", local rank " << launch.local_rank << "/"
                  << launch.local_size << ", torch threads " << torch::get_num_threads()
                  << ", BLAS " << blas.library << (blas.reference ? " (REFERENCE: slow)" : "")
                  << ", train's malloc on huge pages "
                  << (fivefold::huge_pages_wanted() ? "on"
                                                    : "off (FIVEFOLD_HUGE_PAGES=0, or "
                                                      "glibc before 2.35)");
  auto check = torch::ones({1});
  world->all_reduce(check);
  fivefold::log0() << "all-reduce over " << world->size() << " ranks: " << check.item<float>()
                   << (check.item<float>() == world->size() ? " (correct)" : " (WRONG)");
  return check.item<float>() == world->size() ? 0 : 1;
}

void usage() {
  std::printf(
      "usage: fivefold <command> [options]\n\n"
      "commands:\n"
      "  info      what this process sees: launcher, rank, backend, threads, BLAS\n"
      "  plan      parameters, FLOPs, training time and memory of a transformer\n"
      "  train     train the chapters' transformer, on one process or under mpirun in any\n"
      "            layout (dp, tp, pp, cp, ep; chapter 15), with checkpoints and resume\n"
      "  generate  continue a prompt from a checkpoint (greedy, temperature, top-k; KV cache)\n"
      "  eval      loss, perplexity and exact match of a checkpoint, or the logits of a "
      "sequence\n"
      "  tokenize  a text file into a .bin of token ids (SentencePiece)\n"
      "  calibrate this machine's cluster description for `plan --search`, measured (mpirun)\n"
      "  compare   training curves of runs side by side (table, SVG)\n\n"
      "Run `fivefold <command> --help` for a command's options. Several processes:\n"
      "  mpirun -np 4 -x OMP_WAIT_POLICY=passive fivefold info         (MPI backend)\n"
      "  FIVEFOLD_BACKEND=gloo torchrun --no-python --nproc-per-node 4 fivefold info\n");
}

}  // namespace

int main(int argc, char** argv) {
  // Training on malloc's 2 MB pages: worth a second start (fivefold/runtime.h) for long runs only.
  if (argc >= 2 && (std::strcmp(argv[1], "train") == 0 || std::strcmp(argv[1], "calibrate") == 0))
    fivefold::restart_with_huge_pages(argv);
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  // An error on any rank ends the whole job, printed once (fivefold::exit_on_error).
  return fivefold::run_guarded(("fivefold " + command).c_str(), [&] {
    if (command == "info") return info(argc - 1, argv + 1);
    if (command == "plan") return fivefold::commands::plan(argc - 1, argv + 1);
    if (command == "train") return fivefold::commands::train(argc - 1, argv + 1);
    if (command == "calibrate") return fivefold::commands::calibrate(argc - 1, argv + 1);
    if (command == "generate") return fivefold::commands::generate(argc - 1, argv + 1);
    if (command == "eval") return fivefold::commands::eval(argc - 1, argv + 1);
    if (command == "tokenize") return fivefold::commands::tokenize(argc - 1, argv + 1);
    if (command == "compare") return fivefold::commands::compare(argc - 1, argv + 1);
    std::fprintf(stderr, "fivefold: unknown command '%s'\n\n", command.c_str());
    usage();
    return 2;
  });
}
