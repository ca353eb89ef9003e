// Per-op options and transport capabilities over tcp and shm (no GPU needed): an op whose
// options the transport cannot honour is refused at submit, before it pins, numbers or moves
// anything, and the refusal comes from the transport's declared capabilities, not from a CUDA
// driver or a device (a CPU-only build refuses a stream exactly as a GPU build does).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "loopback.hpp"
#include "sluice/cuda.hpp"

namespace sluice_test {
namespace {

using sluice::ErrorCode;
using sluice::OpOptions;

class OpOptionsTest : public LoopbackTest {
 protected:
  // Any non-null handle: the op must be refused before a stream is ever used.
  static OpOptions with_stream() {
    OpOptions o;
    o.cuda_stream = reinterpret_cast<void*>(uintptr_t{0x5a5a5a50});
    return o;
  }
  // The code and text an op throws; fails the test if it does not throw.
  template <typename F>
  std::string refused(ErrorCode want, F&& op) {
    std::string msg;
    EXPECT_EQ(code_of(op, &msg), want) << msg;
    return msg;
  }
};

TEST_P(OpOptionsTest, HostTransportsDeclareTheirCapabilities) {
  const sluice::Capabilities c = ep_.capabilities();
  EXPECT_TRUE(c.host_memory);
  // cuda memory is staged through pinned host buffers, which needs a usable GPU.
  EXPECT_EQ(c.cuda_memory, sluice::cuda::device_count() > 0);
  EXPECT_FALSE(c.stream_ordered);
  EXPECT_FALSE(c.stream_ordered_messages);
  EXPECT_TRUE(c.imm);
  // The thin post path (Conformance/Post checks rma_post): a host transport's includes signals.
  EXPECT_EQ(c.signal, c.rma_post);
  // Both ends run the same transport, so they report the same.
  EXPECT_EQ(peer_.capabilities(), c);
  EXPECT_THROW(sluice::Endpoint().capabilities(), sluice::Error);
}

TEST_P(OpOptionsTest, StreamOnOneSidedOpIsUnsupportedAtOnce) {
  const std::vector<uint8_t> before = lb_;
  const sluice::Batch batch{{ha_, 0, rb_, 0, 4096}};
  for (auto [what, op] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"read", [&] { ep_.read(batch, with_stream()); }},
           {"write", [&] { ep_.write(batch, with_stream()); }},
           {"write_with_imm", [&] { ep_.write_with_imm(batch, 7, with_stream()); }},
       }) {
    std::string msg = refused(ErrorCode::kUnsupported, op);
    // Names the op, the transport and the capability that is missing.
    EXPECT_NE(msg.find(what + ": transport " + GetParam()), std::string::npos) << msg;
    EXPECT_NE(msg.find("stream_ordered capability"), std::string::npos) << msg;
  }
  // Nothing moved, no imm was delivered, and the endpoint stays usable.
  EXPECT_EQ(lb_, before);
  auto imm = peer_.imm_recv();
  EXPECT_FALSE(imm.wait_for(std::chrono::milliseconds(50)));
  ASSERT_TRUE(ep_.write_with_imm(batch, 8, OpOptions{}).wait().ok());
  ASSERT_TRUE(imm.wait_for(std::chrono::seconds(10)));
  EXPECT_EQ(imm.imm(), 8u);  // the first imm the peer sees is the admitted op's
  EXPECT_EQ(0, std::memcmp(lb_.data(), la_.data(), 4096));
  EXPECT_TRUE(ep_.connected());
}

TEST_P(OpOptionsTest, StreamOnMessageIsUnsupportedAndTakesNoSequenceNumber) {
  std::string msg = refused(ErrorCode::kUnsupported, [&] { ep_.send(ha_, 0, 64, with_stream()); });
  EXPECT_NE(msg.find("send: transport " + GetParam()), std::string::npos) << msg;
  EXPECT_NE(msg.find("stream_ordered_messages capability"), std::string::npos) << msg;
  msg = refused(ErrorCode::kUnsupported, [&] { peer_.recv(hb_, 0, 64, with_stream()); });
  EXPECT_NE(msg.find("recv: transport " + GetParam()), std::string::npos) << msg;
  // The refused send and recv took no slot: the next pair still matches (k-th send to k-th
  // recv), so the receiver gets exactly the 100 bytes the admitted send carried.
  auto r = peer_.recv(hb_, 0, 4096);
  ASSERT_TRUE(ep_.send(ha_, 100, 100).wait().ok());
  ASSERT_TRUE(r.wait_for(std::chrono::seconds(10)));
  ASSERT_TRUE(r.status().ok()) << r.status().to_string();
  EXPECT_EQ(r.bytes(), 100u);
  EXPECT_EQ(0, std::memcmp(lb_.data(), la_.data() + 100, 100));
}

TEST_P(OpOptionsTest, UnknownFlagsAreInvalidArgument) {
  OpOptions o;
  o.flags = 1u << 31;
  const sluice::Batch batch{{ha_, 0, rb_, 0, 64}};
  std::string msg = refused(ErrorCode::kInvalidArgument, [&] { ep_.write(batch, o); });
  EXPECT_NE(msg.find("write: unknown op flags"), std::string::npos) << msg;
  refused(ErrorCode::kInvalidArgument, [&] { ep_.read(batch, o); });
  refused(ErrorCode::kInvalidArgument, [&] { ep_.send(ha_, 0, 64, o); });
  refused(ErrorCode::kInvalidArgument, [&] { ep_.recv(ha_, 0, 64, o); });
  // Default options are the old behaviour.
  EXPECT_TRUE(ep_.write(batch, OpOptions{}).wait().ok());
}

// The stream-ordered shorthands of sluice/cuda.hpp: without a device they report kNoDevice
// (CPU build or no GPU); with one, the endpoint refuses them on a host transport.
TEST_P(OpOptionsTest, OnStreamShorthandsFollowTheCapability) {
  const sluice::Batch batch{{ha_, 0, rb_, 0, 64}};
  const ErrorCode want = sluice::cuda::device_count() > 0 ? ErrorCode::kUnsupported : ErrorCode::kNoDevice;
  refused(want, [&] { sluice::cuda::write_on_stream(ep_, batch, nullptr); });
  refused(want, [&] { sluice::cuda::read_on_stream(ep_, batch, nullptr); });
  refused(want, [&] { sluice::cuda::write_with_imm_on_stream(ep_, batch, 1, nullptr); });
}

INSTANTIATE_TEST_SUITE_P(Transports, OpOptionsTest, ::testing::Values("tcp", "shm"), transport_name);

}  // namespace
}  // namespace sluice_test
