// Stream-ordered point-to-point messages between GPUs of one host (CUDA builds; throws
// kNoDevice without a GPU), as NCCL's send/recv: a send and its recv are kernels on the
// callers' streams, no host thread takes part once they are queued, and both can be captured
// into CUDA graphs.
//
// One object per rank, built with the ranks it may exchange with. Construction allocates the
// only device memory it will ever use: one region per peer, which that peer writes into (its
// messages to us, staged in a ring of slots, and its acknowledgements of ours). Exchange
// handle() strings with each peer (any bootstrap), connect(peer, its handle), then send() and
// recv() as often as needed.
//
// A message is cut into pieces dealt round-robin to up to `lanes` lanes; each lane is one
// thread block on each side with its own ring of `slots` slots in the receiver's region. The
// sender's block stores a piece over NVLink into a free slot and publishes it (release flag);
// the receiver's block copies it out and frees the slot (a release flag in the sender's
// region). A piece carries its message's size and tag: a recv that meets a message of another
// size or tag stops with an error instead of delivering it (the pair is then unusable).
//
// The contract, as NCCL's: a pair's messages in one direction are matched in the order they
// were queued (sends to a peer ordered among themselves, recvs from it too: one stream, or
// streams ordered by events); a send larger than the ring completes only once its recv runs,
// so a send and a recv that wait for each other across two ranks must not be queued in the
// same order on one stream each (as with NCCL outside a group call).
//
// Waits inside the kernels are bounded by set_timeout() (0: unbounded); a wait that runs out,
// a mismatch, an abort() or a failure the peer reports stops every kernel of this object
// promptly and status() says what happened (kTimeout, kProtocol for a mismatch, kCancelled,
// kRemoteError); every later call fails with it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sluice/error.hpp"
#include "sluice/export.hpp"

namespace sluice::cuda {

struct StreamP2pOptions {
  int lanes = 32;                      // thread blocks per message at most (1..64)
  int slots = 4;                       // ring slots per lane (2..8)
  uint64_t slot_bytes = 256ull << 10;  // a multiple of 4 KiB
};

class SLUICE_API StreamP2p {
 public:
  // `peers`: the ranks this one may exchange with (distinct, not `rank`, at most 63).
  StreamP2p(int rank, const std::vector<int>& peers, int device, StreamP2pOptions options = {});
  ~StreamP2p();
  StreamP2p(const StreamP2p&) = delete;
  StreamP2p& operator=(const StreamP2p&) = delete;

  // Opaque, printable: this rank's regions for its peers.
  std::string handle() const;
  // Maps `peer`'s regions (its handle()); both ranks must list each other and use the same
  // options. Throws naming what does not fit.
  void connect(int peer, const std::string& handle);
  bool connected(int peer) const;

  // Queue a message of `bytes` to / from `peer` on `stream` (a cudaStream_t; nullptr = the
  // legacy default stream). Zero bytes queue nothing. Both sides must pass the same bytes and
  // tag. Throws if the object already failed (status()).
  void send(int peer, const void* in, uint64_t bytes, void* stream, uint32_t tag = 0);
  void recv(int peer, void* out, uint64_t bytes, void* stream, uint32_t tag = 0);

  void set_timeout(std::chrono::milliseconds timeout);
  // Stops every kernel of this object that waits, now and later (they return with their
  // messages incomplete); status() then reports kCancelled.
  void abort();
  // OK, or the first failure seen by a kernel (read from mapped host memory: a kernel's
  // failure shows once it happened, without a synchronize).
  Status status() const;

  // Waits until this object's kernels have ended (a device synchronize).
  void quiesce();

  // Device memory per peer, in bytes.
  uint64_t region_bytes() const;
  int rank() const;

  struct Impl;

 private:
  void launch(bool send, int peer, void* data, uint64_t bytes, void* stream, uint32_t tag);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sluice::cuda
