#include "sluice/cuda.hpp"

#include "cuda/copy_kernels.hpp"
#include "cuda/cuda_util.hpp"

namespace sluice::cuda {
namespace {

namespace d = sluice::detail::cuda;

struct StreamScope {
  explicit StreamScope(void* s) { d::current_user_stream() = s; }
  ~StreamScope() { d::current_user_stream() = nullptr; }
};

void need_nvlink(Endpoint& ep, const char* what) {
  std::string why;
  if (d::device_count(&why) == 0) throw Error(ErrorCode::kNoDevice, std::string(what) + ": " + why);
  if (ep.transport() != "nvlink")
    throw Error(ErrorCode::kUnsupported, std::string(what) + ": the endpoint runs over " + ep.transport() +
                                             "; stream ordering needs nvlink");
}

}  // namespace

int device_count() { return d::device_count(); }
std::string unavailable_reason() {
  std::string why;
  d::device_count(&why);
  return why;
}
bool built_with_cuda() { return true; }

Future read_on_stream(Endpoint& ep, const Batch& batch, void* stream) {
  need_nvlink(ep, "read_on_stream");
  StreamScope s(stream);
  return ep.read(batch);
}
Future write_on_stream(Endpoint& ep, const Batch& batch, void* stream) {
  need_nvlink(ep, "write_on_stream");
  StreamScope s(stream);
  return ep.write(batch);
}
Future write_with_imm_on_stream(Endpoint& ep, const Batch& batch, uint32_t imm, void* stream) {
  need_nvlink(ep, "write_with_imm_on_stream");
  StreamScope s(stream);
  return ep.write_with_imm(batch, imm);
}

}  // namespace sluice::cuda
