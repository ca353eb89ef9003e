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
Future read_on_stream(Endpoint&, const Batch&, void*) { none("read_on_stream"); }
Future write_on_stream(Endpoint&, const Batch&, void*) { none("write_on_stream"); }
Future write_with_imm_on_stream(Endpoint&, const Batch&, uint32_t, void*) { none("write_with_imm_on_stream"); }
}  // namespace sluice::cuda
