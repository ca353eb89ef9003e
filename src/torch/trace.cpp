#include "trace.hpp"

#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "core/log.hpp"

namespace sluice::torch_backend {

namespace {
const char* ev_name(uint8_t e) {
  static const char* names[] = {"send_call", "send_synced", "recv_call", "recv_synced", "header_out", "header_in",
                                "read_posted", "read_done", "done", "wait_start", "wait_end", "read_call"};
  return e < sizeof(names) / sizeof(names[0]) ? names[e] : "?";
}
}  // namespace

std::unique_ptr<Trace> Trace::from_env(int rank) {
  const char* p = std::getenv("SLUICE_TORCH_TRACE");
  if (!p || !*p) return nullptr;
  return std::unique_ptr<Trace>(new Trace(p, rank));
}

Trace::Trace(std::string path, int rank) : path_(std::move(path)), rank_(rank), recs_(kCap) {
  // Groups are made in the same order on every rank: the n-th traced group of each process is
  // the same group.
  static std::atomic<int> groups{0};
  group_ = groups.fetch_add(1);
}

uint64_t Trace::now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

int32_t Trace::this_tid() {
  thread_local int32_t tid = static_cast<int32_t>(::syscall(SYS_gettid));
  return tid;
}

Trace::~Trace() {
  const std::string file = path_ + ".g" + std::to_string(group_) + ".rank" + std::to_string(rank_) + ".csv";
  FILE* f = std::fopen(file.c_str(), "w");
  if (!f) {
    SLUICE_LOG(kWarn, "sluice torch: SLUICE_TORCH_TRACE: cannot write " << file);
    return;
  }
  const size_t n = std::min(next_.load(), kCap);
  std::fprintf(f, "t_ns,rank,pid,tid,event,peer,id,kind\n");
  const int pid = static_cast<int>(::getpid());
  for (size_t i = 0; i < n; ++i) {
    const Rec& r = recs_[i];
    std::fprintf(f, "%llu,%d,%d,%d,%s,%d,%llu,%u\n", static_cast<unsigned long long>(r.t), rank_, pid, r.tid,
                 ev_name(r.ev), r.peer, static_cast<unsigned long long>(r.id), static_cast<unsigned>(r.kind));
  }
  if (next_.load() > kCap)
    std::fprintf(stderr, "sluice torch: SLUICE_TORCH_TRACE: %zu events past the %zu recorded were dropped\n",
                 next_.load() - kCap, kCap);
  std::fclose(f);
}

}  // namespace sluice::torch_backend
