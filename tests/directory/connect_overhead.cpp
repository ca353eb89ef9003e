// Measures connect-by-name against connect-by-address (docs/cluster.md, "Directory
// overhead"). Not a test: run it by hand against a store that is up.
//   sluice_directory_overhead <directory-url> [rounds]
// Prints the median and p90 of connect() by "host:port" and by name over `rounds` connects.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "sluice/sluice.hpp"

namespace {

using Clock = std::chrono::steady_clock;

void report(const char* what, std::vector<double> us) {
  std::sort(us.begin(), us.end());
  std::printf("%-12s median %8.1f us  p90 %8.1f us  (n=%zu)\n", what, us[us.size() / 2], us[us.size() * 9 / 10],
              us.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <directory-url> [rounds]\n", argv[0]);
    return 2;
  }
  int rounds = argc > 2 ? std::atoi(argv[2]) : 200;
  sluice::EngineConfig c;
  c.transports = {"tcp"};
  c.channels = 1;
  c.directory = argv[1];
  c.name = "overhead-server";
  sluice::Engine server(c);
  c.name = "overhead-client";
  sluice::Engine client(c);
  std::vector<double> by_addr, by_name;
  for (int i = 0; i < rounds; ++i) {
    // Interleaved, so that load on the host hits both alike.
    for (int which = 0; which < 2; ++which) {
      auto t0 = Clock::now();
      sluice::Endpoint ep = client.connect(which == 0 ? server.listen_address() : std::string("overhead-server"));
      auto us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      (which == 0 ? by_addr : by_name).push_back(us);
      ep.close();
      server.accept(std::chrono::milliseconds(1000));
    }
  }
  report("by address", by_addr);
  report("by name", by_name);
  return 0;
}
