// The parameter table: every tunable is declared once, next to the code that uses it, with its
// name, environment variable, default, strict parser and a one-line doc (NCCL's NCCL_PARAM,
// MSCCL++'s env.hpp). Declaring registers only metadata at static initialisation; values are
// read when an Engine is created (EngineConfig::from_env) or, for the few process-wide and
// test-only knobs, where they are used. Never at static initialisation.
//
//   const Param<uint64_t> kSplitMin{"nvlink.split_min", "SLUICE_NVLINK_SPLIT_MIN", 8 << 20,
//                                   size_in(0, 1ull << 40), "copies this large are split ..."};
//   uint64_t split = kSplitMin.get(setup.config);
#pragma once

#include <chrono>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "sluice/config.hpp"

namespace sluice::detail {

// Where a parameter's value comes from.
enum class ParamScope {
  kEngine,   // EngineConfig (a field, or options["<ns>.<key>"]), SLUICE_* on top; per engine
  kProcess,  // the environment only, read where used (one library load, no engine: allgather)
  kTest,     // the environment only, read when an endpoint is created; fault injection, tests
};

// One row of the table, type-erased.
struct ParamSpec {
  std::string name;  // "channels" (an EngineConfig field) or "<transport>.<key>" (an option)
  std::string env;   // "SLUICE_CHANNELS"
  std::string default_text;
  std::string doc;
  ParamScope scope = ParamScope::kEngine;
  // Parses `text` (errors name `where`: the key or the variable) and stores it in `c`.
  std::function<void(EngineConfig& c, const std::string& where, const std::string& text)> apply;
  // The effective value in `c`, as text that `apply` accepts.
  std::function<std::string(const EngineConfig& c)> show;
};

void register_param(ParamSpec spec);
// Every declared parameter, sorted by name.
std::vector<const ParamSpec*> param_table();
const ParamSpec* find_param(std::string_view name);
// The value of `env` if set and non-empty, else nullptr.
const char* env_text(const std::string& env);
// One info line per parameter with its effective value (called when an engine starts).
void log_params(const EngineConfig& c);

// EngineConfig::busy_wait_us resolved: how long a waiting thread polls before it sleeps. -1
// means 0 on a host of at most 2 hardware threads (a poller steals the progress threads'
// CPU there), else 20 us.
std::chrono::microseconds busy_wait_of(const EngineConfig& c);

// Strict parsers. Errors are Error(kInvalidArgument) naming `where`.
uint64_t parse_size(const std::string& where, const std::string& text);  // digits, K/M/G suffix
int64_t parse_int(const std::string& where, const std::string& text);    // optional '-', digits
bool parse_bool(const std::string& where, const std::string& text);      // 1/0 true/false yes/no on/off

template <class T>
using Parser = std::function<T(const std::string& where, const std::string& text)>;

Parser<uint64_t> size_in(uint64_t lo, uint64_t hi);  // bytes or counts; K/M/G allowed
Parser<int> int_in(int lo, int hi);                  // plain integers
Parser<bool> boolean();
Parser<std::string> any_text();

inline std::string param_text(uint64_t v) { return std::to_string(v); }
inline std::string param_text(int v) { return std::to_string(v); }
inline std::string param_text(bool v) { return v ? "true" : "false"; }
inline std::string param_text(const std::string& v) { return v; }

[[noreturn]] void param_error(const std::string& where, const std::string& text, const std::string& why);

// A transport's (or the cuda layer's) parameter. kEngine: an option "<ns>.<key>" of
// EngineConfig, which from_env fills from the variable; get() reads it from the engine's config.
// kProcess / kTest: read() takes the variable at the time of the call.
template <class T>
class Param {
 public:
  Param(std::string name, std::string env, T dflt, Parser<T> parse, std::string doc,
        ParamScope scope = ParamScope::kEngine)
      : name_(std::move(name)), env_(std::move(env)), dflt_(std::move(dflt)), parse_(std::move(parse)) {
    ParamSpec s{name_, env_, param_text(dflt_), std::move(doc), scope, nullptr, nullptr};
    if (scope == ParamScope::kEngine) {
      s.apply = [n = name_, p = parse_](EngineConfig& c, const std::string& where, const std::string& text) {
        p(where, text);  // reject now, naming the key or the variable
        c.options[n] = text;
      };
      s.show = [this](const EngineConfig& c) { return param_text(get(c)); };
    } else {
      s.show = [this](const EngineConfig&) {
        try {
          return param_text(read());
        } catch (const std::exception& e) {
          return std::string("(invalid: ") + e.what() + ")";
        }
      };
    }
    register_param(std::move(s));
  }

  // kEngine: the value in an engine's (resolved) config, else the default.
  T get(const EngineConfig& c) const {
    auto it = c.options.find(name_);
    return it == c.options.end() ? dflt_ : parse_(name_, it->second);
  }
  // kProcess / kTest: the variable now, else the default.
  T read() const {
    const char* v = env_text(env_);
    return v ? parse_(env_, v) : dflt_;
  }
  const std::string& name() const { return name_; }
  const std::string& env() const { return env_; }

 private:
  std::string name_;
  std::string env_;
  T dflt_;
  Parser<T> parse_;
};

}  // namespace sluice::detail
