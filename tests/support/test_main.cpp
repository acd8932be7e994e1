// main() of every fivefold test binary: starts the runtime (MPI under mpirun, Gloo when
// FIVEFOLD_BACKEND=gloo), runs the tests, and turns a failure on one rank into the end of the job.

#include <iostream>
#include <memory>

#include "fivefold/dist.h"
#include "fivefold/log.h"
#include "fivefold/runtime.h"
#include "testing.h"

namespace fivefold::testing {
namespace {
dist::CommunicatorPtr g_world;

// In a job of several ranks, the other ranks may be inside a collective that will never complete:
// report the failure with the rank, then end every process.
class AbortOnFailure : public ::testing::EmptyTestEventListener {
 public:
  // The name is kept here: asking gtest for the current test inside OnTestPartResult deadlocks.
  void OnTestStart(const ::testing::TestInfo& test) override {
    current_ = std::string(test.test_suite_name()) + "." + test.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::cerr << "[rank " << g_world->rank() << "] FAILED " << current_ << " at "
              << (result.file_name() ? result.file_name() : "?") << ":" << result.line_number()
              << "\n"
              << result.message() << std::endl;
    dist::abort_job(1, "test failure on rank " + std::to_string(g_world->rank()));
  }

 private:
  std::string current_;
};
}  // namespace

dist::CommunicatorPtr world() { return g_world; }

}  // namespace fivefold::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int status = 0;
  {
    fivefold::Runtime runtime;
    fivefold::testing::g_world = runtime.world();
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    if (runtime.world()->size() > 1) {
      if (runtime.world()->rank() != 0)
        delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new fivefold::testing::AbortOnFailure());
    }
    status = RUN_ALL_TESTS();
    fivefold::testing::g_world.reset();
  }
  return status;
}
