// A peer in its own process for the store directory tests: an engine registered under a name,
// which prints "ready" and then waits to be killed (a crash: no withdraw, no close).
//   sluice_directory_child <directory-url> <name> <ttl-ms>
#include <unistd.h>

#include <cstdio>
#include <exception>

#include "sluice/sluice.hpp"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <directory-url> <name> <ttl-ms>\n", argv[0]);
    return 2;
  }
  try {
    sluice::EngineConfig c;
    c.transports = {"tcp"};
    c.directory = argv[1];
    c.name = argv[2];
    c.set("directory.ttl_ms", argv[3]);
    sluice::Engine e(c);
    std::printf("ready %s\n", e.local_info().c_str());
    std::fflush(stdout);
    for (;;) ::pause();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "directory child: %s\n", e.what());
    return 1;
  }
}
