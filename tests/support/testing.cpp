// Helpers shared by the test suites (declared in testing.h).

#include "testing.h"

#include <unistd.h>

#include <filesystem>

#include "fivefold/error.h"

namespace fivefold::testing {

::testing::AssertionResult throws_error_containing(const std::function<void()>& action,
                                                   const std::string& fragment) {
  try {
    action();
  } catch (const Error& e) {
    if (std::string(e.what()).find(fragment) != std::string::npos)
      return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "the error does not mention '" << fragment << "': " << e.what();
  }
  return ::testing::AssertionFailure() << "no error; expected one mentioning '" << fragment << "'";
}

ScratchDir::ScratchDir(const std::string& tag) {
  const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = "fivefold-" + tag + "-" + std::to_string(getpid()) + "-" +
                           (test ? std::string(test->test_suite_name()) + "." + test->name() : "");
  root_ = (std::filesystem::temp_directory_path() / name).string();
  std::filesystem::remove_all(root_);
  std::filesystem::create_directories(root_);
}

ScratchDir::~ScratchDir() {
  std::error_code ignored;
  std::filesystem::remove_all(root_, ignored);
}

std::string ScratchDir::path(const std::string& name) const { return root_ + "/" + name; }

}  // namespace fivefold::testing
