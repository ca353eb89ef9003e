#include "host_staging.hpp"

#include <string>

#include "work.hpp"

namespace sluice::torch_backend {

bool any_cuda(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts)
    if (t.defined() && t.is_cuda()) return true;
  return false;
}

bool any_cuda(const std::vector<std::vector<at::Tensor>>& ts) {
  for (const auto& v : ts)
    if (any_cuda(v)) return true;
  return false;
}

at::Tensor HostStaging::input(const at::Tensor& t) {
  if (!t.defined() || !t.is_cuda()) return t;
  return t.to(at::kCPU);  // blocking: after the work queued on the current stream
}

at::Tensor HostStaging::inout(const at::Tensor& t) {
  if (!t.defined() || !t.is_cuda()) return t;
  at::Tensor h = t.to(at::kCPU);
  back_.emplace_back(t, h);
  return h;
}

at::Tensor HostStaging::output(const at::Tensor& t) {
  if (!t.defined() || !t.is_cuda()) return t;
  at::Tensor h = at::empty_like(t, t.options().device(at::kCPU));
  back_.emplace_back(t, h);
  return h;
}

std::vector<at::Tensor> HostStaging::inputs(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(input(t));
  return out;
}

std::vector<at::Tensor> HostStaging::inouts(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(inout(t));
  return out;
}

std::vector<at::Tensor> HostStaging::outputs(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(output(t));
  return out;
}

std::vector<std::vector<at::Tensor>> HostStaging::inputs(const std::vector<std::vector<at::Tensor>>& ts) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& v : ts) out.push_back(inputs(v));
  return out;
}

std::vector<std::vector<at::Tensor>> HostStaging::outputs(const std::vector<std::vector<at::Tensor>>& ts) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& v : ts) out.push_back(outputs(v));
  return out;
}

c10::intrusive_ptr<c10d::Work> HostStaging::wrap(const c10::intrusive_ptr<c10d::Work>& inner, c10d::OpType type,
                                                 std::vector<at::Tensor> result, std::chrono::milliseconds timeout,
                                                 int rank, bool recv) {
  auto outer = c10::make_intrusive<SluiceWork>(type, std::move(result), timeout, rank);
  // A staged send/recv completes inside the mailbox's tasks, as its inner Work does: waiting
  // for it drives the same queue (work.hpp).
  if (auto* w = dynamic_cast<SluiceWork*>(inner.get())) outer->drive_with(w->progress_queue());
  // Runs where `inner` completes (a backend thread). The callback list is dropped once it
  // ran, which ends the inner -> future -> callback -> inner cycle.
  inner->getFuture()->addCallback([outer, inner, back = std::move(back_), recv, type](c10::ivalue::Future& f) {
    const int source = recv && !f.hasError() ? inner->sourceRank() : -1;
    if (f.hasError()) {
      outer->complete(f.exception_ptr(), source);
      return;
    }
    try {
      for (const auto& [dev, host] : back) dev.copy_(host);  // blocking
      outer->complete(nullptr, source);
    } catch (const std::exception& e) {
      outer->complete(backend_error(std::string("sluice: ") + c10d::opTypeToString(type) +
                                    ": copying the result back to the CUDA tensor failed: " + e.what()),
                      source);
    }
  });
  return outer;
}

}  // namespace sluice::torch_backend
