// Per-message timestamps, to find where a message's time goes between the ranks' threads
// (docs/torch.md, "Tracing where a message's time goes"). Off unless SLUICE_TORCH_TRACE names a
// file prefix: then each process records up to kCap events (CLOCK_MONOTONIC ns, which every
// process of a host shares; the thread; the event; the peer rank; the message id or header
// kind) and writes
// them to <prefix>.g<n>.rank<r>.csv when the group is destroyed (n: the process's n-th traced group). tools/sluice-torch-bench/trace.py
// pairs the ranks' records and prints the median time of each step.
// Recording is one atomic increment and four stores: cheap enough to leave in the hot path.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sluice::torch_backend {

enum class TraceEv : uint8_t {
  kSendCall,      // the backend's send() entered (peer = destination)
  kSendSynced,    // the caller's stream waited for (device path)
  kRecvCall,      // the backend's recv() entered (peer = source)
  kRecvSynced,
  kHeaderOut,     // a message header handed to the engine (id = the message id, kind = header kind)
  kHeaderIn,      // a message header taken from the engine
  kReadPosted,    // the receiver's engine READ of a CUDA payload submitted
  kReadDone,      // that READ completed (on whichever thread completed it)
  kDone,          // a send or recv finished in the mailbox (its Work is completed next)
  kWaitStart,     // Work::wait() entered
  kWaitEnd,       // Work::wait() returned
  kReadCall,      // the receiver's engine READ about to be submitted (read_posted: the call returned)
};

class Trace {
 public:
  static constexpr size_t kCap = 1 << 20;
  // nullptr unless SLUICE_TORCH_TRACE is set (read when a group is made, not at load time).
  static std::unique_ptr<Trace> from_env(int rank);
  ~Trace();  // writes the file

  void mark(TraceEv ev, int peer, uint64_t id = 0, uint8_t kind = 0) {
    const size_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= kCap) return;
    recs_[i] = {now_ns(), static_cast<int32_t>(peer), this_tid(), static_cast<uint8_t>(ev), kind, id};
  }
  static uint64_t now_ns();
  static int32_t this_tid();  // the kernel's thread id (tools/sluice-timeline records the same)

 private:
  Trace(std::string path, int rank);
  struct Rec {
    uint64_t t;
    int32_t peer;
    int32_t tid;
    uint8_t ev;
    uint8_t kind;
    uint64_t id;
  };
  std::string path_;
  int rank_;
  int group_ = 0;
  std::vector<Rec> recs_;
  std::atomic<size_t> next_{0};
};

}  // namespace sluice::torch_backend
