#include "options.hpp"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "sluice/config.hpp"

namespace bench {

uint64_t parse_size(const std::string& s) {
  size_t used = 0;
  uint64_t v = std::stoull(s, &used);
  std::string suf = s.substr(used);
  if (suf.empty() || suf == "B") return v;
  if (suf == "K" || suf == "KiB" || suf == "k") return v << 10;
  if (suf == "M" || suf == "MiB" || suf == "m") return v << 20;
  if (suf == "G" || suf == "GiB" || suf == "g") return v << 30;
  throw std::invalid_argument("bad size '" + s + "'");
}

std::string size_text(uint64_t b) {
  char buf[32];
  if (b >= (1ull << 30) && b % (1ull << 30) == 0) std::snprintf(buf, sizeof buf, "%lluGiB", (unsigned long long)(b >> 30));
  else if (b >= (1ull << 20) && b % (1ull << 20) == 0) std::snprintf(buf, sizeof buf, "%lluMiB", (unsigned long long)(b >> 20));
  else if (b >= 1024 && b % 1024 == 0) std::snprintf(buf, sizeof buf, "%lluKiB", (unsigned long long)(b >> 10));
  else std::snprintf(buf, sizeof buf, "%lluB", (unsigned long long)b);
  return buf;
}

// The parameter table as a Markdown table (docs/configuration.md is generated from it).
static void list_params() {
  std::puts("| name | variable | default | scope | what |");
  std::puts("|---|---|---|---|---|");
  for (const auto& p : sluice::list_params()) {
    std::string dflt = p.default_value.empty() ? "(empty)" : "`" + p.default_value + "`";
    std::printf("| `%s` | `%s` | %s | %s | %s |\n", p.name.c_str(), p.env.c_str(), dflt.c_str(), p.scope.c_str(),
                p.doc.c_str());
  }
}

static void usage() {
  std::puts(
      "sluice-bench: transfer benchmark for the Sluice engine\n"
      "\n"
      "  sluice-bench [options]                      one command on loopback (starts its own target)\n"
      "  sluice-bench --role target [--listen H:P]   on host A (prints its address)\n"
      "  sluice-bench --role initiator --connect H:P on host B\n"
      "\n"
      "  --transport tcp|shm|...   force a transport (default: the fastest both sides have)\n"
      "  --op read|write|write_imm|send|pingpong|post   (default write; post: the thin post path,\n"
      "       batch post_writes + one post_signal per unit, flushed at the end)\n"
      "                            pingpong: a write to the target, which writes the same size\n"
      "                            back; latency = half the round trip (what ib_write_lat\n"
      "                            reports); batch/concurrency ignored\n"
      "  --notify flag|imm         pingpong: how each side learns that the write arrived\n"
      "                            flag (default): spin on the last byte, a counter, after the\n"
      "                            write completed (ib_write_lat's loop); imm: write_with_imm and\n"
      "                            imm_recv\n"
      "  --min-size N --max-size N power-of-two sweep, suffixes K/M/G (default 8 .. 64M)\n"
      "  --batch-size N            assignments per batch (default 64)\n"
      "  --concurrency N           outstanding batches (default 8)\n"
      "  --iterations N            batches per size (default: scaled to the size)\n"
      "  --channels N              channels per endpoint (default 2)\n"
      "  --memfd                   use engine-allocated shareable memory on both sides\n"
      "  --check                   verify every byte after each size\n"
      "  --baseline                also measure the ceiling (raw TCP stream / process_vm_readv /\n"
      "                            memcpy) for the same sizes and print the ratio\n"
      "  --json | --csv            machine-readable output on stdout\n"
      "  --quiet                   no progress on stderr\n"
      "  --metrics                 print the initiator's endpoint metrics (Prometheus text) on\n"
      "                            stderr at the end\n"
      "  --list-params             print every engine parameter (name, variable, default, doc)");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") { usage(); std::exit(0); }
    else if (a == "--list-params") { list_params(); std::exit(0); }
    else if (a == "--role") o.role = next();
    else if (a == "--transport") o.transport = next();
    else if (a == "--op") o.op = next();
    else if (a == "--notify") o.notify = next();
    else if (a == "--min-size") o.min_size = parse_size(next());
    else if (a == "--max-size") o.max_size = parse_size(next());
    else if (a == "--size") o.min_size = o.max_size = parse_size(next());
    else if (a == "--batch-size") o.batch = std::stoi(next());
    else if (a == "--concurrency") o.concurrency = std::stoi(next());
    else if (a == "--iterations") o.iterations = std::stoi(next());
    else if (a == "--channels") o.channels = std::stoi(next());
    else if (a == "--connect") o.connect = next();
    else if (a == "--listen") o.listen = next();
    else if (a == "--check") o.check = true;
    else if (a == "--json") o.json = true;
    else if (a == "--csv") o.csv = true;
    else if (a == "--baseline") o.baseline = true;
    else if (a == "--memfd") o.memfd = true;
    else if (a == "--quiet") o.quiet = true;
    else if (a == "--metrics") o.metrics = true;
    else throw std::invalid_argument("unknown option '" + a + "' (see --help)");
  }
  if (o.op != "read" && o.op != "write" && o.op != "write_imm" && o.op != "send" && o.op != "pingpong" &&
      o.op != "post")
    throw std::invalid_argument("--op must be read, write, write_imm, send, pingpong or post");
  if (o.notify != "flag" && o.notify != "imm") throw std::invalid_argument("--notify must be flag or imm");
  if (o.op == "pingpong") {
    o.batch = 1;
    o.concurrency = 1;
  }
  if (o.role != "loopback" && o.role != "target" && o.role != "initiator")
    throw std::invalid_argument("--role must be loopback, target or initiator");
  if (o.role == "initiator" && o.connect.empty()) throw std::invalid_argument("--role initiator needs --connect");
  if (o.min_size == 0 || o.max_size < o.min_size) throw std::invalid_argument("bad size range");
  if (o.batch < 1 || o.concurrency < 1 || o.channels < 1) throw std::invalid_argument("batch, concurrency, channels must be >= 1");
  return o;
}

}  // namespace bench
