#include "core/params.hpp"

#include <thread>

#include <algorithm>
#include <charconv>
#include <cstdlib>

#include "core/log.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {
namespace {

// Construct-on-first-use: declarations in other files register during static initialisation,
// in an order the linker picks.
std::vector<ParamSpec>& specs() {
  static std::vector<ParamSpec> v;
  return v;
}

}  // namespace

void register_param(ParamSpec spec) { specs().push_back(std::move(spec)); }

std::vector<const ParamSpec*> param_table() {
  std::vector<const ParamSpec*> out;
  for (const auto& s : specs()) out.push_back(&s);
  std::sort(out.begin(), out.end(), [](const ParamSpec* a, const ParamSpec* b) { return a->name < b->name; });
  return out;
}

const ParamSpec* find_param(std::string_view name) {
  for (const auto& s : specs())
    if (s.name == name) return &s;
  return nullptr;
}

const char* env_text(const std::string& env) {
  const char* v = std::getenv(env.c_str());
  return (v && *v) ? v : nullptr;
}

std::chrono::microseconds busy_wait_of(const EngineConfig& c) {
  int us = c.busy_wait_us;
  if (us < 0) us = std::thread::hardware_concurrency() > 2 ? 20 : 0;
  return std::chrono::microseconds(us);
}

void log_params(const EngineConfig& c) {
  if (!log::enabled(LogLevel::kInfo)) return;
  for (const ParamSpec* p : param_table()) {
    std::string v = p->show(c);
    SLUICE_LOG(kInfo, "param " << p->name << " = '" << v << "'" << (v == p->default_text ? " (default)" : "")
                               << " [" << p->env << "]");
  }
}

void param_error(const std::string& where, const std::string& text, const std::string& why) {
  throw Error(ErrorCode::kInvalidArgument, where + "='" + text + "' " + why);
}

uint64_t parse_size(const std::string& where, const std::string& text) {
  // Plain integers with an optional K/M/G suffix (powers of two); nothing else, no spaces.
  std::string_view s(text);
  uint64_t mult = 1;
  if (!s.empty()) {
    char c = s.back();
    if (c == 'k' || c == 'K') mult = 1ull << 10;
    if (c == 'm' || c == 'M') mult = 1ull << 20;
    if (c == 'g' || c == 'G') mult = 1ull << 30;
    if (mult != 1) s.remove_suffix(1);
  }
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec == std::errc::invalid_argument || p != s.data() + s.size()) param_error(where, text, "is not a number");
  if (ec == std::errc::result_out_of_range || v > UINT64_MAX / mult) param_error(where, text, "is too large");
  return v * mult;
}

int64_t parse_int(const std::string& where, const std::string& text) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec == std::errc::invalid_argument || p != text.data() + text.size())
    param_error(where, text, "is not an integer");
  if (ec == std::errc::result_out_of_range) param_error(where, text, "is out of range");
  return v;
}

bool parse_bool(const std::string& where, const std::string& text) {
  for (const char* t : {"1", "true", "yes", "on"})
    if (text == t) return true;
  for (const char* f : {"0", "false", "no", "off"})
    if (text == f) return false;
  param_error(where, text, "is not a boolean (1/0, true/false, yes/no, on/off)");
}

Parser<uint64_t> size_in(uint64_t lo, uint64_t hi) {
  return [lo, hi](const std::string& where, const std::string& text) {
    uint64_t v = parse_size(where, text);
    if (v < lo || v > hi) param_error(where, text, "must be " + std::to_string(lo) + ".." + std::to_string(hi));
    return v;
  };
}

Parser<int> int_in(int lo, int hi) {
  return [lo, hi](const std::string& where, const std::string& text) {
    int64_t v = parse_int(where, text);
    if (v < lo || v > hi) param_error(where, text, "must be " + std::to_string(lo) + ".." + std::to_string(hi));
    return static_cast<int>(v);
  };
}

Parser<bool> boolean() { return parse_bool; }

Parser<std::string> any_text() {
  return [](const std::string&, const std::string& text) { return text; };
}

}  // namespace sluice::detail

namespace sluice {

std::vector<ParamInfo> list_params() {
  std::vector<ParamInfo> out;
  for (const auto* p : detail::param_table()) {
    const char* scope = p->scope == detail::ParamScope::kEngine ? "engine"
                        : p->scope == detail::ParamScope::kProcess ? "process"
                                                                    : "test";
    out.push_back({p->name, p->env, p->default_text, p->doc, scope});
  }
  return out;
}

}  // namespace sluice
