// A peer directory kept in the c10d Store that torch.distributed hands to the backend, so that
// bootstrap needs no extra port and no side channel: rank r publishes its engine info under
// "<prefix>rank/<r>", and a peer is named "rank:<r>".
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <unordered_map>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "directory/peer_directory.hpp"

namespace sluice::torch_backend {

class StoreDirectory final : public detail::PeerDirectory {
 public:
  StoreDirectory(c10::intrusive_ptr<c10d::Store> store, int rank, std::string prefix = "sluice/");

  // Writes the first info only. The backend moves data with two-sided messages, so peers
  // never need our region table; republishing on every tensor registration would put a
  // Store round trip on the send path (wants_updates() turns false after the first).
  void publish(const detail::EngineInfo& self) override;
  void withdraw(const std::string& engine_id) override;
  // `ref` is "rank:<r>". Waits for that rank to publish, at most until `deadline`.
  detail::EngineInfo lookup(const std::string& ref, Clock::time_point deadline) override;
  std::string ref_for(const detail::EngineInfo& peer) const override;
  bool wants_updates() const override;

  static std::string ref(int rank) { return "rank:" + std::to_string(rank); }
  // The rank whose published info carries `engine_id` (looked up earlier), or -1.
  int rank_of(const std::string& engine_id) const;

 private:
  std::string key(int rank) const { return prefix_ + "rank/" + std::to_string(rank); }

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const std::string prefix_;
  mutable std::mutex mu_;
  bool published_ = false;
  std::unordered_map<std::string, int> rank_by_engine_;
};

}  // namespace sluice::torch_backend
