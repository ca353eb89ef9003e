// Prints the worked examples of docs/wire-protocol.md ("Header checks"), computed by the
// engine's own code: bootstrap headers come from bootstrap::send_msg over a socket pair, frame
// headers from make_frame. python/tests/test_wire_doc.py recomputes every example from the
// algorithm as the document states it, so document and code cannot drift apart silently.
//   clang++ -std=c++20 -Iinclude -Isrc -Ithird_party/nlohmann_json/include \
//     tests/fuzz/wire_vectors.cpp src/bootstrap/*.cpp src/core/error.cpp src/core/log.cpp -o /tmp/wv
// (tests/fuzz/run.sh builds it as part of the fuzz project.)
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "transport/common/frame.hpp"

using namespace sluice;

namespace {

std::string hex(const void* p, size_t n) {
  std::string s;
  char b[4];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof(b), "%02x", static_cast<const uint8_t*>(p)[i]);
    s += b;
  }
  return s;
}

// The 16 header bytes send_msg puts in front of `body`.
void bootstrap_vector(bootstrap::MsgKind kind, const nlohmann::json& body, const char* what) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return;
  // Large bodies do not fit the socket buffer: send from a thread while this one reads.
  std::thread sender([&] {
    bootstrap::send_msg(fds[0], kind, body);
    ::shutdown(fds[0], SHUT_WR);
  });
  uint8_t h[16];
  bool got = net::read_full(fds[1], h, sizeof(h));
  char sink[65536];
  while (::read(fds[1], sink, sizeof(sink)) > 0) {
  }
  sender.join();
  if (!got) return;
  uint32_t check;
  std::memcpy(&check, h + 12, 4);
  std::printf("| %s | `%s` | `0x%08x` |\n", what, hex(h, 16).c_str(), check);
  ::close(fds[0]);
  ::close(fds[1]);
}

void frame_vector(const detail::FrameHeader& h, const char* what) {
  std::printf("| %s | `%s` | `0x%08x` |\n", what, hex(&h, 52).c_str(), h.check);
}

}  // namespace

int main() {
  using bootstrap::MsgKind;
  std::printf("bootstrap (header bytes 0-15, check = bytes 12-15):\n");
  bootstrap_vector(MsgKind::kInfo, nlohmann::json::object(), "INFO, body `{}` (2 bytes)");
  bootstrap_vector(MsgKind::kReply, {{"x", std::string(292, 'a')}}, "REPLY, 300-byte body");
  bootstrap_vector(MsgKind::kError, {{"x", std::string(69992, 'a')}}, "ERROR, 70000-byte body");
  bootstrap_vector(MsgKind::kChannel, {{"x", std::string(16777208, 'a')}}, "CHANNEL, length 0x01000000 (16 MiB)");

  using detail::FrameType;
  using detail::make_frame;
  std::printf("\nframes (header bytes 0-51, check = bytes 52-55):\n");
  frame_vector(make_frame(FrameType::kWrite, 7, 1, 4096, 100, detail::kLaneEnd), "WRITE op 7, region 1, offset 4096, 100 bytes, LANE_END");
  frame_vector(make_frame(FrameType::kReadReq, 0x0123456789abcdefull, 2, 0, 0, detail::kLaneEnd, 0x10000, 1),
               "READ_REQ op 0x0123456789abcdef, region 2, length 0x1_0001_0000 (imm 0x10000, aux 1)");
  frame_vector(make_frame(FrameType::kNack, 7, 0, 0, 11, detail::kLaneEnd, 0, 0, 3), "NACK op 7, status 3, 11-byte reason");
  frame_vector(make_frame(FrameType::kSend, 42, 0, 0, 5), "SEND sequence 42, 5 bytes");
  frame_vector(make_frame(FrameType::kWrite, 9, 3, 0, 8, detail::kLaneEnd | detail::kImmPart, 0xdeadbeef, 2),
               "WRITE with imm 0xdeadbeef, 2 lanes, LANE_END + IMM_PART");
  return 0;
}
