// libFuzzer target: the frame parser (src/transport/common/frame.hpp, stream_channel.*) and
// the tcp transport's frame handlers, driven like a hostile peer drives them: the input is
// the byte stream a peer sends on an attached tcp data channel of a passive endpoint whose
// engine registered one 4 KiB region and has a read, a write, a send and a recv in flight. Besides sanitizer reports, leaks and hangs, a finding
// is any change to the guard bytes placed around the region: a peer must never make the
// engine write outside registered memory.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "bootstrap/messages.hpp"
#include "core/batch_plan.hpp"
#include "core/future_state.hpp"
#include "core/message_matcher.hpp"
#include "core/registry.hpp"
#include "feed.hpp"
#include "sluice/config.hpp"
#include "sluice/error.hpp"
#include "transport/common/frame.hpp"
#include "transport/transport.hpp"

using namespace sluice;
using namespace sluice::detail;

namespace {

constexpr size_t kGuard = 4096;
constexpr size_t kRegion = 4096;
constexpr uint8_t kGuardByte = 0xA5;
// How long the endpoint may take to finish a ~1 MiB input before the target calls it a hang
// (libFuzzer's own -timeout is the backstop).
constexpr auto kDrainDeadline = std::chrono::seconds(8);

// The matcher's constructor grows bounds as the engine gains them; build it from whichever
// form this tree has, with small bounds so that the fuzzer cannot make it hold much.
template <class M = MessageMatcher>
std::unique_ptr<M> make_matcher(const EngineConfig& c) {
  if constexpr (std::is_constructible_v<M, const EngineConfig&>)
    return std::make_unique<M>(c);
  else if constexpr (std::is_constructible_v<M, uint64_t, uint64_t>)
    return std::make_unique<M>(c.max_unexpected_bytes, c.max_unexpected_messages);
  else
    return std::make_unique<M>(c.max_unexpected_bytes);
}

struct World {
  EngineConfig config;
  Registry registry;
  std::vector<uint8_t> memory = std::vector<uint8_t>(kGuard + kRegion + kGuard, kGuardByte);
  uint64_t region_id = 0;
  std::unique_ptr<Transport> tcp;

  World() {
    config.max_unexpected_bytes = 1 << 20;
    config.max_unexpected_messages = 64;
    config.channels = 1;
    std::memset(memory.data() + kGuard, 0, kRegion);
    region_id = registry.add(memory.data() + kGuard, kRegion, Location::host(), "fuzz").id;
    EngineContext ctx;
    ctx.config = &config;
    ctx.registry = &registry;
    ctx.host_id = "fuzz-host";
    ctx.engine_id = "fuzz-engine";
    for (auto& f : transport_factories()) {
      if (f.name != "tcp") continue;
      std::string why;
      tcp = f.make(ctx, &why);
      if (!tcp) {
        std::fprintf(stderr, "fuzz_frames: the tcp transport did not start: %s\n", why.c_str());
        std::abort();
      }
    }
    if (!tcp) {
      std::fprintf(stderr, "fuzz_frames: no tcp transport registered\n");
      std::abort();
    }
  }

  void check_guards() const {
    for (size_t i = 0; i < memory.size(); ++i) {
      if (i >= kGuard && i < kGuard + kRegion) continue;
      if (memory[i] != kGuardByte) {
        std::fprintf(stderr, "fuzz_frames: byte %zd relative to the registered region was written\n",
                     static_cast<ssize_t>(i) - static_cast<ssize_t>(kGuard));
        std::abort();
      }
    }
  }
};

World& world() {
  static World* w = new World;  // lives for the whole run
  return *w;
}

class Events final : public EndpointEvents {
 public:
  explicit Events(World& w) : w_(w), matcher_(make_matcher(w.config)) {}
  const Registry& registry() const override { return w_.registry; }
  MessageMatcher& matcher() override { return *matcher_; }
  void on_failure(const Status&) override {
    std::lock_guard<std::mutex> lk(mu_);
    failed_ = true;
    cv_.notify_all();
  }
  bool wait_failed(std::chrono::steady_clock::duration d) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, d, [&] { return failed_; });
  }

 private:
  World& w_;
  std::unique_ptr<MessageMatcher> matcher_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool failed_ = false;
};

// Our own operations in flight before the peer's bytes arrive, so that its responses reach
// the response handlers, not only the unknown-operation refusals. Their tokens are
// deterministic (the first two slots of a fresh endpoint: 0x1'00000000 read, 0x1'00000001
// write; the send is message 0) and make_corpus.py answers them. Every local byte they name
// lies inside the registered region, so a response that overruns them hits the guards.
constexpr uint64_t kReadAt = 0, kWriteAt = 256, kSendAt = 512, kRecvAt = 1024;
constexpr uint64_t kOpBytes = 16, kRecvBytes = 32;

void submit_own_ops(TransportEndpoint& ep, World& w, Events& events) {
  uint8_t* region = w.memory.data() + kGuard;
  for (OpKind kind : {OpKind::kRead, OpKind::kWrite}) {
    auto op = std::make_shared<TransferOp>();
    op->kind = kind;
    Lane lane;
    Piece p;
    p.local = region + (kind == OpKind::kRead ? kReadAt : kWriteAt);
    p.remote_id = 1;
    p.length = kOpBytes;
    lane.pieces.push_back(p);
    lane.bytes = kOpBytes;
    op->lanes.push_back(std::move(lane));
    op->bytes = kOpBytes;
    op->pins.push_back(w.registry.pin_whole(w.region_id));
    op->future = std::make_shared<FutureState>(kind, 1);
    ep.submit(std::move(op));
  }
  auto send = std::make_shared<MessageOp>();
  send->ptr = region + kSendAt;
  send->length = kOpBytes;
  send->seq = 0;
  send->pin = w.registry.pin_whole(w.region_id);
  send->future = std::make_shared<FutureState>(OpKind::kSend);
  ep.send(std::move(send));
  auto recv = std::make_shared<MessageOp>();
  recv->ptr = region + kRecvAt;
  recv->length = kRecvBytes;
  recv->pin = w.registry.pin_whole(w.region_id);
  recv->future = std::make_shared<FutureState>(OpKind::kRecv);
  events.matcher().post_recv(std::move(recv));
}

// The input with every frame header's check recomputed (walking header, payload, header...).
// Random mutations almost never keep a 32-bit check right, so without this second pass the
// fuzzer would spend its time in the check's refusal instead of the handlers behind it.
std::vector<uint8_t> with_checks_fixed(const uint8_t* data, size_t size) {
  std::vector<uint8_t> v(data, data + size);
  size_t pos = 0;
  while (size - pos >= sizeof(FrameHeader)) {
    FrameHeader h;
    std::memcpy(&h, v.data() + pos, sizeof(h));
    h.check = frame_check(h);
    std::memcpy(v.data() + pos, &h, sizeof(h));
    pos += sizeof(h);
    if (h.length > size - pos) break;
    pos += h.length;
  }
  return v;
}

void run_one(const uint8_t* data, size_t size) {
  World& w = world();
  Events events(w);
  EndpointSetup setup;
  setup.active = false;
  setup.token = 1;
  setup.channels = 1;
  setup.events = &events;
  setup.config = w.config;
  std::shared_ptr<TransportEndpoint> ep = w.tcp->create_endpoint(setup);

  fuzz::FakePeer peer;
  try {
    // The engine answers the channel's bootstrap message between the two steps; the fake
    // peer has nothing to read, so the socket is adopted at once.
    (void)ep->attach(0, nlohmann::json::object());
    ep->adopt(0, net::Socket(peer.release_local()));
  } catch (const Error& e) {
    std::fprintf(stderr, "fuzz_frames: attach failed: %s\n", e.what());
    std::abort();
  }
  submit_own_ops(*ep, w, events);
  peer.play(data, size);
  // The channel reports its end (EOF or a refused frame) through on_failure.
  if (!events.wait_failed(kDrainDeadline)) {
    std::fprintf(stderr, "fuzz_frames: the channel did not finish a %zu-byte input within %lld s\n", size,
                 static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(kDrainDeadline).count()));
    std::abort();
  }
  ep->close({ErrorCode::kCancelled, "fuzz input done"});
  ep.reset();  // closes the socket, so the peer's drain ends
  peer.finish();
  w.check_guards();
  // Posted recvs and imm waiters of this input die with its matcher; nothing carries over.
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  run_one(data, size);  // as sent: the header checks themselves are under test
  std::vector<uint8_t> fixed = with_checks_fixed(data, size);
  if (size >= sizeof(FrameHeader) && std::memcmp(fixed.data(), data, size) != 0) run_one(fixed.data(), fixed.size());
  return 0;
}
