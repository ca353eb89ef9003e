#include "sluice/cuda.hpp"

#include <cuda_runtime_api.h>

#include "cuda/cuda_util.hpp"

namespace sluice::cuda {
namespace {

namespace d = sluice::detail::cuda;

// The *_on_stream calls are the stream-ordered ops of Endpoint with the stream as an option;
// the endpoint checks the transport's stream_ordered capability. A missing device is
// reported first (kNoDevice), as it always was.
OpOptions on_stream(void* stream, const char* what) {
  std::string why;
  if (d::device_count(&why) == 0) throw Error(ErrorCode::kNoDevice, std::string(what) + ": " + why);
  // These calls always order on a stream, and in CUDA the handle 0 names the legacy default
  // stream; in OpOptions nullptr means "no stream", so 0 is passed as cudaStreamLegacy.
  OpOptions o;
  o.cuda_stream = stream ? stream : static_cast<void*>(cudaStreamLegacy);
  return o;
}

}  // namespace

int device_count() { return d::device_count(); }
std::string unavailable_reason() {
  std::string why;
  d::device_count(&why);
  return why;
}
bool built_with_cuda() { return true; }

bool stream_capturing(void* stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return false;
  }
  return st == cudaStreamCaptureStatusActive;
}

bool allocation_of(const void* ptr, Allocation* out) {
  const int dev = d::pointer_device(ptr);
  if (dev < 0) return false;
  const d::Driver& drv = d::driver();
  if (!drv.memGetAddressRange || !drv.pointerGetAttribute) return false;
  // The driver calls need a current context on the pointer's device (any thread may ask).
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = dev;
  if (prev != dev && cudaSetDevice(dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  unsigned long long id = 0;
  const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(ptr);
  const bool ok = drv.memGetAddressRange(&base, &size, p) == CUDA_SUCCESS &&
                  drv.pointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, p) == CUDA_SUCCESS;
  if (prev != dev) cudaSetDevice(prev);
  if (!ok) return false;
  *out = {reinterpret_cast<void*>(base), static_cast<uint64_t>(size), dev, static_cast<uint64_t>(id)};
  return true;
}

Future read_on_stream(Endpoint& ep, const Batch& batch, void* stream) {
  return ep.read(batch, on_stream(stream, "read_on_stream"));
}
Future write_on_stream(Endpoint& ep, const Batch& batch, void* stream) {
  return ep.write(batch, on_stream(stream, "write_on_stream"));
}
Future write_with_imm_on_stream(Endpoint& ep, const Batch& batch, uint32_t imm, void* stream) {
  return ep.write_with_imm(batch, imm, on_stream(stream, "write_with_imm_on_stream"));
}

}  // namespace sluice::cuda
