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
uint64_t AllGather::max_bytes() const { return 0; }
uint64_t AllGather::ll_max_bytes() const { return 0; }
int AllGather::world_size() const { return 0; }
int AllGather::rank() const { return 0; }
}  // namespace sluice::cuda

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
