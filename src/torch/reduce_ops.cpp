// The reductions shared by the host and device collectives (reduce_ops.hpp).
#include "reduce_ops.hpp"

namespace sluice::torch_backend {

void check_op(const at::Tensor& t, const c10d::ReduceOp& op, const char* what) {
  const Red r = op.op_;
  TORCH_CHECK(r == Red::SUM || r == Red::AVG || r == Red::PRODUCT || r == Red::MIN || r == Red::MAX || r == Red::BAND ||
                  r == Red::BOR || r == Red::BXOR,
              "sluice: ", what, ": reduce op ", int(r), " is not supported");
  if (r == Red::AVG)
    TORCH_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()), "sluice: ", what,
                ": ReduceOp.AVG needs a floating-point tensor, got ", t.scalar_type());
  if (r == Red::BAND || r == Red::BOR || r == Red::BXOR)
    TORCH_CHECK(at::isIntegralType(t.scalar_type(), /*includeBool=*/true), "sluice: ", what,
                ": bitwise reduce ops need an integer or bool tensor, got ", t.scalar_type());
}

void combine(at::Tensor& acc, const at::Tensor& x, Red op) {
  const bool b = acc.scalar_type() == at::kBool;
  switch (op) {
    case Red::SUM:
    case Red::AVG:
      b ? acc.logical_or_(x) : acc.add_(x);
      break;
    case Red::PRODUCT:
      b ? acc.logical_and_(x) : acc.mul_(x);
      break;
    case Red::MIN:
      at::minimum_out(acc, acc, x);
      break;
    case Red::MAX:
      at::maximum_out(acc, acc, x);
      break;
    case Red::BAND:
      acc.bitwise_and_(x);
      break;
    case Red::BOR:
      acc.bitwise_or_(x);
      break;
    case Red::BXOR:
      acc.bitwise_xor_(x);
      break;
    default:
      TORCH_CHECK(false, "sluice: unsupported reduce op");
  }
}

void reduce_in_order(at::Tensor dst, std::vector<at::Tensor>& parts, Red op, int world, int self) {
  at::Tensor acc = self == 0 ? dst : parts[0];
  for (size_t j = 1; j < parts.size(); ++j) combine(acc, parts[j], op);
  if (op == Red::AVG) acc.div_(world);
  if (self != 0) dst.copy_(acc);
}

}  // namespace sluice::torch_backend
