// The records of nvlink's thin post path (post_path.cpp): a post, and the per-device stream
// its copies and signal kernels go on. Everything here is reused: no allocation per post in
// the steady state (the rings grow to the post depth once, posts come from a free list).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/post_batch_kernel.hpp"

#include "transport/common/lease_table.hpp"
#include "transport/common/same_host_wire.hpp"
#include "transport/transport.hpp"

namespace sluice::detail::nvlink {

// A FIFO on a vector that only grows (std::deque allocates and frees blocks as it moves).
template <class T>
class Ring {
 public:
  bool empty() const { return n_ == 0; }
  size_t size() const { return n_; }
  T& front() { return buf_[head_]; }
  T& back() { return buf_[(head_ + n_ - 1) % buf_.size()]; }
  void push(T v) {
    if (n_ == buf_.size()) grow();
    buf_[(head_ + n_) % buf_.size()] = std::move(v);
    ++n_;
  }
  void pop() {
    head_ = (head_ + 1) % buf_.size();
    --n_;
  }
  void clear() { head_ = n_ = 0; }

 private:
  void grow() {
    std::vector<T> b(buf_.empty() ? 64 : buf_.size() * 2);
    for (size_t i = 0; i < n_; ++i) b[i] = std::move(buf_[(head_ + i) % buf_.size()]);
    buf_.swap(b);
    head_ = 0;
  }
  std::vector<T> buf_;
  size_t head_ = 0, n_ = 0;
};

// One post. A TransferOp so that PendingOps gives it a token (the owner's ACK names it),
// fails it with the endpoint and completes it through the post handler.
struct PostOp : TransferOp {
  // How it completes: an event recorded behind it on its post stream (copies, signal
  // kernels), or the owner's ACK (PULL_WRITE into its unmapped host memory, kSignal frames).
  enum class Via : uint8_t { kStream, kOwner };
  Via via = Via::kStream;
  same_host::PullPiece piece{};  // kOwner write: the PULL_WRITE's payload (lives as long as the frame)
  uint32_t lease_slot = kNoLease;  // kStream: the peer region our copy reaches stays registered
  uint64_t lease_id = 0;
  uint8_t* counter = nullptr;      // kStream signal: the peer's counter as mapped here
  struct PostStream* stream = nullptr;
  // A batch kernel's run is ONE op for all its posts (post_batch.cpp): `posts` of them count
  // against post.depth, `leases` holds the lease slot each entered, `pins` every source.
  uint32_t posts = 1;
  std::vector<uint32_t> leases;
};

// The dedicated post stream of one device. Posts are enqueued in order; a "mark" is placed
// behind every few of them (and at flush, and when a signal waits for them) and the poller
// completes the posts before a mark once it passed. A mark is the sequence number of a batch
// kernel when that launch is the last thing on the stream (the kernel stores it into `done`,
// host memory: the poller reads a word, no CUDA call that would contend with the next
// launch), else an event recorded behind the posts.
struct PostStream {
  struct Entry {
    uint64_t token = 0;
    uint64_t epoch = 0;   // its writes' SignalSequencer epoch
    uint32_t writes = 0;  // writes counted in the sequencer (0: a signal kernel)
  };
  struct Mark {
    uint64_t seq = 0;             // nonzero: passed once *done >= seq (no event)
    std::chrono::steady_clock::time_point since{};  // a seq mark's start (a kernel that faulted never stores it)
    cudaEvent_t event = nullptr;  // null (and no seq): recording failed, the stream was synchronised instead
    size_t count = 0;             // the oldest `count` entries complete with it
    cudaError_t error = cudaSuccess;  // with a null event: how the synchronisation ended
  };
  int device = 0;
  cudaStream_t stream = nullptr;
  unsigned* arrivals = nullptr;  // the batch kernel's grid-wide counter (stream-ordered allocation)
  uint64_t* done = nullptr;      // host word: the last batch kernel's seq that finished (null: events only)
  uint64_t launched = 0;         // batch kernels launched on the stream (their seqs)
  uint64_t tail_seq = 0;         // the last launch's seq while nothing was enqueued after it, else 0
  Ring<Entry> entries;  // enqueued, not completed, in stream order
  Ring<Mark> marks;
  size_t unmarked = 0;        // entries at the back that no mark covers yet
  size_t unmarked_posts = 0;  // the posts of those entries (a run's entry holds many)
};

// A run of small posts collected by post_batch (post_batch.cpp) for one batch kernel on
// `stream`: SM copies and kernel signals, and the ONE op that stands for all of them (its
// pins and leases), added to PendingOps and to the stream's ring once the kernel is launched.
struct PostGroup {
  PostStream* stream = nullptr;
  cuda::BatchArgs args;
  std::shared_ptr<PostOp> op;  // taken at the run's first post
  uint32_t posts = 0, writes = 0;
  size_t first_item = 0;  // the batch index of its first post (reported if the launch fails)
  bool empty() const { return posts == 0; }
  void clear() {
    stream = nullptr;
    args.copies = args.signals = 0;
    op.reset();
    posts = writes = 0;
  }
};

// Makes `device` current for a scope and restores the caller's: posters are application
// threads, their current device is theirs.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      cudaGetLastError();
      prev_ = -1;
    }
    if (prev_ != device && cudaSetDevice(device) != cudaSuccess) cudaGetLastError();  // the enqueue reports it
  }
  ~DeviceScope() {
    int now = -1;
    if (prev_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != prev_) cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = -1;
};

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  return {ErrorCode::kInternal, std::string("nvlink post: ") + what + ": " + cudaGetErrorString(e)};
}

inline Status gone(uint64_t id) {
  return {ErrorCode::kUnknownHandle, "peer region " + std::to_string(id) + " is no longer registered"};
}

}  // namespace sluice::detail::nvlink
