// Command-line options of sluice-bench.
#pragma once

#include <cstdint>
#include <string>

namespace bench {

struct Options {
  std::string role = "loopback";  // loopback | target | initiator
  std::string transport;          // empty = engine's choice
  std::string op = "write";       // read | write | write_imm | send | pingpong
  std::string notify = "flag";    // pingpong: flag (spin on memory) | imm
  uint64_t min_size = 8;
  uint64_t max_size = 64ull << 20;
  int batch = 64;
  int concurrency = 8;
  int iterations = 0;  // 0 = scale with size
  int channels = 2;
  bool check = false;
  bool json = false;
  bool csv = false;
  bool baseline = false;
  bool memfd = false;  // buffers from Engine::allocate (shareable) instead of malloc
  std::string connect;  // initiator: target's host:port
  std::string listen = "127.0.0.1:0";
  bool quiet = false;
  bool metrics = false;  // Prometheus text of the initiator's engine on stderr at the end
};

Options parse(int argc, char** argv);
uint64_t parse_size(const std::string& s);
std::string size_text(uint64_t bytes);

}  // namespace bench
