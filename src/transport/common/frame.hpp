// The frame that stream transports (tcp data channels, shm control channel) exchange:
// a fixed 56-byte header with a checksum, followed by `length` payload bytes.
// Documented in docs/wire-protocol.md.
#pragma once

#include <cstdint>
#include <cstring>

namespace sluice::detail {

enum class FrameType : uint8_t {
  kWrite = 1,     // payload -> peer region (region, offset, length)
  kReadReq = 2,   // ask peer for (region, offset, length)
  kReadResp = 3,  // payload = the bytes asked for, in request order per channel
  kAck = 4,       // a write lane completed (op_id)
  kNack = 5,      // a request failed: status = ErrorCode, payload = message
  kSend = 6,      // two-sided message: op_id = sequence, payload = data (tcp; shm: eager)
  kSendAck = 7,   // op_id = sequence, status, payload = message
  kImm = 8,       // standalone imm (shm): imm
  kSendRts = 9,   // same-host rendezvous: op_id = sequence, region = sender address,
                  // length (imm low, aux high); shm: payload = RtsSource (the sender's region)
  kError = 10,    // fatal: the sender is closing the channel; payload = message
  kPullWrite = 11,  // shm: "copy these bytes of mine into your region": payload = PullPiece[]
  kSignal = 12,     // post_signal: add (imm low, aux high) to the u64 at (region, offset); no
                    // payload; kLaneEnd; answered with ACK/NACK like a write lane end
  kCredit = 13,     // shm: the sender may queue op_id more bytes of eager SENDs (kSend frames);
                    // region, when not 0: the largest eager message the receiver takes;
                    // offset: the eager ring position before which every message was copied out
  kSendRing = 14,   // shm: an eager SEND whose bytes the sender put in the receiver's eager
                    // ring: op_id = sequence, region = length, offset = ring position; no payload
  kRingBell = 15,   // shm: descriptors wait in the receiver's eager ring queue; no payload
  kSendPull = 16,   // tcp: "send me bytes of your message in flight": op_id = my read's token,
                    // region = the message's sequence, offset = byte offset in it, length
                    // (imm low, aux high); answered like READ_REQ (READ_RESP or NACK, in order)
  kSendPut = 17,    // shm: the sender copied message op_id (imm low, aux high bytes) into the
                    // recv the receiver offered for it (shm_offer.cpp); status, payload = message
  kMax = 17,
};

enum FrameFlags : uint8_t {
  kLaneEnd = 1,  // last frame of this batch on this channel: respond with ACK/NACK
  kImmPart = 2,  // with kLaneEnd on writes: one of `aux` lanes of a write_with_imm
  kPullRest = 4,  // on a tcp SEND: the message is (imm low, aux high) bytes, of which the first
                  // `length` follow; the receiver asks for the rest with SEND_PULL frames
};

struct FrameHeader {
  uint32_t magic;
  uint8_t type;
  uint8_t flags;
  uint16_t status;
  uint32_t imm;
  uint32_t aux;
  uint64_t op_id;
  uint64_t region;
  uint64_t offset;
  uint64_t length;
  uint32_t reserved;
  uint32_t check;
};
static_assert(sizeof(FrameHeader) == 56, "frame header must be 56 bytes");

constexpr uint32_t kFrameMagic = 0x46434c53;  // "SLCF"
constexpr uint64_t kMaxFramePayload = 1ull << 31;
constexpr uint64_t kMaxMessageText = 4096;

inline uint32_t frame_check(const FrameHeader& h) {
  uint64_t w[6];
  std::memcpy(w, &h, 48);
  uint64_t x = 0x243f6a8885a308d3ull ^ h.reserved;
  for (uint64_t v : w) {
    x ^= v;
    x *= 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
  }
  return static_cast<uint32_t>(x ^ (x >> 32));
}

inline FrameHeader make_frame(FrameType type, uint64_t op_id = 0, uint64_t region = 0, uint64_t offset = 0,
                              uint64_t length = 0, uint8_t flags = 0, uint32_t imm = 0, uint32_t aux = 0,
                              uint16_t status = 0) {
  FrameHeader h{kFrameMagic, static_cast<uint8_t>(type), flags, status, imm, aux, op_id, region, offset, length, 0, 0};
  h.check = frame_check(h);
  return h;
}

// Empty string if the header is well formed, else what is wrong with it.
inline const char* frame_problem(const FrameHeader& h) {
  if (h.magic != kFrameMagic) return "bad frame magic";
  if (h.check != frame_check(h)) return "frame header checksum mismatch";
  if (h.type == 0 || h.type > static_cast<uint8_t>(FrameType::kMax)) return "unknown frame type";
  if (h.length > kMaxFramePayload) return "frame payload too large";
  return "";
}

}  // namespace sluice::detail
