// StagingEndpoint (the CUDA staging adapter) over a fake inner endpoint and a fake stager that
// treats one host buffer as "device" memory: staged writes, reads and sends move the right
// bytes, the inner endpoint never sees a device address, a read's bytes reach the caller only
// once the inner op completed, and a stager or inner error fails the caller's op cleanly.
// No GPU needed: the seam is the Stager interface.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "transport/common/staging_endpoint.hpp"

using namespace sluice;
using namespace sluice::detail;

namespace {

constexpr uint64_t kBytes = 4096;

// The pretend device: pieces inside `device` are staged; copies are memcpy.
class FakeStager final : public Stager {
 public:
  explicit FakeStager(const RegionEntry* device) : device_(device) {}
  bool stages(const RegionEntry& r) const override { return &r == device_; }
  std::shared_ptr<uint8_t> buffer(uint64_t n) override {
    return std::shared_ptr<uint8_t>(new uint8_t[n](), std::default_delete<uint8_t[]>());
  }
  void download(void* host, const void* device, uint64_t n) override {
    if (fail_download) throw Error(ErrorCode::kSystem, "fake cuda: download failed");
    check_device(device, n);
    std::memcpy(host, device, n);
    ++downloads;
  }
  void upload(void* device, const void* host, uint64_t n) override {
    if (fail_upload) throw Error(ErrorCode::kSystem, "fake cuda: upload failed");
    check_device(device, n);
    std::memcpy(device, host, n);
    ++uploads;
  }
  int downloads = 0, uploads = 0;
  bool fail_download = false, fail_upload = false;

 private:
  void check_device(const void* p, uint64_t n) const {
    auto* b = static_cast<const uint8_t*>(p);
    EXPECT_TRUE(b >= device_->base && b + n <= device_->base + device_->length) << "a staged copy left the device region";
  }
  const RegionEntry* device_;
};

// Moves bytes between the ops' local pieces and `remote` when run() is called.
class FakeInner final : public TransportEndpoint {
 public:
  explicit FakeInner(const RegionEntry* device) : device_(device), remote(kBytes) {}
  void connect(const ChannelOpener&) override {}
  nlohmann::json attach(int, const nlohmann::json&) override { return nlohmann::json::object(); }
  bool adopt(int, net::Socket) override { return true; }
  void submit(std::shared_ptr<TransferOp> op) override {
    for (const auto& lane : op->lanes)
      for (const auto& p : lane.pieces) saw_device |= on_device(p.local, p.length);
    ops.push_back(std::move(op));
  }
  void send(std::shared_ptr<MessageOp> op) override {
    saw_device |= on_device(op->ptr, op->length);
    sends.push_back(std::move(op));
  }
  Status post_write(PostWrite&& w, std::chrono::milliseconds) override {
    ++posts;
    return Status::Ok();
  }
  size_t pending() const override { return ops.size() + sends.size(); }
  std::chrono::steady_clock::time_point last_progress() const override { return std::chrono::steady_clock::now(); }
  void close(const Status&) override {}

  // Completes every op and send: lanes with `lane_status`.
  void run(const Status& lane_status = Status::Ok()) {
    for (auto& op : ops)
      for (auto& lane : op->lanes) {
        if (lane.pieces.empty()) continue;
        for (auto& p : lane.pieces) {
          if (op->kind == OpKind::kRead) std::memcpy(p.local, remote.data() + p.remote_offset, p.length);
          else std::memcpy(remote.data() + p.remote_offset, p.local, p.length);
        }
        op->future->part_done(lane_status);
      }
    ops.clear();
    for (auto& m : sends) {
      received.assign(m->ptr, m->ptr + m->length);
      m->future->complete(Status::Ok());
    }
    sends.clear();
  }

  std::vector<std::shared_ptr<TransferOp>> ops;
  std::vector<std::shared_ptr<MessageOp>> sends;
  bool saw_device = false;
  int posts = 0;
  std::vector<uint8_t> received;

 private:
  bool on_device(const uint8_t* p, uint64_t n) const {
    return p < device_->base + device_->length && p + n > device_->base;
  }
  const RegionEntry* device_;

 public:
  std::vector<uint8_t> remote;
};

class StagingEndpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dev_mem_.resize(kBytes);
    host_mem_.resize(kBytes);
    for (uint64_t i = 0; i < kBytes; ++i) {
      dev_mem_[i] = static_cast<uint8_t>(i * 7 + 1);
      host_mem_[i] = static_cast<uint8_t>(i * 13 + 5);
    }
    dev_ = entry(dev_mem_.data(), Location::cuda(0));
    host_ = entry(host_mem_.data(), Location::host());
    auto inner = std::make_shared<FakeInner>(dev_.get());
    auto stager = std::make_shared<FakeStager>(dev_.get());
    inner_ = inner.get();
    stager_ = stager.get();
    ep_ = std::make_unique<StagingEndpoint>(inner, stager);
    for (uint64_t i = 0; i < kBytes; ++i) inner_->remote[i] = static_cast<uint8_t>(i * 3 + 11);
  }
  static std::shared_ptr<RegionEntry> entry(uint8_t* base, Location loc) {
    auto e = std::make_shared<RegionEntry>();
    e->base = base;
    e->length = kBytes;
    e->location = loc;
    return e;
  }
  // An op with one lane per entry of `lanes`; each piece is {local, remote_offset, length}.
  struct P {
    uint8_t* local;
    uint64_t remote_offset;
    uint64_t length;
  };
  std::shared_ptr<TransferOp> op(OpKind kind, const std::vector<std::vector<P>>& lanes) {
    auto o = std::make_shared<TransferOp>();
    o->kind = kind;
    int parts = 0;
    for (const auto& l : lanes) {
      Lane lane;
      for (const auto& p : l) {
        lane.pieces.push_back(Piece{p.local, 1, p.remote_offset, 0, p.length});
        lane.bytes += p.length;
      }
      parts += l.empty() ? 0 : 1;
      o->lanes.push_back(std::move(lane));
    }
    o->future = std::make_shared<FutureState>(kind, parts);
    o->pins.push_back(RegionPin(dev_));
    o->pins.push_back(RegionPin(host_));
    return o;
  }

  std::vector<uint8_t> dev_mem_, host_mem_;
  std::shared_ptr<RegionEntry> dev_, host_;
  FakeInner* inner_ = nullptr;
  FakeStager* stager_ = nullptr;
  std::unique_ptr<StagingEndpoint> ep_;
};

TEST_F(StagingEndpointTest, WriteFromDeviceSendsStagedCopies) {
  uint8_t* d = dev_mem_.data();
  uint8_t* h = host_mem_.data();
  auto o = op(OpKind::kWrite, {{{d, 0, 100}}, {{h + 50, 200, 60}, {d + 300, 500, 1000}}});
  ep_->submit(o);
  ASSERT_EQ(1u, inner_->ops.size());
  EXPECT_NE(o, inner_->ops[0]) << "an op with device pieces went to the inner endpoint unstaged";
  EXPECT_FALSE(inner_->saw_device) << "the inner endpoint was given a device address";
  EXPECT_EQ(2, stager_->downloads);
  EXPECT_FALSE(o->future->done()) << "the caller's write completed before the inner one";
  inner_->run();
  ASSERT_TRUE(o->future->done());
  EXPECT_TRUE(o->future->status().ok()) << o->future->status().to_string();
  EXPECT_EQ(0, std::memcmp(inner_->remote.data(), d, 100));
  EXPECT_EQ(0, std::memcmp(inner_->remote.data() + 200, h + 50, 60));
  EXPECT_EQ(0, std::memcmp(inner_->remote.data() + 500, d + 300, 1000));
}

TEST_F(StagingEndpointTest, ReadIntoDeviceUploadsOnceTheInnerOpCompleted) {
  std::vector<uint8_t> before = dev_mem_;
  uint8_t* d = dev_mem_.data();
  uint8_t* h = host_mem_.data();
  auto o = op(OpKind::kRead, {{{d + 8, 100, 200}, {h, 0, 16}}, {{d + 1024, 2048, 512}}});
  ep_->submit(o);
  ASSERT_EQ(1u, inner_->ops.size());
  EXPECT_FALSE(inner_->saw_device);
  EXPECT_EQ(0, stager_->downloads) << "a read downloaded the bytes it is about to overwrite";
  inner_->run();
  ASSERT_TRUE(o->future->done());
  EXPECT_TRUE(o->future->status().ok()) << o->future->status().to_string();
  EXPECT_EQ(2, stager_->uploads);
  EXPECT_EQ(0, std::memcmp(d + 8, inner_->remote.data() + 100, 200));
  EXPECT_EQ(0, std::memcmp(h, inner_->remote.data(), 16));
  EXPECT_EQ(0, std::memcmp(d + 1024, inner_->remote.data() + 2048, 512));
  // Nothing else of the device region changed.
  for (uint64_t i = 0; i < kBytes; ++i)
    if ((i < 8 || i >= 208) && (i < 1024 || i >= 1536)) ASSERT_EQ(before[i], dev_mem_[i]) << "device byte " << i;
}

TEST_F(StagingEndpointTest, FailedReadUploadsNothing) {
  std::vector<uint8_t> before = dev_mem_;
  auto o = op(OpKind::kRead, {{{dev_mem_.data(), 0, 256}}});
  ep_->submit(o);
  inner_->run({ErrorCode::kRemoteError, "peer refused"});
  ASSERT_TRUE(o->future->done());
  EXPECT_EQ(ErrorCode::kRemoteError, o->future->status().code);
  EXPECT_EQ(0, stager_->uploads);
  EXPECT_EQ(before, dev_mem_);
}

TEST_F(StagingEndpointTest, StagerErrorsFailTheOpCleanly) {
  // Download fails: the op fails at once and nothing reaches the inner endpoint.
  stager_->fail_download = true;
  auto w = op(OpKind::kWriteImm, {{{dev_mem_.data(), 0, 64}}, {{host_mem_.data(), 64, 64}}});
  ep_->submit(w);
  ASSERT_TRUE(w->future->done());
  EXPECT_EQ(ErrorCode::kSystem, w->future->status().code) << w->future->status().to_string();
  EXPECT_TRUE(inner_->ops.empty()) << "a write whose staging failed was posted";
  stager_->fail_download = false;
  // Upload fails: the read fails once its inner op completed; the caller hears the error.
  stager_->fail_upload = true;
  auto r = op(OpKind::kRead, {{{dev_mem_.data(), 0, 64}}});
  ep_->submit(r);
  EXPECT_FALSE(r->future->done());
  inner_->run();
  ASSERT_TRUE(r->future->done());
  EXPECT_EQ(ErrorCode::kSystem, r->future->status().code);
}

TEST_F(StagingEndpointTest, SendFromDeviceIsStaged) {
  auto m = std::make_shared<MessageOp>();
  m->ptr = dev_mem_.data() + 10;
  m->length = 300;
  m->seq = 4;
  m->pin = RegionPin(dev_);
  m->future = std::make_shared<FutureState>(OpKind::kSend);
  ep_->send(m);
  ASSERT_EQ(1u, inner_->sends.size());
  EXPECT_EQ(4u, inner_->sends[0]->seq);
  EXPECT_FALSE(inner_->saw_device);
  EXPECT_FALSE(m->future->done());
  inner_->run();
  ASSERT_TRUE(m->future->done());
  EXPECT_TRUE(m->future->status().ok());
  EXPECT_EQ(std::vector<uint8_t>(dev_mem_.begin() + 10, dev_mem_.begin() + 310), inner_->received);
  // A download error fails the send without sending anything.
  stager_->fail_download = true;
  auto m2 = std::make_shared<MessageOp>();
  m2->ptr = dev_mem_.data();
  m2->length = 8;
  m2->seq = 5;
  m2->pin = RegionPin(dev_);
  m2->future = std::make_shared<FutureState>(OpKind::kSend);
  ep_->send(m2);
  ASSERT_TRUE(m2->future->done());
  EXPECT_EQ(ErrorCode::kSystem, m2->future->status().code);
  EXPECT_TRUE(inner_->sends.empty());
}

TEST_F(StagingEndpointTest, HostOnlyWorkIsForwardedUntouched) {
  auto o = std::make_shared<TransferOp>();
  o->kind = OpKind::kWrite;
  Lane lane;
  lane.pieces.push_back(Piece{host_mem_.data(), 1, 0, 0, 32});
  o->lanes.push_back(std::move(lane));
  o->future = std::make_shared<FutureState>(OpKind::kWrite, 1);
  o->pins.push_back(RegionPin(host_));
  ep_->submit(o);
  ASSERT_EQ(1u, inner_->ops.size());
  EXPECT_EQ(o, inner_->ops[0]);
  auto m = std::make_shared<MessageOp>();
  m->ptr = host_mem_.data();
  m->length = 4;
  m->pin = RegionPin(host_);
  m->future = std::make_shared<FutureState>(OpKind::kSend);
  ep_->send(m);
  ASSERT_EQ(1u, inner_->sends.size());
  EXPECT_EQ(m, inner_->sends[0]);
  EXPECT_EQ(0, stager_->downloads);
  // Posts: host memory goes through, a staged region is refused (posts have no completion to
  // release a staging buffer at).
  PostWrite hw;
  hw.pin = RegionPin(host_);
  EXPECT_TRUE(ep_->post_write(std::move(hw), std::chrono::milliseconds(10)).ok());
  PostWrite dw;
  dw.pin = RegionPin(dev_);
  EXPECT_EQ(ErrorCode::kUnsupported, ep_->post_write(std::move(dw), std::chrono::milliseconds(10)).code);
  EXPECT_EQ(1, inner_->posts);
  inner_->run();
}

}  // namespace
