// CUDA events for the Works of stream-ordered ops (the low-latency all_gather and all_reduce),
// reused instead of made per call: a c10::Event creates its cudaEvent_t on its first record,
// and that creation cost about as much as the rest of a small call's host work (docs/torch.md,
// "A small all_gather's host work"). An event goes back to its device's pool when the last
// holder (the Work, the all_gather's ordering of the next call) drops it. Events recorded inside
// a CUDA graph capture are never reused: the graph refers to them.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <c10/core/Event.h>

namespace sluice::torch_backend {

class EventPool {
 public:
  static constexpr size_t kKeep = 64;  // per device; more are destroyed when dropped

  std::shared_ptr<c10::Event> take(c10::DeviceIndex device, bool capturing) {
    if (capturing) return std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    std::unique_ptr<c10::Event> e;
    {
      std::lock_guard<std::mutex> lk(st_->mu);
      auto& free = st_->free[device];
      if (!free.empty()) {
        e = std::move(free.back());
        free.pop_back();
      }
    }
    if (!e) e = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    std::weak_ptr<State> home = st_;
    return std::shared_ptr<c10::Event>(e.release(), [home, device](c10::Event* ev) {
      std::unique_ptr<c10::Event> own(ev);
      if (auto st = home.lock()) {
        std::lock_guard<std::mutex> lk(st->mu);
        auto& free = st->free[device];
        if (free.size() < kKeep) free.push_back(std::move(own));
      }
    });
  }

  size_t pooled(c10::DeviceIndex device) const {
    std::lock_guard<std::mutex> lk(st_->mu);
    auto it = st_->free.find(device);
    return it == st_->free.end() ? 0 : it->second.size();
  }

 private:
  struct State {
    mutable std::mutex mu;
    std::map<c10::DeviceIndex, std::vector<std::unique_ptr<c10::Event>>> free;
  };
  std::shared_ptr<State> st_ = std::make_shared<State>();
};

}  // namespace sluice::torch_backend
