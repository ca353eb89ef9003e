// The collectives of the sluice backend: direct algorithms over the backend's tagged
// messages. Every reduction combines the contributions in rank order on the rank that owns
// the result, so all ranks see the same bits whatever order messages arrive in.
#include <cstring>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "backend.hpp"
#include "host_staging.hpp"
#include "reduce_ops.hpp"
#include "sluice/cuda.hpp"
#include "work.hpp"

namespace sluice::torch_backend {

namespace {

using Xfer = SluiceBackend::Xfer;

std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& vv) {
  std::vector<at::Tensor> out;
  for (const auto& v : vv) out.insert(out.end(), v.begin(), v.end());
  return out;
}

void check_dense_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.layout() == at::kStrided, "sluice: ", what, ": only dense (strided) tensors are supported");
  TORCH_CHECK(t.device().is_cpu(), "sluice: ", what, ": ", t.device(),
              " tensors are not supported by the sluice backend (CPU and CUDA tensors are)");
}

// A contiguous buffer for writing into `t`: `t` itself when it is contiguous, otherwise a
// temporary that commit() copies back.
struct OutBuf {
  at::Tensor t, buf;
  explicit OutBuf(const at::Tensor& out)
      : t(out), buf(out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous)) {}
  void commit() {
    if (!buf.is_same(t)) t.copy_(buf);
  }
};

void* ptr(const at::Tensor& t) { return t.numel() ? t.data_ptr() : nullptr; }
uint64_t nbytes(const at::Tensor& t) { return t.nbytes(); }

// all_to_all_single's rows per rank along dim 0 (`splits`, or dim 0 split evenly), checked.
std::vector<int64_t> split_rows(const at::Tensor& t, const std::vector<int64_t>& splits, int n, const char* which) {
  std::vector<int64_t> s = splits;
  const int64_t dim0 = t.dim() ? t.size(0) : 1;
  if (s.empty()) {
    TORCH_CHECK(dim0 % n == 0, "sluice: all_to_all_single: ", which, " dim 0 (", dim0,
                ") is not divisible by the world size without split sizes");
    s.assign(n, dim0 / n);
  }
  TORCH_CHECK(static_cast<int>(s.size()) == n, "sluice: all_to_all_single: ", which, " split sizes need ", n, " entries");
  int64_t sum = 0;
  for (auto v : s) {
    TORCH_CHECK(v >= 0, "sluice: all_to_all_single: negative split size");
    sum += v;
  }
  TORCH_CHECK(sum == dim0, "sluice: all_to_all_single: ", which, " split sizes add up to ", sum, ", dim 0 is ", dim0);
  return s;
}

// Bytes of one row along dim 0 (a 0-dim tensor is one row).
uint64_t row_bytes(const at::Tensor& t) {
  if (t.dim() == 0) return t.element_size();
  return t.size(0) ? t.nbytes() / t.size(0) : 0;
}

// `count` contiguous tensors shaped like `like`, in the backend's scratch buffer (each
// starts 64-byte aligned).
std::vector<at::Tensor> scratch_parts(SluiceBackend& b, const at::Tensor& like, int count) {
  const uint64_t bytes = like.nbytes(), stride = (bytes + 63) / 64 * 64;
  at::Tensor buf = b.scratch(stride * count);
  std::vector<at::Tensor> out;
  for (int k = 0; k < count; ++k)
    out.push_back(buf.narrow(0, int64_t(stride * k), int64_t(bytes)).view(like.scalar_type()).view(like.sizes()));
  return out;
}

// All-reduce of a flat contiguous tensor in place. Small: every rank gets every contribution
// and reduces locally. Large: reduce-scatter (rank j owns chunk j) then all-gather.
void allreduce_flat(SluiceBackend& b, at::Tensor flat, Red op, uint64_t tag) {
  const int n = b.size(), r = b.rank();
  if (n == 1) {
    if (op == Red::AVG) flat.div_(1);
    return;
  }
  const int64_t numel = flat.numel();
  if (nbytes(flat) <= kDirectAllreduceBytes || numel < n) {
    std::vector<at::Tensor> parts(n), tmp = scratch_parts(b, flat, n - 1);
    std::vector<Xfer> xs;
    for (int j = 0; j < n; ++j) {
      if (j == r) {
        parts[j] = flat;
        continue;
      }
      parts[j] = tmp[j < r ? j : j - 1];
      xs.push_back({true, j, ptr(flat), nbytes(flat)});
      xs.push_back({false, j, ptr(parts[j]), nbytes(parts[j])});
    }
    b.exchange(tag, xs);
    reduce_in_order(flat, parts, op, n, r);
    return;
  }
  auto chunk = [&](int j) {
    const Chunk c = allreduce_chunk(numel, n, j);
    return flat.narrow(0, c.first, c.count);
  };
  at::Tensor mine = chunk(r);
  std::vector<at::Tensor> parts(n), tmp = scratch_parts(b, mine, n - 1);
  std::vector<Xfer> xs;
  for (int j = 0; j < n; ++j) {
    if (j == r) {
      parts[j] = mine;
      continue;
    }
    at::Tensor cj = chunk(j);
    if (cj.numel()) xs.push_back({true, j, ptr(cj), nbytes(cj)});
    parts[j] = tmp[j < r ? j : j - 1];
    if (mine.numel()) xs.push_back({false, j, ptr(parts[j]), nbytes(parts[j])});
  }
  b.exchange(tag, xs);
  if (mine.numel()) reduce_in_order(mine, parts, op, n, r);
  xs.clear();
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    at::Tensor cj = chunk(j);
    if (mine.numel()) xs.push_back({true, j, ptr(mine), nbytes(mine)});
    if (cj.numel()) xs.push_back({false, j, ptr(cj), nbytes(cj)});
  }
  b.exchange(tag + 1, xs);
}

std::vector<at::Tensor> flat_chunks(const at::Tensor& flat, int n) {
  const int64_t m = flat.numel() / n;
  std::vector<at::Tensor> out;
  for (int j = 0; j < n; ++j) out.push_back(flat.narrow(0, m * j, m));
  return out;
}

}  // namespace

at::Tensor SluiceBackend::scratch(uint64_t bytes) {
  if (!scratch_.defined() || uint64_t(scratch_.numel()) < bytes)
    scratch_ = at::empty({int64_t(std::max<uint64_t>(bytes, 64))}, at::TensorOptions().dtype(at::kByte));
  return scratch_;
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::barrier(const c10d::BarrierOptions&) {
  return enqueue(c10d::OpType::BARRIER, {}, [this](uint64_t tag) {
    const int n = size(), r = rank();
    std::vector<Xfer> xs;
    if (r == 0) {
      for (int j = 1; j < n; ++j) xs.push_back({false, j, nullptr, 0});
      exchange(tag, xs);
      xs.clear();
      for (int j = 1; j < n; ++j) xs.push_back({true, j, nullptr, 0});
      exchange(tag + 1, xs);
    } else {
      exchange(tag, {{true, 0, nullptr, 0}});
      exchange(tag + 1, {{false, 0, nullptr, 0}});
    }
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  if (device_collectives_ && tensors.size() == 1 && tensors[0].is_cuda() && tensors[0].layout() == at::kStrided &&
      tensors[0].is_contiguous() && opts.rootRank >= 0 && opts.rootRank < size()) {
    // The device path: the root's tensor read by every other rank straight into its own.
    const int root = static_cast<int>(opts.rootRank);
    const at::Tensor& t = tensors[0];
    std::vector<DevMsg> sends, recvs;
    if (rank() == root) {
      for (int j = 0; j < size(); ++j)
        if (j != root) sends.push_back({j, 0, t.nbytes()});
    } else {
      recvs.push_back({root, 0, t.nbytes()});
    }
    if (auto w = exchange_device(c10d::OpType::BROADCAST, t, t, sends, recvs, {})) return w;
  }
  if (any_cuda(tensors)) {
    HostStaging s;
    auto host = s.inouts(tensors);
    return s.wrap(broadcast(host, opts), c10d::OpType::BROADCAST, tensors, timeout_, rank());
  }
  for (auto& t : tensors) check_dense_cpu(t, "broadcast");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size(), "sluice: broadcast: invalid root rank ", opts.rootRank);
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::BROADCAST, tensors, [this, tensors, root](uint64_t tag) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      std::vector<Xfer> xs;
      if (rank() == root) {
        at::Tensor src = tensors[i].contiguous();
        for (int j = 0; j < size(); ++j)
          if (j != root) xs.push_back({true, j, ptr(src), nbytes(src)});
        exchange(tag + i, xs);
      } else {
        OutBuf out(tensors[i]);
        exchange(tag + i, {{false, root, ptr(out.buf), nbytes(out.buf)}});
        out.commit();
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  if (any_cuda(tensors)) {
    if (tensors.size() == 1 && tensors[0].is_cuda()) {
      check_op(tensors[0], opts.reduceOp, "all_reduce");
      if (auto w = allreduce_ll(tensors[0], opts.reduceOp.op_)) return w;
      if (auto w = allreduce_device(tensors[0], opts.reduceOp.op_)) return w;
    }
    HostStaging s;
    auto host = s.inouts(tensors);
    return s.wrap(allreduce(host, opts), c10d::OpType::ALLREDUCE, tensors, timeout_, rank());
  }
  for (auto& t : tensors) check_dense_cpu(t, "all_reduce"), check_op(t, opts.reduceOp, "all_reduce");
  const Red op = opts.reduceOp.op_;
  return enqueue(c10d::OpType::ALLREDUCE, tensors, [this, tensors, op](uint64_t tag) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      OutBuf out(tensors[i]);
      if (!out.buf.is_same(out.t)) out.buf.copy_(out.t);
      allreduce_flat(*this, out.buf.view(-1), op, tag + 2 * i);
      out.commit();
    }
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                   const c10d::AllreduceCoalescedOptions& opts) {
  if (any_cuda(tensors)) {
    HostStaging s;
    auto host = s.inouts(tensors);
    return s.wrap(allreduce_coalesced(host, opts), c10d::OpType::ALLREDUCE_COALESCED, tensors, timeout_, rank());
  }
  for (auto& t : tensors) {
    check_dense_cpu(t, "all_reduce_coalesced"), check_op(t, opts.reduceOp, "all_reduce_coalesced");
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), "sluice: all_reduce_coalesced: tensors must share a dtype");
  }
  const Red op = opts.reduceOp.op_;
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, tensors, [this, tensors, op](uint64_t tag) {
    if (tensors.empty()) return;
    std::vector<at::Tensor> flats;
    for (auto& t : tensors) flats.push_back(t.reshape(-1));
    at::Tensor all = at::cat(flats);
    allreduce_flat(*this, all, op, tag);
    int64_t off = 0;
    for (auto& t : tensors) {
      t.copy_(all.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  if (any_cuda(tensors)) {
    HostStaging s;
    auto host = s.inouts(tensors);
    return s.wrap(reduce(host, opts), c10d::OpType::REDUCE, tensors, timeout_, rank());
  }
  TORCH_CHECK(tensors.size() == 1, "sluice: reduce takes one tensor");
  check_dense_cpu(tensors[0], "reduce");
  check_op(tensors[0], opts.reduceOp, "reduce");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size(), "sluice: reduce: invalid root rank ", opts.rootRank);
  const int root = static_cast<int>(opts.rootRank);
  const Red op = opts.reduceOp.op_;
  return enqueue(c10d::OpType::REDUCE, tensors, [this, tensors, root, op](uint64_t tag) {
    at::Tensor t = tensors[0];
    if (rank() != root) {
      at::Tensor src = t.contiguous();
      exchange(tag, {{true, root, ptr(src), nbytes(src)}});
      return;
    }
    OutBuf out(t);
    if (!out.buf.is_same(out.t)) out.buf.copy_(out.t);
    std::vector<at::Tensor> parts(size()), tmp = scratch_parts(*this, out.buf, size() - 1);
    std::vector<Xfer> xs;
    for (int j = 0; j < size(); ++j) {
      if (j == root) {
        parts[j] = out.buf;
        continue;
      }
      parts[j] = tmp[j < root ? j : j - 1];
      xs.push_back({false, j, ptr(parts[j]), nbytes(parts[j])});
    }
    exchange(tag, xs);
    reduce_in_order(out.buf, parts, op, size(), root);
    out.commit();
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::allgather_ll(c10d::OpType type, const at::Tensor& in,
                                                            const std::vector<at::Tensor>& outs, bool into_one) {
  // What decides is shared by every rank under the collective's contract (CUDA tensors of one
  // dtype and size); the group's part was agreed when it was made (ll_allgather.hpp).
  if (!ll_ || !ll_->on() || !in.defined() || !in.is_cuda() || in.layout() != at::kStrided ||
      in.nbytes() > ll_->max_bytes())
    return {};
  const int64_t n = in.numel();
  for (const auto& o : outs)
    if (!o.defined() || !o.is_cuda() || o.layout() != at::kStrided || o.device() != in.device() ||
        o.scalar_type() != in.scalar_type())
      return {};
  if (into_one ? outs.size() != 1 || outs[0].numel() != n * size() : static_cast<int>(outs.size()) != size())
    return {};
  if (!into_one)
    for (const auto& o : outs)
      if (o.numel() != n) return {};  // the host path names the mismatch
  c10::DeviceGuard guard(in.device());
  const LlStream ls = ll_stream(in.device());
  // Nothing to move: done on every rank without a word (and without setting anything up).
  if (n == 0) return ll_finish(type, outs, ls, /*launched=*/false);
  if (!ll_ready(in.device(), type)) return {};  // every rank fell back at this same call
  ll_->count();
  at::Tensor src = in.is_contiguous() ? in : in.contiguous();  // copies on the current stream
  at::Tensor dst = into_one && outs[0].is_contiguous() ? outs[0] : at::empty({n * size()}, in.options());
  ll_->launch(src.data_ptr(), dst.data_ptr(), in.nbytes(), ls.stream, ls.capturing);
  if (into_one) {
    if (!dst.is_same(outs[0])) outs[0].copy_(dst.view(outs[0].sizes()));
  } else {
    for (int j = 0; j < size(); ++j) outs[j].copy_(dst.narrow(0, n * j, n).view(outs[j].sizes()));
  }
  return ll_finish(type, outs, ls);
}

SluiceBackend::LlStream SluiceBackend::ll_stream(c10::Device device) const {
  // The caller's current stream on the tensors' device. Its cudaStream_t comes from c10's
  // device-independent interface, so no CUDA torch header is needed: Stream::native_handle()
  // asks the DeviceGuardImplInterface registered for CUDA (CUDAGuardImpl, in the CUDA torch's
  // libc10_cuda) for getStreamNativeHandle(), which is CUDAStream(s).stream(), the same handle
  // torch.cuda.current_stream().cuda_stream gives (nullptr for the legacy default stream, which
  // CUDA also names 0). The stream carries its device; the caller's guard makes it current too.
  const c10::impl::DeviceGuardImplInterface* g = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Stream stream = g->getStream(device);
  return {stream, cuda::stream_capturing(stream.native_handle())};
}

bool SluiceBackend::ll_ready(c10::Device device, c10d::OpType type) {
  try {
    return ll_->ensure(device, timeout_);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    std::rethrow_exception(backend_error(std::string("sluice: ") + c10d::opTypeToString(type) + " failed: " + e.what()));
  }
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::ll_finish(c10d::OpType type, const std::vector<at::Tensor>& outs,
                                                        const LlStream& ls, bool launched) {
  auto done = events_.take(ls.stream.device_index(), ls.capturing);
  done->record(ls.stream);
  if (launched) ll_->note_done(done, ls.stream, ls.capturing);
  return c10::make_intrusive<StreamWork>(type, outs, ls.stream, std::move(done), ls.capturing, rank());
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllgatherOptions& opts) {
  if (inputs.size() == 1 && outputs.size() == 1)
    if (auto w = allgather_ll(c10d::OpType::ALLGATHER, inputs[0], outputs[0], /*into_one=*/false)) return w;
  if (any_cuda(outputs) || any_cuda(inputs)) {
    HostStaging s;
    auto host_out = s.outputs(outputs);
    auto host_in = s.inputs(inputs);
    return s.wrap(allgather(host_out, host_in, opts), c10d::OpType::ALLGATHER, flat(outputs), timeout_, rank());
  }
  TORCH_CHECK(inputs.size() == 1 && outputs.size() == 1, "sluice: all_gather takes one input and one output list");
  TORCH_CHECK(static_cast<int>(outputs[0].size()) == size(), "sluice: all_gather: the output list needs ", size(),
              " tensors, got ", outputs[0].size());
  check_dense_cpu(inputs[0], "all_gather");
  for (auto& o : outputs[0]) {
    check_dense_cpu(o, "all_gather");
    TORCH_CHECK(o.numel() == inputs[0].numel() && o.scalar_type() == inputs[0].scalar_type(),
                "sluice: all_gather: every output must match the input's size and dtype");
  }
  auto outs = outputs[0];
  auto in = inputs[0];
  return enqueue(c10d::OpType::ALLGATHER, outs, [this, outs, in](uint64_t tag) {
    at::Tensor src = in.contiguous();
    std::vector<OutBuf> bufs;
    for (auto& o : outs) bufs.emplace_back(o);
    std::vector<Xfer> xs;
    for (int j = 0; j < size(); ++j) {
      if (j == rank()) continue;
      xs.push_back({true, j, ptr(src), nbytes(src)});
      xs.push_back({false, j, ptr(bufs[j].buf), nbytes(bufs[j].buf)});
    }
    exchange(tag, xs);
    bufs[rank()].buf.view(-1).copy_(src.view(-1));
    for (auto& b : bufs) b.commit();
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                               const c10d::AllgatherOptions& opts) {
  if (auto w = allgather_ll(c10d::OpType::_ALLGATHER_BASE, input, {output}, /*into_one=*/true)) return w;
  if (auto w = allgather_device(output, input)) return w;
  if (output.is_cuda() || input.is_cuda()) {
    HostStaging s;
    auto host_out = s.output(output);
    auto host_in = s.input(input);
    return s.wrap(_allgather_base(host_out, host_in, opts), c10d::OpType::_ALLGATHER_BASE, {output}, timeout_, rank());
  }
  check_dense_cpu(input, "all_gather_into_tensor");
  check_dense_cpu(output, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == input.numel() * size() && output.scalar_type() == input.scalar_type(),
              "sluice: all_gather_into_tensor: the output needs world_size x the input's elements, same dtype");
  return enqueue(c10d::OpType::_ALLGATHER_BASE, {output}, [this, output, input](uint64_t tag) {
    OutBuf out(output);
    at::Tensor src = input.contiguous();
    auto chunks = flat_chunks(out.buf.view(-1), size());
    std::vector<Xfer> xs;
    for (int j = 0; j < size(); ++j) {
      if (j == rank()) continue;
      xs.push_back({true, j, ptr(src), nbytes(src)});
      xs.push_back({false, j, ptr(chunks[j]), nbytes(chunks[j])});
    }
    exchange(tag, xs);
    chunks[rank()].copy_(src.view(-1));
    out.commit();
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  if (any_cuda(outputs) || any_cuda(inputs)) {
    HostStaging s;
    auto host_out = s.outputs(outputs);
    auto host_in = s.inputs(inputs);
    return s.wrap(gather(host_out, host_in, opts), c10d::OpType::GATHER, flat(outputs), timeout_, rank());
  }
  TORCH_CHECK(inputs.size() == 1, "sluice: gather takes one input tensor");
  check_dense_cpu(inputs[0], "gather");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size(), "sluice: gather: invalid root rank ", root);
  std::vector<at::Tensor> outs;
  if (rank() == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size(),
                "sluice: gather: the root needs a list of ", size(), " output tensors");
    for (auto& o : outputs[0]) {
      check_dense_cpu(o, "gather");
      TORCH_CHECK(o.numel() == inputs[0].numel() && o.scalar_type() == inputs[0].scalar_type(),
                  "sluice: gather: every output must match the input's size and dtype");
    }
    outs = outputs[0];
  }
  auto in = inputs[0];
  return enqueue(c10d::OpType::GATHER, outs, [this, outs, in, root](uint64_t tag) {
    at::Tensor src = in.contiguous();
    if (rank() != root) {
      exchange(tag, {{true, root, ptr(src), nbytes(src)}});
      return;
    }
    std::vector<OutBuf> bufs;
    for (auto& o : outs) bufs.emplace_back(o);
    std::vector<Xfer> xs;
    for (int j = 0; j < size(); ++j)
      if (j != root) xs.push_back({false, j, ptr(bufs[j].buf), nbytes(bufs[j].buf)});
    exchange(tag, xs);
    bufs[root].buf.view(-1).copy_(src.view(-1));
    for (auto& b : bufs) b.commit();
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ScatterOptions& opts) {
  if (any_cuda(outputs) || any_cuda(inputs)) {
    HostStaging s;
    auto host_out = s.outputs(outputs);
    auto host_in = s.inputs(inputs);
    return s.wrap(scatter(host_out, host_in, opts), c10d::OpType::SCATTER, outputs, timeout_, rank());
  }
  TORCH_CHECK(outputs.size() == 1, "sluice: scatter takes one output tensor");
  check_dense_cpu(outputs[0], "scatter");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size(), "sluice: scatter: invalid root rank ", root);
  std::vector<at::Tensor> ins;
  if (rank() == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size(),
                "sluice: scatter: the root needs a list of ", size(), " input tensors");
    for (auto& i : inputs[0]) {
      check_dense_cpu(i, "scatter");
      TORCH_CHECK(i.numel() == outputs[0].numel() && i.scalar_type() == outputs[0].scalar_type(),
                  "sluice: scatter: every input must match the output's size and dtype");
    }
    ins = inputs[0];
  }
  auto out_t = outputs[0];
  return enqueue(c10d::OpType::SCATTER, {out_t}, [this, ins, out_t, root](uint64_t tag) {
    OutBuf out(out_t);
    if (rank() != root) {
      exchange(tag, {{false, root, ptr(out.buf), nbytes(out.buf)}});
      out.commit();
      return;
    }
    std::vector<at::Tensor> srcs;
    std::vector<Xfer> xs;
    for (int j = 0; j < size(); ++j) {
      srcs.push_back(ins[j].contiguous());
      if (j != root) xs.push_back({true, j, ptr(srcs[j]), nbytes(srcs[j])});
    }
    exchange(tag, xs);
    out.buf.view(-1).copy_(srcs[root].view(-1));
    out.commit();
  });
}

namespace {
// Reduce-scatter where `inputs[j]` is this rank's contribution to rank j's result.
void reduce_scatter_parts(SluiceBackend& b, const std::vector<at::Tensor>& inputs, at::Tensor out, Red op,
                          uint64_t tag) {
  const int n = b.size(), r = b.rank();
  std::vector<at::Tensor> srcs, parts(n);
  std::vector<Xfer> xs;
  OutBuf res(out);
  for (int j = 0; j < n; ++j) srcs.push_back(inputs[j].contiguous());
  std::vector<at::Tensor> tmp = scratch_parts(b, res.buf, n - 1);
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    xs.push_back({true, j, ptr(srcs[j]), nbytes(srcs[j])});
    parts[j] = tmp[j < r ? j : j - 1];
    xs.push_back({false, j, ptr(parts[j]), nbytes(parts[j])});
  }
  b.exchange(tag, xs);
  // Only now (every send done) may the output be written: it may alias an input.
  res.buf.copy_(srcs[r].view(out.sizes()));
  parts[r] = res.buf;
  reduce_in_order(res.buf, parts, op, n, r);
  res.commit();
}
}  // namespace

c10::intrusive_ptr<c10d::Work> SluiceBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                              std::vector<std::vector<at::Tensor>>& inputs,
                                                              const c10d::ReduceScatterOptions& opts) {
  if (any_cuda(outputs) || any_cuda(inputs)) {
    HostStaging s;
    auto host_out = s.outputs(outputs);
    auto host_in = s.inputs(inputs);
    return s.wrap(reduce_scatter(host_out, host_in, opts), c10d::OpType::REDUCE_SCATTER, outputs, timeout_, rank());
  }
  TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size(),
              "sluice: reduce_scatter takes one output and a list of ", size(), " inputs");
  check_dense_cpu(outputs[0], "reduce_scatter");
  check_op(outputs[0], opts.reduceOp, "reduce_scatter");
  for (auto& i : inputs[0]) {
    check_dense_cpu(i, "reduce_scatter");
    TORCH_CHECK(i.numel() == outputs[0].numel() && i.scalar_type() == outputs[0].scalar_type(),
                "sluice: reduce_scatter: every input must match the output's size and dtype");
  }
  auto ins = inputs[0];
  auto out = outputs[0];
  const Red op = opts.reduceOp.op_;
  return enqueue(c10d::OpType::REDUCE_SCATTER, {out}, [this, ins, out, op](uint64_t tag) {
    reduce_scatter_parts(*this, ins, out, op, tag);
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                    const c10d::ReduceScatterOptions& opts) {
  if (output.is_cuda() || input.is_cuda()) {
    if (output.is_cuda() && input.is_cuda()) {
      check_op(output, opts.reduceOp, "reduce_scatter_tensor");
      if (auto w = reduce_scatter_device(output, input, opts.reduceOp.op_)) return w;
    }
    HostStaging s;
    auto host_out = s.output(output);
    auto host_in = s.input(input);
    return s.wrap(_reduce_scatter_base(host_out, host_in, opts), c10d::OpType::_REDUCE_SCATTER_BASE, {output}, timeout_,
                  rank());
  }
  check_dense_cpu(output, "reduce_scatter_tensor");
  check_dense_cpu(input, "reduce_scatter_tensor");
  check_op(output, opts.reduceOp, "reduce_scatter_tensor");
  TORCH_CHECK(input.numel() == output.numel() * size() && input.scalar_type() == output.scalar_type(),
              "sluice: reduce_scatter_tensor: the input needs world_size x the output's elements, same dtype");
  const Red op = opts.reduceOp.op_;
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, {output}, [this, output, input, op](uint64_t tag) {
    auto parts = flat_chunks(input.contiguous().view(-1), size());
    reduce_scatter_parts(*this, parts, output, op, tag);
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                             std::vector<int64_t>& output_splits,
                                                             std::vector<int64_t>& input_splits,
                                                             const c10d::AllToAllOptions& opts) {
  if (device_collectives_ && output.is_cuda() && input.is_cuda() && output.layout() == at::kStrided &&
      input.layout() == at::kStrided &&
      output.is_contiguous() && output.scalar_type() == input.scalar_type()) {
    // The device path: every slice GPU to GPU (or, where one is too small for it, none of
    // them: the call stages below).
    auto os = split_rows(output, output_splits, size(), "output");
    auto is = split_rows(input, input_splits, size(), "input");
    at::Tensor src = input.contiguous();
    const uint64_t ib = row_bytes(src), ob = row_bytes(output);
    std::vector<uint64_t> ioff(size() + 1, 0), ooff(size() + 1, 0);
    for (int j = 0; j < size(); ++j) ioff[j + 1] = ioff[j] + is[j] * ib, ooff[j + 1] = ooff[j] + os[j] * ob;
    const int r = rank();
    TORCH_CHECK(ooff[r + 1] - ooff[r] == ioff[r + 1] - ioff[r], "sluice: all_to_all_single: this rank's own split sizes differ");
    std::vector<DevMsg> sends, recvs;
    for (int j = 0; j < size(); ++j) {
      if (j == r) continue;
      sends.push_back({j, ioff[j], ioff[j + 1] - ioff[j]});
      recvs.push_back({j, ooff[j], ooff[j + 1] - ooff[j]});
    }
    const uint64_t own = ooff[r + 1] - ooff[r];
    auto w = exchange_device(c10d::OpType::ALLTOALL_BASE, src, output, sends, recvs, [&] {
      if (own) {
        auto o8 = output.view(-1).view(at::kByte), i8 = src.view(-1).view(at::kByte);
        o8.narrow(0, ooff[r], own).copy_(i8.narrow(0, ioff[r], own));
      }
    });
    if (w) return w;
  }
  if (output.is_cuda() || input.is_cuda()) {
    HostStaging s;
    auto host_out = s.output(output);
    auto host_in = s.input(input);
    return s.wrap(alltoall_base(host_out, host_in, output_splits, input_splits, opts), c10d::OpType::ALLTOALL_BASE,
                  {output}, timeout_, rank());
  }
  check_dense_cpu(output, "all_to_all_single");
  check_dense_cpu(input, "all_to_all_single");
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "sluice: all_to_all_single: dtypes differ");
  auto os = split_rows(output, output_splits, size(), "output");
  auto is = split_rows(input, input_splits, size(), "input");
  return enqueue(c10d::OpType::ALLTOALL_BASE, {output}, [this, output, input, os, is](uint64_t tag) {
    OutBuf out(output);
    at::Tensor src = input.contiguous();
    const uint64_t ib = row_bytes(src), ob = row_bytes(out.buf);
    auto* sp = static_cast<uint8_t*>(ptr(src));
    auto* op = static_cast<uint8_t*>(ptr(out.buf));
    std::vector<uint64_t> ioff(size() + 1, 0), ooff(size() + 1, 0);
    for (int j = 0; j < size(); ++j) ioff[j + 1] = ioff[j] + is[j] * ib, ooff[j + 1] = ooff[j] + os[j] * ob;
    std::vector<Xfer> xs;
    for (int j = 0; j < size(); ++j) {
      if (j == rank()) continue;
      xs.push_back({true, j, sp + ioff[j], ioff[j + 1] - ioff[j]});
      xs.push_back({false, j, op + ooff[j], ooff[j + 1] - ooff[j]});
    }
    exchange(tag, xs);
    const int r = rank();
    TORCH_CHECK(ooff[r + 1] - ooff[r] == ioff[r + 1] - ioff[r], "sluice: all_to_all_single: this rank's own split sizes differ");
    if (ooff[r + 1] > ooff[r]) std::memcpy(op + ooff[r], sp + ioff[r], ooff[r + 1] - ooff[r]);
    out.commit();
  });
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                        const c10d::AllToAllOptions& opts) {
  if (any_cuda(outputs) || any_cuda(inputs)) {
    HostStaging s;
    auto host_out = s.outputs(outputs);
    auto host_in = s.inputs(inputs);
    return s.wrap(alltoall(host_out, host_in, opts), c10d::OpType::ALLTOALL, outputs, timeout_, rank());
  }
  TORCH_CHECK(static_cast<int>(outputs.size()) == size() && static_cast<int>(inputs.size()) == size(),
              "sluice: all_to_all takes lists of ", size(), " tensors");
  for (auto& t : outputs) check_dense_cpu(t, "all_to_all");
  for (auto& t : inputs) check_dense_cpu(t, "all_to_all");
  return enqueue(c10d::OpType::ALLTOALL, outputs, [this, outputs, inputs](uint64_t tag) {
    std::vector<OutBuf> outs;
    std::vector<at::Tensor> ins;
    std::vector<Xfer> xs;
    for (int j = 0; j < size(); ++j) outs.emplace_back(outputs[j]), ins.push_back(inputs[j].contiguous());
    for (int j = 0; j < size(); ++j) {
      if (j == rank()) continue;
      xs.push_back({true, j, ptr(ins[j]), nbytes(ins[j])});
      xs.push_back({false, j, ptr(outs[j].buf), nbytes(outs[j].buf)});
    }
    exchange(tag, xs);
    outs[rank()].buf.view(-1).copy_(ins[rank()].view(-1));
    for (auto& o : outs) o.commit();
  });
}

}  // namespace sluice::torch_backend
