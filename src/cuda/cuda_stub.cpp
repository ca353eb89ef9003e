// sluice/cuda.hpp on a build without nvcc: no devices, every GPU call reports kNoDevice.
#include "sluice/cuda.hpp"

namespace sluice::cuda {
namespace {
[[noreturn]] void none(const char* what) {
  throw Error(ErrorCode::kNoDevice, std::string(what) + ": libsluice was built without CUDA");
}
}  // namespace
int device_count() { return 0; }
std::string unavailable_reason() { return "libsluice was built without CUDA"; }
bool built_with_cuda() { return false; }
bool stream_capturing(void*) { return false; }
bool allocation_of(const void*, Allocation*) { return false; }
Future read_on_stream(Endpoint&, const Batch&, void*) { none("read_on_stream"); }
Future write_on_stream(Endpoint&, const Batch&, void*) { none("write_on_stream"); }
Future write_with_imm_on_stream(Endpoint&, const Batch&, uint32_t, void*) { none("write_with_imm_on_stream"); }
}  // namespace sluice::cuda

// The AllGather without CUDA: constructing one reports kNoDevice.
#include "sluice/allgather.hpp"

namespace sluice::cuda {
struct AllGather::Impl {};
size_t dtype_size(DType t) {
  switch (t) {
    case DType::kUInt8:
    case DType::kInt8: return 1;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    default: return 8;
  }
}
AllGather::AllGather(uint64_t, uint64_t, DType, int, int, int) {
  throw Error(ErrorCode::kNoDevice, "AllGather: libsluice was built without CUDA");
}
AllGather::~AllGather() = default;
std::string AllGather::handle() const { return {}; }
void AllGather::connect(const std::vector<std::string>&) {}
void AllGather::bootstrap(const std::string&, std::chrono::milliseconds) {}
void AllGather::all_gather(const void*, void*, uint64_t, void*) {}
void AllGather::all_gather_bytes(const void*, void*, uint64_t, void*) {}
void AllGather::set_timeout(std::chrono::milliseconds) {}
bool AllGather::timed_out() const { return false; }
uint64_t AllGather::max_bytes() const { return 0; }
uint64_t AllGather::ll_max_bytes() const { return 0; }
int AllGather::world_size() const { return 0; }
int AllGather::rank() const { return 0; }
}  // namespace sluice::cuda

// Stream-ordered send/recv without CUDA: constructing one reports kNoDevice.
#include "sluice/stream_p2p.hpp"

namespace sluice::cuda {
struct StreamP2p::Impl {};
StreamP2p::StreamP2p(int, const std::vector<int>&, int, StreamP2pOptions) {
  throw Error(ErrorCode::kNoDevice, "StreamP2p: libsluice was built without CUDA");
}
StreamP2p::~StreamP2p() = default;
std::string StreamP2p::handle() const { return {}; }
void StreamP2p::connect(int, const std::string&) {}
bool StreamP2p::connected(int) const { return false; }
void StreamP2p::send(int, const void*, uint64_t, void*, uint32_t) {}
void StreamP2p::recv(int, void*, uint64_t, void*, uint32_t) {}
void StreamP2p::set_timeout(std::chrono::milliseconds) {}
void StreamP2p::abort() {}
void StreamP2p::quiesce() {}
Status StreamP2p::status() const { return {ErrorCode::kNoDevice, "libsluice was built without CUDA"}; }
uint64_t StreamP2p::region_bytes() const { return 0; }
int StreamP2p::rank() const { return 0; }
}  // namespace sluice::cuda

// The hierarchical AllGather without CUDA: constructing one reports kNoDevice; the C entry
// points exist so that the ctypes wrapper gets that message instead of a missing symbol.
#include <cstring>

#include "sluice/hier_allgather.hpp"

namespace sluice::cuda {
struct HierAllGather::Impl {};
HierAllGather::HierAllGather(uint64_t, int, int, int, const std::vector<int>&, HierAllGatherOptions) {
  throw Error(ErrorCode::kNoDevice, "HierAllGather: libsluice was built without CUDA");
}
HierAllGather::~HierAllGather() = default;
std::string HierAllGather::handle() const { return {}; }
void HierAllGather::connect(const std::vector<std::string>&) {}
void HierAllGather::all_gather_bytes(const void*, void*, uint64_t, void*) {}
Status HierAllGather::status() const { return {ErrorCode::kNoDevice, "libsluice was built without CUDA"}; }
void HierAllGather::check() const { throw Error(status()); }
uint64_t HierAllGather::max_bytes() const { return 0; }
int HierAllGather::world_size() const { return 0; }
int HierAllGather::rank() const { return 0; }
int HierAllGather::nodes() const { return 0; }
int HierAllGather::ranks_per_node() const { return 0; }
std::string HierAllGather::transport() const { return {}; }
}  // namespace sluice::cuda

extern "C" {
SLUICE_API void* sluice_hag_create(uint64_t, int, int, int, const int*, const char*, int64_t, char* err, int errlen) {
  if (err && errlen > 0) {
    std::strncpy(err, "HierAllGather: libsluice was built without CUDA", errlen - 1);
    err[errlen - 1] = 0;
  }
  return nullptr;
}
}  // extern "C"

// Staging without CUDA: nothing can be staged.
#include "cuda/staging.hpp"

namespace sluice::detail::staging {
namespace {
[[noreturn]] void no_cuda() { throw Error(ErrorCode::kUnsupported, "cuda memory needs the CUDA build of libsluice"); }
}  // namespace
bool available() { return false; }
bool is_device_ptr(const void*) { return false; }
std::shared_ptr<uint8_t> pinned(uint64_t) { no_cuda(); }
void download(void*, const void*, uint64_t) { no_cuda(); }
void upload(void*, const void*, uint64_t) { no_cuda(); }
std::shared_ptr<uint8_t> download_copy(const void*, uint64_t) { no_cuda(); }
bool receive(void*, uint64_t, const std::function<bool(void*, uint64_t)>&) { no_cuda(); }
}  // namespace sluice::detail::staging
