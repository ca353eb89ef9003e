#include "core/log.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>

namespace sluice::log {

std::atomic<int> g_level{static_cast<int>(LogLevel::kWarn)};

void set_level(LogLevel level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

void write(LogLevel level, const std::string& text) {
  static const char* names[] = {"E", "W", "I", "D", "T"};
  auto now = std::chrono::duration_cast<std::chrono::microseconds>(
                 std::chrono::system_clock::now().time_since_epoch()).count();
  // One fprintf per line keeps lines from different threads whole.
  std::fprintf(stderr, "[sluice %s %lld.%06lld pid %d] %s\n", names[static_cast<int>(level)],
               static_cast<long long>(now / 1000000), static_cast<long long>(now % 1000000),
               static_cast<int>(::getpid()), text.c_str());
}

}  // namespace sluice::log
