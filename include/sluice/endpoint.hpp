// A connection to one peer engine, over one transport, with N channels.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "sluice/error.hpp"
#include "sluice/export.hpp"
#include "sluice/future.hpp"
#include "sluice/metrics.hpp"
#include "sluice/types.hpp"

namespace sluice {

namespace detail {
class EndpointImpl;
}

// One request of Endpoint::post_batch: a post_write or a post_signal, with its arguments.
struct PostRequest {
  enum class Kind : uint8_t { kWrite, kSignal };
  Kind kind = Kind::kWrite;
  MemoryHandle local;         // kWrite: the source
  uint64_t local_offset = 0;  // kWrite
  RemoteHandle remote;        // kWrite: the destination; kSignal: the counter's region
  uint64_t remote_offset = 0;
  uint64_t length = 0;        // kWrite
  uint64_t add = 1;           // kSignal

  static PostRequest write(MemoryHandle local, uint64_t local_offset, RemoteHandle remote, uint64_t remote_offset,
                           uint64_t length) {
    return {Kind::kWrite, local, local_offset, remote, remote_offset, length, 0};
  }
  static PostRequest signal(RemoteHandle remote, uint64_t offset, uint64_t add = 1) {
    return {Kind::kSignal, MemoryHandle{}, 0, remote, offset, 0, add};
  }
};

// What post_batch did: the first `posted` requests were posted; if `error` is not ok, request
// number `posted` failed with it (its message is what post_write / post_signal would have
// thrown) and none after it was posted.
struct PostBatchResult {
  size_t posted = 0;
  Status error;
};

class SLUICE_API Endpoint {
 public:
  Endpoint() = default;
  explicit Endpoint(std::shared_ptr<detail::EndpointImpl> impl) : impl_(std::move(impl)) {}

  // One-sided operations over a batch. Caller errors (unknown handle, out-of-range offset,
  // empty batch, closed endpoint, an option the transport lacks the capability for) throw
  // Error at once and transfer nothing; everything that goes wrong later completes the Future
  // with an error. `options` travel with the op to the transport (see OpOptions; e.g. a
  // cuda_stream on a transport without Capabilities::stream_ordered throws kUnsupported).
  Future read(const Batch& batch, const OpOptions& options = {});
  Future write(const Batch& batch, const OpOptions& options = {});
  // The peer gets exactly one imm completion (imm_recv), after every byte of the batch is
  // visible in its memory.
  Future write_with_imm(const Batch& batch, uint32_t imm, const OpOptions& options = {});

  // Two-sided messages. Matching rule: the k-th send on this endpoint is received by the k-th
  // recv posted on the peer's side of the same endpoint, whatever their sizes. A message
  // larger than its receive buffer fails the recv with kTruncated (the first `length` bytes
  // are delivered), and the send too unless it completed eagerly. A send completes once the
  // peer holds the data, except an eager one: over shm, a send of at most shm.eager_max bytes
  // (64 KiB) completes once its bytes are copied and queued to the peer, within buffer space
  // the peer granted (shm.eager_credit), as MPI's and gloo's small sends do; what the peer
  // finds afterwards fails only its recv. A local close() (of the endpoint or the engine)
  // first lets queued eager sends leave, waiting at most min(op_timeout, 5 s) for a peer that
  // does not read. The caller may reuse the buffer once any send completed. A cuda_stream
  // option needs Capabilities::stream_ordered_messages.
  Future send(MemoryHandle local, uint64_t offset, uint64_t length, const OpOptions& options = {});
  Future recv(MemoryHandle local, uint64_t offset, uint64_t length, const OpOptions& options = {});
  // Completes with the next imm value the peer delivered (Future::imm()), in arrival order.
  Future imm_recv();

  // The thin post path (Capabilities::rma_post), for proxies that turn a stream of small
  // requests into transfers (the GPU port channel): no Future, no batch planning per call.
  // - post_write() copies `length` bytes from local + local_offset to remote +
  //   remote_offset. It returns once the write is accepted (waiting, at most op_timeout,
  //   while post.depth posts are outstanding); the local bytes must stay unchanged until a
  //   flush() returned.
  // - post_signal() raises the peer's 64-bit counter at remote + offset (8-byte aligned) by
  //   `add`, after every byte of every earlier post_write of this endpoint is visible there.
  //   A peer that reads the counter with acquire order and sees the new value sees the data.
  //   rdma makes it an atomic add; the others are atomic for host counters and, for cuda
  //   counters, against other signals only (so a counter is raised by peers, never written
  //   by its owner meanwhile).
  // - flush() returns once every earlier post finished; it throws the first error any of
  //   them met since the last flush, or kTimeout (0: op_timeout).
  // Caller errors (unknown handle, out of range, no rma_post capability) and a failed
  // endpoint throw at once. Posts on one endpoint are serialised; use one poster per
  // endpoint for speed.
  void post_write(MemoryHandle local, uint64_t local_offset, RemoteHandle remote, uint64_t remote_offset,
                  uint64_t length);
  void post_signal(RemoteHandle remote, uint64_t offset, uint64_t add = 1);
  // The requests in order, as that many post_write / post_signal calls would post them (same
  // checks, same ordering: a signal after every earlier write of the endpoint), in one call
  // so that a transport can turn many small requests into few operations (nvlink: one
  // kernel for a run of small writes and their signals). Errors are returned, not thrown,
  // so that the caller learns which request failed (PostBatchResult).
  PostBatchResult post_batch(std::span<const PostRequest> requests);
  void flush(std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  // The handle of a region the peer registered under `name`, if its blob advertised one.
  std::optional<RemoteHandle> remote_region(const std::string& name) const;
  std::vector<RegionInfo> remote_regions() const;
  // Refresh the peer's region table (regions it registered after we connected).
  void refresh_remote_regions();
  // Adds the region a peer's Engine::region_descriptor() described to this endpoint's table
  // and returns its handle (kept across refresh_remote_regions() while the peer is the same
  // engine). The peer checks every access against its own registry, as for any handle, so a
  // forged or stale descriptor reaches nothing it does not have registered. kInvalidArgument
  // for a malformed descriptor or one of another engine than this endpoint's peer.
  RemoteHandle import_region(const std::string& descriptor);

  std::string transport() const;
  // What the endpoint's transport can do (fixed for the endpoint's life).
  Capabilities capabilities() const;
  int channels() const;
  std::string peer_engine_id() const;
  bool connected() const;
  // Counters of every operation submitted on this endpoint so far (sluice/metrics.hpp).
  EndpointMetrics metrics() const;
  // Fail pending operations with kCancelled and close the channels.
  void close();

  bool valid() const { return static_cast<bool>(impl_); }
  const std::shared_ptr<detail::EndpointImpl>& impl() const { return impl_; }

 private:
  std::shared_ptr<detail::EndpointImpl> impl_;
};

}  // namespace sluice
