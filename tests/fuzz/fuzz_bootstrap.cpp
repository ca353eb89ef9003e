// libFuzzer target: the bootstrap parser (src/bootstrap/messages.*) and the engine-info parser
// (src/core/engine_info.*), i.e. everything a peer's first bytes on the listener reach before
// the engine looks at individual fields. Any exception other than sluice::Error, any
// sanitizer report, leak or hang is a finding.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bootstrap/messages.hpp"
#include "core/engine_info.hpp"
#include "feed.hpp"
#include "sluice/error.hpp"

namespace {

void parse_info(const nlohmann::json& body) {
  if (!body.is_object() || !body.contains("info")) return;
  try {
    (void)sluice::detail::EngineInfo::from_json(body["info"]);
  } catch (const sluice::Error&) {
  }
}

// One message through recv_msg (what the listener does with a new connection).
void through_recv_msg(const uint8_t* data, size_t size) {
  fuzz::FakePeer peer;
  peer.play(data, size);
  try {
    auto [kind, body] = sluice::bootstrap::recv_msg(peer.local());
    (void)kind;
    parse_info(body);
  } catch (const sluice::Error&) {
  }
  ::shutdown(peer.local(), SHUT_RDWR);
}

// The same bytes as the answer to a request (what connect() does with a reply or an ERROR).
void through_expect_reply(const uint8_t* data, size_t size) {
  fuzz::FakePeer peer;
  peer.play(data, size);
  try {
    parse_info(sluice::bootstrap::expect_reply(peer.local(), "fuzz"));
  } catch (const sluice::Error&) {
  }
  ::shutdown(peer.local(), SHUT_RDWR);
}

// The bootstrap header check as docs/wire-protocol.md defines it (the engine's own is private
// to messages.cpp; test_wire_doc.py and run.sh keep the two equal).
uint32_t bootstrap_check(const uint8_t* h) {
  uint32_t magic, length;
  uint16_t version, kind;
  std::memcpy(&magic, h, 4);
  std::memcpy(&version, h + 4, 2);
  std::memcpy(&kind, h + 6, 2);
  std::memcpy(&length, h + 8, 4);
  uint64_t x = (uint64_t(magic) << 32) ^ (uint64_t(version) << 16) ^ kind ^ (uint64_t(length) << 24);
  x *= 0x9e3779b97f4a7c15ull;
  return static_cast<uint32_t>(x >> 32);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  through_recv_msg(data, size);
  through_expect_reply(data, size);
  // Again with the header check made right: random mutations almost never keep it, and the
  // body parsers behind it are the point.
  if (size >= 16) {
    std::vector<uint8_t> fixed(data, data + size);
    uint32_t check = bootstrap_check(fixed.data());
    std::memcpy(fixed.data() + 12, &check, 4);
    if (std::memcmp(fixed.data(), data, size) != 0) {
      through_recv_msg(fixed.data(), size);
      through_expect_reply(fixed.data(), size);
    }
  }
  // The raw bytes as an info blob (what connect(blob) parses), and the bytes after a
  // message header, so that the corpus's message bodies reach parse() as well.
  const char* text = reinterpret_cast<const char*>(data);
  for (size_t skip : {size_t(0), size_t(16)}) {
    if (skip > size) break;
    try {
      (void)sluice::detail::EngineInfo::parse(std::string(text + skip, size - skip));
    } catch (const sluice::Error&) {
    }
  }
  return 0;
}
