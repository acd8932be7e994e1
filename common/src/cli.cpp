#include "fivefold/cli.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <iostream>
#include <sstream>
#include <thread>

#include "fivefold/error.h"
#include "fivefold/runtime.h"

namespace fivefold {

// What CLI11 made of the command line: its application (built at parse time from the declared
// options) and the values it filled in, by option name.
struct ArgParser::Parsed {
  CLI::App app;
  std::map<std::string, std::string> values;  // options (bound by CLI11)
  std::map<std::string, bool> flags;          // flags (bound by CLI11)
  std::map<std::string, const CLI::Option*> options;
};

ArgParser::ArgParser(std::string program, std::string description)
    : program_(std::move(program)), description_(std::move(description)) {}

ArgParser::~ArgParser() = default;
ArgParser::ArgParser(ArgParser&&) noexcept = default;
ArgParser& ArgParser::operator=(ArgParser&&) noexcept = default;

ArgParser& ArgParser::option(const std::string& name, const std::string& default_value,
                             const std::string& help) {
  order_.push_back(name);
  specs_[name] = {default_value, help, false};
  return *this;
}

ArgParser& ArgParser::flag(const std::string& name, const std::string& help) {
  order_.push_back(name);
  specs_[name] = {"", help, true};
  return *this;
}

ArgParser& ArgParser::config_file(const std::string& help) {
  config_help_ = help;
  return *this;
}

const ArgParser::Spec& ArgParser::spec(const std::string& name) const {
  auto it = specs_.find(name);
  FIVEFOLD_CHECK(it != specs_.end(), program_, ": option --", name, " was never declared");
  return it->second;
}

bool ArgParser::parse(int argc, const char* const* argv) {
  parsed_ = std::make_unique<Parsed>();
  CLI::App& app = parsed_->app;
  app.name(program_);
  app.set_help_flag("-h,--help");
  app.allow_config_extras(CLI::config_extras_mode::error);  // a misspelt key is an error
  for (const auto& name : order_) {
    const Spec& s = specs_.at(name);
    CLI::Option* o = s.is_flag ? app.add_flag("--" + name, parsed_->flags[name], s.help)
                               : app.add_option("--" + name, parsed_->values[name], s.help);
    o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a later value wins
    parsed_->options[name] = o;
  }
  if (!config_help_.empty()) app.set_config("--config", "", config_help_);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << help();
    return false;
  } catch (const CLI::ConfigError& e) {
    // CLI11 names an unknown key "INI was not able to parse KEY".
    const std::string what = e.what(), prefix = "INI was not able to parse ";
    if (what.rfind(prefix, 0) == 0) {
      throw Error(program_ + ": --config: unknown setting '" + what.substr(prefix.size()) +
                  "' (the keys are the options' names without --; see --help)");
    }
    throw Error(program_ + ": --config: " + what);
  } catch (const CLI::ExtrasError& e) {
    throw Error(program_ + ": unexpected argument: " + e.what() +
                " (options start with --; see --help)");
  } catch (const CLI::ParseError& e) {
    throw Error(program_ + ": " + e.what() + " (see --help)");
  }
  return true;
}

std::string ArgParser::str(const std::string& name) const {
  const Spec& s = spec(name);
  if (s.is_flag) return on(name) ? "true" : "false";
  return given(name) ? parsed_->values.at(name) : s.default_value;
}

int64_t ArgParser::integer(const std::string& name) const {
  const std::string text = str(name);
  try {
    size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  throw Error(program_ + ": --" + name + " expects an integer, got '" + text + "'");
}

double ArgParser::real(const std::string& name) const {
  const std::string text = str(name);
  try {
    size_t used = 0;
    const double value = std::stod(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  throw Error(program_ + ": --" + name + " expects a number, got '" + text + "'");
}

std::vector<std::string> ArgParser::strings(const std::string& name) const {
  std::vector<std::string> items;
  std::stringstream in(str(name));
  std::string item;
  while (std::getline(in, item, ',')) items.push_back(item);
  return items;
}

std::vector<int64_t> ArgParser::integers(const std::string& name) const {
  std::vector<int64_t> values;
  for (const std::string& item : strings(name)) {
    try {
      size_t used = 0;
      values.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw Error(program_ + ": --" + name + " expects integers separated by commas, got '" +
                  str(name) + "'");
    }
  }
  return values;
}

bool ArgParser::on(const std::string& name) const {
  FIVEFOLD_CHECK(spec(name).is_flag, program_, ": --", name, " is not a flag");
  return given(name) && parsed_->flags.at(name);  // a config file may say `name = false`
}

bool ArgParser::given(const std::string& name) const {
  spec(name);
  return parsed_ && parsed_->options.at(name)->count() > 0;
}

std::string ArgParser::help() const {
  std::ostringstream out;
  out << "usage: " << program_ << " [options]\n\n" << description_ << "\n\noptions:\n";
  for (const auto& name : order_) {
    const Spec& s = specs_.at(name);
    std::string left = "  --" + name + (s.is_flag ? "" : " VALUE");
    out << left << std::string(left.size() < 28 ? 28 - left.size() : 1, ' ') << s.help;
    if (!s.is_flag && !s.default_value.empty()) out << " (default: " << s.default_value << ")";
    out << "\n";
  }
  if (!config_help_.empty()) {
    out << "  --config FILE" << std::string(28 - 15, ' ') << config_help_ << "\n";
  }
  out << "  --help                    this text\n";
  return out.str();
}

std::string ArgParser::settings_toml() const {
  std::ostringstream out;
  out << "# " << program_ << ": every setting (read back with --config)\n";
  for (const auto& name : order_) {
    const Spec& s = specs_.at(name);
    if (s.is_flag) {
      out << name << " = " << (on(name) ? "true" : "false") << "\n";
      continue;
    }
    const std::string value = str(name);
    if (value.empty()) {  // no value: the option's default is worked out by the program
      out << "# " << name << " = (" << s.help << ")\n";
      continue;
    }
    out << name << " = ";
    // A number is written bare, anything else as a TOML basic string.
    bool number = !value.empty();
    try {
      size_t used = 0;
      std::stod(value, &used);
      number = number && used == value.size();
    } catch (const std::exception&) {
      number = false;
    }
    if (number) {
      out << value << "\n";
      continue;
    }
    out << '"';
    for (char ch : value) {
      if (ch == '"' || ch == '\\') out << '\\';
      out << ch;
    }
    out << "\"\n";
  }
  return out.str();
}

int run_guarded(const char* program, const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    // Option errors already start with the program's name; say it once.
    const std::string what = e.what(), prefix = std::string(program) + ": ";
    std::cerr << prefix
              << "error: " << (what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what)
              << std::endl;
    // In a job of several processes the launcher ends every rank as soon as one exits with an
    // error. The ranks usually refuse the same input together: give the others a moment to say
    // so too, so that every rank's message reaches the terminal.
    if (read_launch_environment().size > 1) std::this_thread::sleep_for(std::chrono::seconds(2));
    return 1;
  }
}

}  // namespace fivefold
