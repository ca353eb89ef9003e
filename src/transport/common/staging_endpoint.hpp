// CUDA staging as one adapter: a TransportEndpoint that wraps a host-only endpoint (tcp) and
// stages the INITIATOR side's CUDA pieces through pinned host buffers, so the transport
// itself never sees device memory it initiates from or into:
// - write / write_with_imm / send from CUDA memory: the bytes are downloaded into pinned
//   buffers and the inner endpoint sends those (piece.local rewritten);
// - read into CUDA memory: the inner endpoint lands the bytes in pinned buffers, which are
//   uploaded when the inner op completed; then the caller's future completes.
// Everything else is forwarded. The TARGET side (a peer writing into or reading from our CUDA
// region) stays the transport's: it is where the bytes arrive.
#pragma once

#include <cstdint>
#include <memory>

#include "transport/transport.hpp"

namespace sluice::detail {

// How the adapter moves bytes between device and pinned host memory. The default
// (cuda_stager) is src/cuda/staging.hpp; tests inject a fake that copies host to host.
class Stager {
 public:
  virtual ~Stager() = default;
  // Whether pieces in this local region are staged.
  virtual bool stages(const RegionEntry& region) const = 0;
  // A (pinned) host buffer of at least n bytes; throws Error.
  virtual std::shared_ptr<uint8_t> buffer(uint64_t n) = 0;
  // Synchronous copies; throw Error.
  virtual void download(void* host, const void* device, uint64_t n) = 0;
  virtual void upload(void* device, const void* host, uint64_t n) = 0;
};

// CUDA regions, through staging:: (pinned pool, synchronous copies).
std::shared_ptr<Stager> cuda_stager();

class StagingEndpoint final : public TransportEndpoint {
 public:
  StagingEndpoint(std::shared_ptr<TransportEndpoint> inner, std::shared_ptr<Stager> stager)
      : inner_(std::move(inner)), stager_(std::move(stager)) {}
  ~StagingEndpoint() override = default;

  void connect(const ChannelOpener& open) override { inner_->connect(open); }
  nlohmann::json attach(int index, const nlohmann::json& hello) override { return inner_->attach(index, hello); }
  bool adopt(int index, net::Socket sock) override { return inner_->adopt(index, std::move(sock)); }
  void submit(std::shared_ptr<TransferOp> op) override;
  void send(std::shared_ptr<MessageOp> op) override;
  // The thin post path has no completion to release a staging buffer at: a post from a
  // staged (CUDA) region is refused; host posts are forwarded.
  Status post_write(PostWrite&& w, std::chrono::milliseconds timeout) override;
  Status post_signal(const PostSignal& s, std::chrono::milliseconds timeout) override {
    return inner_->post_signal(s, timeout);
  }
  Status flush(std::chrono::milliseconds timeout) override { return inner_->flush(timeout); }
  void peer_updated(const EngineInfo& peer) override { inner_->peer_updated(peer); }
  std::shared_ptr<ProgressSource> progress_source() override { return inner_->progress_source(); }
  size_t pending() const override { return inner_->pending(); }
  std::pair<uint64_t, uint64_t> failover_counts() const override { return inner_->failover_counts(); }
  bool replaces_channels() const override { return inner_->replaces_channels(); }
  std::chrono::steady_clock::time_point last_progress() const override { return inner_->last_progress(); }
  size_t expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                    std::string* what) override {
    return inner_->expire_ops(now, timeout, what);
  }
  void close(const Status& why) override { inner_->close(why); }

  TransportEndpoint& inner() { return *inner_; }

 private:
  const std::shared_ptr<TransportEndpoint> inner_;
  const std::shared_ptr<Stager> stager_;
};

}  // namespace sluice::detail
