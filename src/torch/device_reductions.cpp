// all_reduce of small CUDA tensors through the low-latency AllGather on the caller's stream, and
// all_reduce and reduce_scatter_tensor of CUDA tensors by the device path: every message goes
// GPU to GPU over the device endpoints by rendezvous (as exchange_device's do), and the
// reduction runs on the GPU, with ATen ops on a pool stream of the worker thread.
//
// The messages are exactly the host algorithms' (collectives.cpp: the same chunks, peers, tags
// and order), so a rank that stages a call still meets peers that do not; and the reduction is
// the same rank-ordered one (reduce_ops.hpp), so both paths give every rank the same bits.
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "backend.hpp"
#include "core/log.hpp"
#include "ll_allgather.hpp"
#include "reduce_ops.hpp"

namespace sluice::torch_backend {

namespace {

using Xfer = SluiceBackend::Xfer;

const c10::impl::DeviceGuardImplInterface* cuda_impl() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

// `count` parts of `bytes` each, typed like `like`, in one new CUDA byte buffer (64-byte
// aligned each; a fresh tensor per call comes from torch's caching allocator, whose segment
// stays registered across calls: cuda_registrations.hpp).
struct Parts {
  at::Tensor buf;
  uint64_t stride = 0;
  Parts(const at::Tensor& like, uint64_t bytes, int count) : stride((bytes + 63) / 64 * 64) {
    buf = at::empty({int64_t(std::max<uint64_t>(stride * count, 64))}, like.options().dtype(at::kByte));
  }
  at::Tensor part(int k, const at::Tensor& like, int64_t numel) const {
    return buf.narrow(0, int64_t(stride * k), int64_t(numel * like.element_size())).view(like.scalar_type());
  }
};

// Runs `reduce` on a pool stream of `dev` and waits for it: peers read what it wrote (or the
// Work completes) only after.
template <class F>
void reduce_on_gpu(c10::Device dev, F&& reduce) {
  const c10::Stream s = cuda_impl()->getStreamFromGlobalPool(dev, /*isHighPriority=*/false);
  {
    c10::StreamGuard guard(s);
    reduce();
  }
  cuda_impl()->synchronizeStream(s);
}

Xfer dev_xfer(bool is_send, int peer, const at::Tensor& base, const CudaRegistrations::Lease& lease, uint64_t offset,
              uint64_t bytes) {
  return Xfer{is_send, peer, static_cast<uint8_t*>(base.data_ptr()) + offset, bytes, true, lease.handle,
              lease.offset + offset};
}

}  // namespace

std::optional<SluiceBackend::HeldLeases> SluiceBackend::device_leases(const at::Tensor& a, const at::Tensor& b) {
  std::string why;
  auto la = cuda_regs_->acquire(a.data_ptr(), a.nbytes(), &why);
  std::optional<CudaRegistrations::Lease> lb;
  if (la) lb = cuda_regs_->acquire(b.data_ptr(), b.nbytes(), &why);
  if (!lb) {
    if (la) cuda_regs_->release(la->key);
    SLUICE_LOG(kInfo, "sluice torch: a CUDA collective goes through host memory: " << why);
    return std::nullopt;
  }
  CudaRegistrations* regs = cuda_regs_.get();
  auto hold = std::shared_ptr<void>(nullptr, [regs, ka = la->key, kb = lb->key](void*) {
    regs->release(ka);
    regs->release(kb);
  });
  return HeldLeases{*la, *lb, std::move(hold)};
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::allreduce_ll(const at::Tensor& t, Red op) {
  // What decides is shared by every rank: the group's agreement (ll_allgather.hpp), CUDA
  // tensors and the byte count (the collective's contract).
  if (!ll_ || !ll_->on() || !t.is_cuda() || t.layout() != at::kStrided || t.nbytes() > ll_->max_bytes()) return {};
  c10::DeviceGuard guard(t.device());
  const LlStream ls = ll_stream(t.device());
  if (t.numel() == 0) return ll_finish(c10d::OpType::ALLREDUCE, {t}, ls, /*launched=*/false);
  if (!ll_ready(t.device(), c10d::OpType::ALLREDUCE)) return {};  // every rank falls back at this call
  ll_allreduce_calls_.fetch_add(1, std::memory_order_relaxed);
  // Every rank's tensor into `all` (world x numel, rank-major), then each rank reduces all of
  // them in rank order, as the host's direct algorithm does: the same bits on every rank. All
  // on the caller's stream, so it is ordered like NCCL's and can be captured in a graph.
  const int64_t n = t.numel();
  at::Tensor flat = (t.is_contiguous() ? t : t.contiguous()).view(-1);  // a copy on the stream if strided
  at::Tensor all = at::empty({n * size()}, t.options());
  ll_->launch(flat.data_ptr(), all.data_ptr(), t.nbytes(), ls.stream, ls.capturing);
  std::vector<at::Tensor> parts(size());
  for (int j = 0; j < size(); ++j) parts[j] = j == rank() ? flat : all.narrow(0, n * j, n);
  reduce_in_order(flat, parts, op, size(), rank());
  if (flat.data_ptr() != t.data_ptr() || !t.is_contiguous()) t.copy_(flat.view(t.sizes()));
  return ll_finish(c10d::OpType::ALLREDUCE, {t}, ls);
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::allreduce_device(const at::Tensor& t, Red op) {
  const int n = size(), r = rank();
  if (!device_collectives_ || !cuda_regs_ || n == 1 || !t.is_cuda() || t.layout() != at::kStrided ||
      !t.is_contiguous())
    return {};
  const int64_t numel = t.numel();
  // The host's direct algorithm for small tensors (every contribution to every rank) has
  // messages below the rendezvous size anyway: those calls stage.
  if (t.nbytes() <= kDirectAllreduceBytes || numel < n) return {};
  const uint64_t es = t.element_size();
  const Chunk mine = allreduce_chunk(numel, n, r);
  std::vector<DevMsg> msgs;
  for (int j = 0; j < n; ++j)
    if (j != r) {
      msgs.push_back({j, 0, uint64_t(allreduce_chunk(numel, n, j).count) * es});
      msgs.push_back({j, 0, uint64_t(mine.count) * es});
    }
  if (!device_messages(msgs) || !moves_bytes(msgs)) return {};

  Parts parts(t, mine.count * es, n - 1);  // the peers' contributions to this rank's chunk
  auto held = device_leases(t, parts.buf);
  if (!held) return {};
  const CudaRegistrations::Lease* t_lease = &held->a;
  const CudaRegistrations::Lease* p_lease = &held->b;
  auto leases = held->hold;
  // Step 1 (reduce-scatter): chunk j to rank j; every peer's chunk `r` into parts. Step 2
  // (all-gather): the reduced chunk to every peer; theirs into t. Empty chunks do not go, as
  // in allreduce_flat.
  std::vector<Xfer> step1, step2;
  for (int j = 0, k = 0; j < n; ++j) {
    if (j == r) continue;
    const Chunk cj = allreduce_chunk(numel, n, j);
    if (cj.count) step1.push_back(dev_xfer(true, j, t, *t_lease, cj.first * es, cj.count * es));
    if (mine.count) step1.push_back(dev_xfer(false, j, parts.buf, *p_lease, parts.stride * k, mine.count * es));
    if (mine.count) step2.push_back(dev_xfer(true, j, t, *t_lease, mine.first * es, mine.count * es));
    if (cj.count) step2.push_back(dev_xfer(false, j, t, *t_lease, cj.first * es, cj.count * es));
    ++k;
  }
  sync_current_stream(t);  // the input is written
  auto work = enqueue(c10d::OpType::ALLREDUCE, {t}, [this, t, parts, step1, step2, leases, op, mine, n, r](uint64_t tag) {
    exchange(tag, step1);
    if (mine.count)
      reduce_on_gpu(t.device(), [&] {
        at::Tensor dst = t.view(-1).narrow(0, mine.first, mine.count);
        std::vector<at::Tensor> ins(n);
        for (int j = 0, k = 0; j < n; ++j) ins[j] = j == r ? dst : parts.part(k++, t, mine.count);
        reduce_in_order(dst, ins, op, n, r);
      });
    exchange(tag + 1, step2);
  });
  device_calls_.fetch_add(1, std::memory_order_relaxed);
  return work;
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::reduce_scatter_device(const at::Tensor& output, const at::Tensor& input,
                                                                    Red op) {
  const int n = size(), r = rank();
  if (!device_collectives_ || !cuda_regs_ || n == 1 || !output.is_cuda() || !input.is_cuda() ||
      output.layout() != at::kStrided || input.layout() != at::kStrided || !output.is_contiguous() ||
      output.device() != input.device() || output.scalar_type() != input.scalar_type() ||
      input.numel() != output.numel() * n)
    return {};
  const uint64_t bytes = output.nbytes();
  std::vector<DevMsg> msgs;
  for (int j = 0; j < n; ++j)
    if (j != r) msgs.push_back({j, 0, bytes});
  if (!device_messages(msgs) || !moves_bytes(msgs)) return {};

  at::Tensor src = input.contiguous();  // on the caller's stream, before the wait below
  Parts parts(output, bytes, n - 1);    // the peers' contributions to this rank's result
  auto held = device_leases(src, parts.buf);
  if (!held) return {};
  const CudaRegistrations::Lease* s_lease = &held->a;
  const CudaRegistrations::Lease* p_lease = &held->b;
  auto leases = held->hold;
  // As reduce_scatter_parts: input chunk j to rank j, every peer's chunk `r` into parts.
  std::vector<Xfer> xs;
  for (int j = 0, k = 0; j < n; ++j) {
    if (j == r) continue;
    xs.push_back(dev_xfer(true, j, src, *s_lease, bytes * j, bytes));
    xs.push_back(dev_xfer(false, j, parts.buf, *p_lease, parts.stride * k++, bytes));
  }
  sync_current_stream(src);
  auto work = enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                      [this, output, src, parts, xs, leases, op, n, r](uint64_t tag) {
                        exchange(tag, xs);
                        reduce_on_gpu(output.device(), [&] {
                          // Only now (every send done) may the output be written: it may
                          // alias the input.
                          const int64_t m = output.numel();
                          at::Tensor dst = output.view(-1);
                          dst.copy_(src.view(-1).narrow(0, m * r, m));
                          std::vector<at::Tensor> ins(n);
                          for (int j = 0, k = 0; j < n; ++j) ins[j] = j == r ? dst : parts.part(k++, output, m);
                          reduce_in_order(dst, ins, op, n, r);
                        });
                      });
  device_calls_.fetch_add(1, std::memory_order_relaxed);
  return work;
}

}  // namespace sluice::torch_backend
