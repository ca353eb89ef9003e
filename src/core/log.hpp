// Minimal leveled logging to stderr. The level is set by each Engine from its config.
#pragma once

#include <atomic>
#include <sstream>

#include "sluice/config.hpp"

namespace sluice::log {

extern std::atomic<int> g_level;
void set_level(LogLevel level);
void write(LogLevel level, const std::string& text);
inline bool enabled(LogLevel level) { return static_cast<int>(level) <= g_level.load(std::memory_order_relaxed); }

}  // namespace sluice::log

#define SLUICE_LOG(level, expr)                                      \
  do {                                                               \
    if (::sluice::log::enabled(::sluice::LogLevel::level)) {         \
      std::ostringstream sluice_log_os_;                             \
      sluice_log_os_ << expr;                                        \
      ::sluice::log::write(::sluice::LogLevel::level, sluice_log_os_.str()); \
    }                                                                \
  } while (0)
