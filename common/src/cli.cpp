#include "fivefold/cli.h"

#include <CLI/CLI.hpp>
#include <toml++/toml.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>

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
  std::string config;                  // --config FILE, if given
  std::set<std::string> from_config;   // options the file set (and the command line did not)
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

ArgParser& ArgParser::path_option(const std::string& name, const std::string& default_value,
                                  const std::string& help) {
  option(name, default_value, help);
  specs_[name].is_path = true;
  return *this;
}

ArgParser& ArgParser::flag(const std::string& name, const std::string& help) {
  order_.push_back(name);
  specs_[name] = {"", help, true};
  return *this;
}

ArgParser& ArgParser::config_file(const std::string& help, const std::string& flag) {
  config_help_ = help;
  config_flag_ = flag;
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
  for (const auto& name : order_) {
    const Spec& s = specs_.at(name);
    CLI::Option* o = s.is_flag ? app.add_flag("--" + name, parsed_->flags[name], s.help)
                               : app.add_option("--" + name, parsed_->values[name], s.help);
    o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a later value wins
    parsed_->options[name] = o;
  }
  if (!config_help_.empty()) app.add_option("--" + config_flag_, parsed_->config, config_help_);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << help();
    return false;
  } catch (const CLI::ExtrasError& e) {
    throw Error(program_ + ": unexpected argument: " + e.what() +
                " (options start with --; see --help)");
  } catch (const CLI::ParseError& e) {
    throw Error(program_ + ": " + e.what() + " (see --help)");
  }
  if (!parsed_->config.empty()) read_config(parsed_->config);
  return true;
}

namespace {

// A number as text that reads back as the same double: the shortest of 15-17 digits.
std::string number_text(double value) {
  char text[40];
  for (int digits = 15; digits <= 17; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, value);
    if (std::strtod(text, nullptr) == value) break;
  }
  return text;
}

}  // namespace

// The settings in `file`, strictly: toml++ rejects malformed TOML (a second `=`, trailing text, an
// unclosed table header, a key given twice) with its line; each key must be a declared option
// holding one value. Values the command line also gave are the command line's.
void ArgParser::read_config(const std::string& file) {
  const std::string where = program_ + ": --" + config_flag_ + " '" + file + "'";
  std::error_code error;
  FIVEFOLD_CHECK(std::filesystem::is_regular_file(file, error), where,
                 ": not readable (no such file, or not a file)");
  toml::table table;
  try {
    table = toml::parse_file(file);
  } catch (const toml::parse_error& e) {
    throw Error(where + " line " + std::to_string(e.source().begin.line) + ", column " +
                std::to_string(e.source().begin.column) + ": " + std::string(e.description()) +
                " (not valid TOML)");
  }
  const std::filesystem::path folder = std::filesystem::path(file).parent_path();
  for (const auto& [key, node] : table) {
    const std::string name(key.str());
    const std::string at = where + " line " + std::to_string(node.source().begin.line) + ": '" +
                           name + "'";
    FIVEFOLD_CHECK(!node.is_table(), at,
                   " is a table: settings are top-level `name = value` lines, without sections");
    const auto spec = specs_.find(name);
    FIVEFOLD_CHECK(spec != specs_.end(), at, ": unknown setting '", name,
                   "' (the keys are the options' names without --; see --help)");
    FIVEFOLD_CHECK(!node.is_array(), at, " is an array: an option takes one value");
    if (parsed_->options.at(name)->count() > 0) continue;  // the command line's value wins
    if (spec->second.is_flag) {
      const auto value = node.value<bool>();
      FIVEFOLD_CHECK(node.is_boolean() && value, at, " is a flag: give true or false");
      parsed_->flags[name] = *value;
    } else if (node.is_string()) {
      std::string text = *node.value<std::string>();
      if (spec->second.is_path && !text.empty() && std::filesystem::path(text).is_relative())
        text = (folder / text).lexically_normal().string();  // beside the file that names it
      parsed_->values[name] = text;
    } else if (node.is_integer()) {
      parsed_->values[name] = std::to_string(*node.value<int64_t>());
    } else if (node.is_floating_point()) {
      parsed_->values[name] = number_text(*node.value<double>());
    } else if (node.is_boolean()) {
      parsed_->values[name] = *node.value<bool>() ? "true" : "false";
    } else {
      throw Error(at + ": give a string, a number or true/false (not a date or time)");
    }
    parsed_->from_config.insert(name);
  }
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
  return parsed_ &&
         (parsed_->options.at(name)->count() > 0 || parsed_->from_config.count(name) > 0);
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
    const std::string left = "  --" + config_flag_ + " FILE";
    out << left << std::string(left.size() < 28 ? 28 - left.size() : 1, ' ') << config_help_
        << "\n";
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
    std::string value = str(name);
    if (value.empty()) {  // no value: the option's default is worked out by the program
      out << "# " << name << " = (" << s.help << ")\n";
      continue;
    }
    out << name << " = ";
    if (s.is_path) {  // absolute: the file reads back from any folder, its own included
      std::error_code error;
      const auto absolute = std::filesystem::absolute(value, error);
      if (!error) value = absolute.lexically_normal().string();
    }
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
    return exit_on_error(program, e.what());  // runtime.h: in a job, ends every rank
  }
}

}  // namespace fivefold
