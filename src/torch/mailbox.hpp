// Tagged point-to-point messages between the ranks of one group, over one engine endpoint per
// peer. The engine matches the k-th send of an endpoint with the k-th recv posted on the other
// side; torch wants matching by (source, tag) and receives from any source. So each message
// travels as a 16-byte header (tag, length) followed by its payload, and one progress thread
// per backend keeps a header recv posted on every endpoint and steers each payload either
// into the buffer of the first matching posted recv or into an unexpected-message buffer.
// Torch-free: buffers are raw host pointers, completions are callbacks.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sluice/engine.hpp"

namespace sluice::torch_backend {

class Mailbox {
 public:
  // status, the rank the message came from (recv) or went to (send), payload bytes.
  using Done = std::function<void(const Status&, int peer, uint64_t bytes)>;
  static constexpr int kAnySource = -1;

  // `peers[r]` is the endpoint to rank r (invalid for `rank` itself). `timeout` bounds every
  // operation: a recv no message matches and a send its peer does not take in that time fail
  // with kTimeout naming the peer.
  Mailbox(Engine& engine, std::vector<Endpoint> peers, int rank, std::chrono::milliseconds timeout);
  ~Mailbox();
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // [ptr, ptr+n) must stay valid until `done` ran. `done` runs on the progress thread and
  // must not block.
  void send(int dst, uint64_t tag, const void* ptr, uint64_t n, Done done);
  // The message must be exactly `n` bytes (a different length fails the recv with
  // kTruncated, and the message is consumed).
  void recv(int src, uint64_t tag, void* ptr, uint64_t n, Done done);
  // Fails everything pending with kCancelled and stops the thread. Idempotent.
  void close();
  void set_timeout(std::chrono::milliseconds t);

 private:
  using Clock = std::chrono::steady_clock;
  struct Header {
    uint64_t tag;
    uint64_t length;
  };
  struct PostedRecv {
    int src;
    uint64_t tag;
    void* ptr;
    uint64_t n;
    Done done;
    Clock::time_point deadline;
  };
  // A message whose header arrived before any recv matched it.
  struct Unexpected {
    int src;
    uint64_t tag;
    uint64_t length;
    std::vector<uint8_t> data;
    MemoryHandle handle;
    bool arrived = false;
    Status status;
    std::shared_ptr<PostedRecv> waiter;  // a recv matched it while the payload was in flight
  };
  struct Peer {
    Endpoint ep;
    MemoryHandle hdr_handle;
    Header hdr{};  // the header recv lands here (one outstanding per peer)
    Status failed;  // non-ok once the endpoint failed: later ops to this peer fail at once
  };

  void run();
  void run_task(std::function<void()>& task);
  void drain();  // runs queued tasks on the calling thread (after the thread stopped)
  void post(std::function<void()> task);
  void post_header_recv(int peer);
  void on_header(int peer, const Status& st);
  void fail_peer(int peer, const Status& st);
  void deliver(Unexpected& u, PostedRecv& r);
  void expire();
  MemoryHandle reg(const void* ptr, uint64_t n);
  void unreg(MemoryHandle h);
  std::string who(int peer) const;

  Engine& engine_;
  const int rank_;
  std::chrono::milliseconds timeout_;
  std::vector<Peer> peers_;
  // Progress-thread state.
  std::list<std::shared_ptr<PostedRecv>> posted_;
  std::list<std::shared_ptr<Unexpected>> unexpected_;
  // Registered header slots for outgoing messages (a header must outlive its send).
  std::vector<Header> send_hdrs_;
  MemoryHandle send_hdrs_handle_;
  std::vector<uint32_t> free_hdrs_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool closing_ = false;
  bool drained_ = false;  // close() finished: callbacks arriving now are dropped
  std::thread thread_;
};

}  // namespace sluice::torch_backend
