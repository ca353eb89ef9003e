// Names the calling thread ("sluice-..."), so that top -H, perf, gdb and /proc/<pid>/task show
// which of the engine's threads is which (they all showed the process's name before).
// Header-only: the torch extension and the tools use it without an exported symbol.
#pragma once

#include <pthread.h>

#include <cstring>
#include <string>

namespace sluice::detail {

inline void name_this_thread(const std::string& name) {
  char buf[16];  // the kernel keeps 15 characters and the NUL
  std::strncpy(buf, name.c_str(), sizeof(buf) - 1);
  buf[sizeof(buf) - 1] = '\0';
  (void)pthread_setname_np(pthread_self(), buf);
}

}  // namespace sluice::detail
