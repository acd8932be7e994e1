// fivefold: the command-line program. Subcommands arrive with the chapters that build them.
//
//   fivefold info                 what this process sees: launcher, rank, backend, threads, BLAS
//   mpirun -np 4 fivefold info    the same on every rank (checks a launch works)

#include <cstdio>
#include <cstring>
#include <string>

#include "fivefold/blas.h"
#include "fivefold/cli.h"
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
                  << ", BLAS " << blas.library << (blas.reference ? " (REFERENCE: slow)" : "");
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
      "  info      what this process sees: launcher, rank, backend, threads, BLAS\n\n"
      "Run `fivefold <command> --help` for a command's options. Several processes:\n"
      "  mpirun -np 4 -x OMP_WAIT_POLICY=passive fivefold info         (MPI backend)\n"
      "  FIVEFOLD_BACKEND=gloo torchrun --no-python --nproc-per-node 4 fivefold info\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  try {
    if (command == "info") return info(argc - 1, argv + 1);
    std::fprintf(stderr, "fivefold: unknown command '%s'\n\n", command.c_str());
    usage();
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fivefold %s: error: %s\n", command.c_str(), e.what());
    return 1;
  }
}
