#include "stream_p2p_link.hpp"

#include <algorithm>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "core/log.hpp"
#include "sluice/stream_p2p.hpp"

namespace sluice::torch_backend {

namespace {
std::string handle_key(int rank) { return "sluice_torch/p2p_stream/h/" + std::to_string(rank); }
}  // namespace

StreamP2pLink::StreamP2pLink(c10::intrusive_ptr<c10d::Store> store, int rank, std::vector<int> peers,
                             std::chrono::milliseconds timeout)
    : store_(std::move(store)), rank_(rank), peers_(std::move(peers)), timeout_(timeout) {}

StreamP2pLink::~StreamP2pLink() = default;

bool StreamP2pLink::reaches(int peer) const {
  return std::find(peers_.begin(), peers_.end(), peer) != peers_.end();
}

void StreamP2pLink::set_timeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lk(mu_);
  timeout_ = timeout;
  if (p2p_) p2p_->set_timeout(timeout);
}

void StreamP2pLink::abandon() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!p2p_) return;
  p2p_->abort();
  (void)p2p_.release();
}

void StreamP2pLink::quiesce() {
  std::lock_guard<std::mutex> lk(mu_);
  if (p2p_) p2p_->quiesce();
}

std::string StreamP2pLink::state() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!p2p_) return "not set up (the first CUDA send or recv sets it up)";
  Status st = p2p_->status();
  if (!st.ok()) return "failed: " + st.message;
  int n = 0;
  for (int p : peers_) n += p2p_->connected(p);
  return "on: " + device_->str() + ", " + std::to_string(n) + " peer(s) connected";
}

uint64_t StreamP2pLink::calls() const {
  std::lock_guard<std::mutex> lk(mu_);
  return calls_;
}

cuda::StreamP2p& StreamP2pLink::ready(int peer, const at::Tensor& t, bool capturing) {
  const std::string me = "sluice: rank " + std::to_string(rank_) + ": ";
  if (!p2p_) {
    // Allocating and the Store round trips cannot be captured; nor can NCCL's first call.
    TORCH_CHECK(!capturing, me, "the first CUDA send/recv sets up the stream path and cannot run inside a CUDA graph "
                            "capture: run one before capturing");
    p2p_ = std::make_unique<cuda::StreamP2p>(rank_, peers_, t.device().index());
    p2p_->set_timeout(timeout_);
    device_ = t.device();
    const std::string h = p2p_->handle();
    store_->set(handle_key(rank_), std::vector<uint8_t>(h.begin(), h.end()));
    SLUICE_LOG(kInfo, me << "stream-ordered send/recv set up on " << t.device() << ", "
                         << p2p_->region_bytes() * peers_.size() << " bytes for " << peers_.size() << " peer(s)");
  }
  TORCH_CHECK(*device_ == t.device(), me, "the stream path runs on ", *device_,
              " (this rank's first CUDA send/recv), this tensor is on ", t.device(),
              ": every CUDA send/recv of a rank in a group must use one GPU");
  Status st = p2p_->status();
  TORCH_CHECK(st.ok(), me, "an earlier CUDA send/recv failed, the group's stream path is unusable: ", st.message);
  if (!p2p_->connected(peer)) {
    TORCH_CHECK(!capturing, me, "the first CUDA send/recv with rank ", peer,
                " connects to it and cannot run inside a CUDA graph capture: exchange one message before capturing");
    try {
      store_->wait({handle_key(peer)}, timeout_);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, me, "rank ", peer, " made no CUDA send/recv within ", timeout_.count(),
                  " ms, so its side of the stream path does not exist (both ranks of a message must pass CUDA tensors "
                  "with SLUICE_TORCH_CUDA_PATH=stream): ", e.what());
    }
    auto v = store_->get(handle_key(peer));
    p2p_->connect(peer, std::string(v.begin(), v.end()));
  }
  return *p2p_;
}

c10::Stream StreamP2pLink::fork(int peer, bool send, const at::Tensor& t, const c10::Stream& current, bool capturing) {
  const c10::impl::DeviceGuardImplInterface* g = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  auto it = streams_.find({peer, send});
  if (it == streams_.end()) it = streams_.emplace(std::make_pair(peer, send), g->getStreamFromGlobalPool(t.device(), false)).first;
  const c10::Stream s = it->second;
  // Inside a capture this wait pulls the stream into it; the Work's wait() joins it back.
  auto in = events_.take(t.device().index(), capturing);
  in->record(current);
  in->block(s);
  // The caching allocator must not hand the tensor's memory to other work before the kernel
  // is through with it, should the caller drop the tensor without waiting.
  // (Inside a capture the graph's private pool keeps it.)
  if (!capturing) g->recordDataPtrOnStream(t.storage().data_ptr(), s);
  return s;
}

std::shared_ptr<c10::Event> StreamP2pLink::join(const c10::Stream& s, bool capturing) {
  auto done = events_.take(s.device_index(), capturing);
  done->record(s);
  return done;
}

StreamP2pLink::Queued StreamP2pLink::send(const at::Tensor& t, int peer, uint32_t tag, const c10::Stream& current,
                                          bool capturing) {
  std::lock_guard<std::mutex> lk(mu_);
  cuda::StreamP2p& p = ready(peer, t, capturing);
  const c10::Stream s = fork(peer, true, t, current, capturing);
  p.send(peer, t.data_ptr(), t.nbytes(), s.native_handle(), tag);
  ++calls_;
  return {s, join(s, capturing)};
}

StreamP2pLink::Queued StreamP2pLink::recv(const at::Tensor& t, int peer, uint32_t tag, const c10::Stream& current,
                                          bool capturing, const std::function<void()>& after) {
  std::lock_guard<std::mutex> lk(mu_);
  cuda::StreamP2p& p = ready(peer, t, capturing);
  const c10::Stream s = fork(peer, false, t, current, capturing);
  p.recv(peer, t.data_ptr(), t.nbytes(), s.native_handle(), tag);
  if (after) {
    c10::StreamGuard guard(s);
    after();
  }
  ++calls_;
  return {s, join(s, capturing)};
}

}  // namespace sluice::torch_backend
