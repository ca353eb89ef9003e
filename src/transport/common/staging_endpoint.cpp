#include "transport/common/staging_endpoint.hpp"

#include <algorithm>
#include <vector>

#include "cuda/staging.hpp"

namespace sluice::detail {
namespace {

class CudaStager final : public Stager {
 public:
  bool stages(const RegionEntry& region) const override { return staging::is_device(region.location); }
  std::shared_ptr<uint8_t> buffer(uint64_t n) override { return staging::pinned(n); }
  void download(void* host, const void* device, uint64_t n) override { staging::download(host, device, n); }
  void upload(void* device, const void* host, uint64_t n) override { staging::upload(device, host, n); }
};

// One staged piece: the caller's memory and the host buffer that stands in for it.
struct StagedPiece {
  uint8_t* device;
  std::shared_ptr<uint8_t> host;
  uint64_t length;
};

// The op's local region that holds p (the core pinned every region its pieces use).
const RegionEntry* region_of(const TransferOp& op, const uint8_t* p) {
  for (const auto& pin : op.pins) {
    const RegionEntry* e = pin.get();
    if (e && p >= e->base && p < e->base + e->length) return e;
  }
  return nullptr;
}

}  // namespace

std::shared_ptr<Stager> cuda_stager() { return std::make_shared<CudaStager>(); }

void StagingEndpoint::submit(std::shared_ptr<TransferOp> op) {
  bool any = false;
  for (const auto& pin : op->pins) any |= pin && stager_->stages(*pin.get());
  if (!any) {
    inner_->submit(std::move(op));
    return;
  }
  // The inner op is the caller's with staged pieces pointing at host buffers; it has a future
  // of its own, whose completion finishes the caller's (after the upload, for a read). The
  // caller's op (its pins) and the buffers live until then, held by that callback.
  const bool read = op->kind == OpKind::kRead;
  auto inner = std::make_shared<TransferOp>();
  inner->kind = op->kind;
  inner->imm = op->imm;
  inner->options = op->options;
  inner->lanes = op->lanes;
  inner->bytes = op->bytes;
  auto staged = std::make_shared<std::vector<StagedPiece>>();
  try {
    // All staged before anything is posted: a CUDA error fails the op with nothing sent.
    for (auto& lane : inner->lanes)
      for (auto& p : lane.pieces) {
        const RegionEntry* e = region_of(*op, p.local);
        if (!e || !stager_->stages(*e)) continue;
        auto buf = stager_->buffer(std::max<uint64_t>(p.length, 1));
        if (!read) stager_->download(buf.get(), p.local, p.length);
        staged->push_back({p.local, buf, p.length});
        p.local = buf.get();
      }
  } catch (const Error& e) {
    op->future->complete(e.status());
    return;
  }
  int parts = 0;
  for (const auto& lane : inner->lanes) parts += lane.pieces.empty() ? 0 : 1;
  inner->future = std::make_shared<FutureState>(op->kind, parts);
  inner->future->set_bytes(op->bytes);
  inner->future->on_complete([op, staged, stager = stager_, read](const Status& st) {
    Status result = st;
    if (read && st.ok()) {
      try {
        for (const auto& s : *staged) stager->upload(s.device, s.host.get(), s.length);
      } catch (const Error& e) {
        result = e.status();
      }
    }
    op->future->complete(result);
  });
  inner_->submit(std::move(inner));
}

void StagingEndpoint::send(std::shared_ptr<MessageOp> op) {
  if (!op->pin || !stager_->stages(*op->pin.get())) {
    inner_->send(std::move(op));
    return;
  }
  std::shared_ptr<uint8_t> buf;
  try {
    buf = stager_->buffer(std::max<uint64_t>(op->length, 1));
    stager_->download(buf.get(), op->ptr, op->length);
  } catch (const Error& e) {
    // As before the adapter: the message's sequence number is spent, nothing was sent.
    op->future->complete(e.status());
    return;
  }
  auto inner = std::make_shared<MessageOp>();
  inner->ptr = buf.get();
  inner->length = op->length;
  inner->seq = op->seq;
  inner->options = op->options;
  inner->future = std::make_shared<FutureState>(OpKind::kSend, 1);
  inner->future->on_complete([op, buf](const Status& st) { op->future->complete(st); });
  inner_->send(std::move(inner));
}

Status StagingEndpoint::post_write(PostWrite&& w, std::chrono::milliseconds timeout) {
  if (w.pin && stager_->stages(*w.pin.get()))
    return {ErrorCode::kUnsupported, "post_write from " + w.pin.get()->location.to_string() +
                                         " memory: this transport stages it, and posts are not staged"};
  return inner_->post_write(std::move(w), timeout);
}

}  // namespace sluice::detail
