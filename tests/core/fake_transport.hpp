// A fake transport for the core's tests: two engines in ONE process, and a data path that
// is an in-process queue the test drives. Only the data path is fake: the handshake (hello,
// channel attach) still goes through the engines' own listeners on loopback, which is the
// core's code. Registered (name "fake", priority 0) only in the test binary that links
// fake_transport.cpp; an Engine there offers it when its config lists "fake".
//
// submit() queues one item per non-empty lane and send() one item per message; nothing moves
// until the test says so. The test may deliver an item (the target side validates every piece
// against the target engine's Registry exactly as a real transport does: pin with bounds,
// then copy, then the lane completes), fail it with a given Status (a NACK), report progress
// for it, tamper with it (a forged request), deliver items in any order, or hold it (never
// touch it: the engine's watchdog must time it out). lose() plays a transport that lost its
// peer (everything pending fails, then EndpointEvents::on_failure).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "transport/transport.hpp"

namespace sluice::detail::fake {

class FakeEndpoint;

// One lane of a transfer, or one message, waiting for the test.
struct Item {
  std::weak_ptr<FakeEndpoint> from;
  bool is_send = false;
  uint64_t token = 0;  // PendingOps token (transfer) or sequence number (send)
  size_t lane = 0;     // index into the op's lanes
  uint32_t nlanes = 0;  // non-empty lanes of the op (write_with_imm: when to deliver the imm)
};

// The queue every fake endpoint in the process submits to (FIFO: index 0 is the oldest).
class FakeNet {
 public:
  static FakeNet& get();

  size_t queued() const;
  // Waits until at least n items are queued; false after `timeout`.
  bool wait_queued(size_t n, std::chrono::milliseconds timeout = std::chrono::seconds(5)) const;
  // Removes item i and runs the target side; returns the status the lane completed with.
  Status deliver(size_t i);
  // Removes item i and completes it with `st` (the target refused it).
  void fail(size_t i, const Status& st);
  // Item i's op made progress (bytes moved), without completing it.
  void progress(size_t i);
  // A hostile or buggy initiator: rewrite item i's pieces before it is delivered.
  void tamper(size_t i, const std::function<void(Piece&)>& edit);
  // The transport of item i's endpoint lost its peer with `why`.
  void lose(size_t i, const Status& why);
  // Drops every item (between tests).
  void clear();

  // For the fake endpoints.
  void push(Item it);
  void drop_from(const FakeEndpoint* ep);
  void link(uint64_t token, bool active, std::weak_ptr<FakeEndpoint> ep);
  void unlink(uint64_t token, const FakeEndpoint* ep);
  std::shared_ptr<FakeEndpoint> peer_of(uint64_t token, bool active) const;
  // Held while the target side copies and while an endpoint closes: once close() returned,
  // no delivery touches that endpoint's memory or its (possibly destroyed) events.
  std::mutex& serve_mu() { return serve_mu_; }

 private:
  Item take(size_t i);

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::deque<Item> items_;
  struct Pair {
    std::weak_ptr<FakeEndpoint> active, passive;
  };
  std::unordered_map<uint64_t, Pair> pairs_;  // by endpoint token: both sides share it
  std::mutex serve_mu_;
};

// The tests' shorthand for the process-wide fake network.
inline FakeNet& net() { return FakeNet::get(); }

}  // namespace sluice::detail::fake
