#include "fivefold/cli.h"

#include <chrono>
#include <iostream>
#include <sstream>
#include <thread>

#include "fivefold/error.h"
#include "fivefold/runtime.h"

namespace fivefold {

ArgParser::ArgParser(std::string program, std::string description)
    : program_(std::move(program)), description_(std::move(description)) {}

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

const ArgParser::Spec& ArgParser::spec(const std::string& name) const {
  auto it = specs_.find(name);
  FIVEFOLD_CHECK(it != specs_.end(), program_, ": option --", name, " was never declared");
  return it->second;
}

bool ArgParser::parse(int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << help();
      return false;
    }
    FIVEFOLD_CHECK(arg.rfind("--", 0) == 0, program_, ": unexpected argument '", arg,
                   "' (options start with --; see --help)");
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = specs_.find(name);
    FIVEFOLD_CHECK(it != specs_.end(), program_, ": unknown option --", name, " (see --help)");
    if (it->second.is_flag) {
      FIVEFOLD_CHECK(!has_value, program_, ": --", name, " takes no value");
      values_[name] = "1";
      continue;
    }
    if (!has_value) {
      FIVEFOLD_CHECK(i + 1 < argc, program_, ": --", name, " needs a value");
      value = argv[++i];
    }
    values_[name] = value;
  }
  return true;
}

std::string ArgParser::str(const std::string& name) const {
  const Spec& s = spec(name);
  auto it = values_.find(name);
  return it != values_.end() ? it->second : s.default_value;
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

std::vector<int64_t> ArgParser::integers(const std::string& name) const {
  std::vector<int64_t> values;
  std::stringstream in(str(name));
  std::string item;
  while (std::getline(in, item, ',')) {
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
  return values_.count(name) > 0;
}

bool ArgParser::given(const std::string& name) const {
  spec(name);
  return values_.count(name) > 0;
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
  out << "  --help                    this text\n";
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
