#pragma once
/// @file cli.h
/// @brief Command-line parsing for the programs: `--name value`, `--name=value` and `--flag`,
/// with defaults, typed getters, `--help`, and clear errors for unknown or malformed options.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace fivefold {

/// Declares options, parses argv, and hands back typed values.
class ArgParser {
 public:
  /// @param program name shown in usage; @param description one paragraph for --help.
  ArgParser(std::string program, std::string description);

  /// Declares `--name VALUE` with a default (shown in --help).
  ArgParser& option(const std::string& name, const std::string& default_value,
                    const std::string& help);
  /// Declares a boolean `--name` (false unless given).
  ArgParser& flag(const std::string& name, const std::string& help);

  /// Parses the arguments after argv[0]. Throws fivefold::Error for an unknown option, a missing
  /// value or a stray positional argument. Returns false if `--help` was given (help is printed).
  bool parse(int argc, const char* const* argv);

  /// The value of an option as text.
  std::string str(const std::string& name) const;
  /// The value as an integer (error names the option if it is not one).
  int64_t integer(const std::string& name) const;
  /// The value as a real number.
  double real(const std::string& name) const;
  /// A comma-separated list of integers, e.g. `--ranks 2,4,8`.
  std::vector<int64_t> integers(const std::string& name) const;
  /// Whether a flag was given.
  bool on(const std::string& name) const;
  /// Whether the option appeared on the command line (rather than taking its default).
  bool given(const std::string& name) const;
  /// The usage text printed by --help.
  std::string help() const;

 private:
  struct Spec {
    std::string default_value;
    std::string help;
    bool is_flag;
  };
  const Spec& spec(const std::string& name) const;
  std::string program_;
  std::string description_;
  std::vector<std::string> order_;
  std::map<std::string, Spec> specs_;
  std::map<std::string, std::string> values_;
};

/// Runs a program's body: an exception ends the program with "<program>: error: <what>" on stderr
/// and exit status 1, as the fivefold command does, instead of an abort with a backtrace.
int run_guarded(const char* program, const std::function<int()>& body);

}  // namespace fivefold
