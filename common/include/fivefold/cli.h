#pragma once
/// @file cli.h
/// @brief Command-line parsing for the programs: `--name value`, `--name=value` and `--flag`,
/// with defaults, typed getters, `--help`, and clear errors for unknown or malformed options;
/// optionally `--config FILE`, a TOML file whose keys are the options' names (command-line values
/// win over the file's). The command line is parsed by CLI11 (Debian's libcli11-dev), the file by
/// toml++ (libtomlplusplus-dev), a strict TOML parser; this class keeps the programs' small
/// interface and error style on top of them.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fivefold {

/// Declares options, parses argv, and hands back typed values.
class ArgParser {
 public:
  /// @param program name shown in usage; @param description one paragraph for --help.
  ArgParser(std::string program, std::string description);
  ~ArgParser();
  ArgParser(const ArgParser&) = delete;
  ArgParser& operator=(const ArgParser&) = delete;
  /// Movable (what parse() made of the command line moves with it).
  ArgParser(ArgParser&&) noexcept;
  /// Movable.
  ArgParser& operator=(ArgParser&&) noexcept;

  /// Declares `--name VALUE` with a default (shown in --help).
  ArgParser& option(const std::string& name, const std::string& default_value,
                    const std::string& help);
  /// Declares `--name PATH`, a file the program reads: given in a config file, a relative path is
  /// taken from the file's folder (a preset names the files beside it), and settings_toml() writes
  /// it absolute. (Where the program writes, such as an output folder, is an ordinary option: it
  /// stays relative to the working directory.)
  ArgParser& path_option(const std::string& name, const std::string& default_value,
                         const std::string& help);
  /// Declares a boolean `--name` (false unless given).
  ArgParser& flag(const std::string& name, const std::string& help);

  /// Adds `--config FILE`: a TOML file of settings, one top-level `name = value` per option
  /// (a string, a number, or for flags `true`/`false`), read before the command line's values,
  /// which win. Anything else is an error naming the file, the line and the key: malformed TOML
  /// (toml++'s message), an unknown key (as an unknown option is), a table or an array, a flag
  /// given something other than true/false. An option set by the file counts as given().
  /// `flag` names the option (`--config` unless a file of another kind is read this way, such as
  /// `fivefold plan --cluster`'s), in the help and in every error about the file.
  ArgParser& config_file(const std::string& help, const std::string& flag = "config");

  /// Parses the arguments after argv[0]. Throws fivefold::Error for an unknown option, a missing
  /// value or a stray positional argument. Returns false if `--help` was given (help is printed).
  bool parse(int argc, const char* const* argv);

  /// The value of an option as text.
  std::string str(const std::string& name) const;
  /// The value as an integer (error names the option if it is not one).
  int64_t integer(const std::string& name) const;
  /// The value as a real number.
  double real(const std::string& name) const;
  /// A comma-separated list, e.g. `--runs a,b`; empty for an empty value.
  std::vector<std::string> strings(const std::string& name) const;
  /// A comma-separated list of integers, e.g. `--ranks 2,4,8`.
  std::vector<int64_t> integers(const std::string& name) const;
  /// Whether a flag was given.
  bool on(const std::string& name) const;
  /// Whether the option appeared on the command line (rather than taking its default).
  bool given(const std::string& name) const;
  /// The usage text printed by --help.
  std::string help() const;
  /// Every option's value (given, from the config file, or its default) as a TOML file that
  /// `--config` reads back: the settings of this run in one place.
  std::string settings_toml() const;

 private:
  struct Spec {
    std::string default_value;
    std::string help;
    bool is_flag;
    bool is_path = false;
  };
  void read_config(const std::string& file);
  struct Parsed;  // CLI11's application and the values it fills (cli.cpp)
  const Spec& spec(const std::string& name) const;
  std::string program_;
  std::string description_;
  std::string config_help_;             // non-empty: --config is accepted
  std::string config_flag_ = "config";  // its name
  std::vector<std::string> order_;
  std::map<std::string, Spec> specs_;
  std::unique_ptr<Parsed> parsed_;
};

/// Runs a program's body: an exception ends the program with "<program>: error: <what>" on stderr
/// and exit status 1 instead of an abort with a backtrace; in a job of several processes it ends
/// the whole job (fivefold::exit_on_error, runtime.h), so that an error on one rank never leaves
/// the others waiting.
int run_guarded(const char* program, const std::function<int()>& body);

}  // namespace fivefold
