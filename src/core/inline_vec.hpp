// A vector that keeps its first N elements inline and only allocates past them: the per-op
// containers of the data path (a batch's pins, lanes, work requests) almost always hold one
// element, and a heap allocation per op is a measurable share of a small transfer's cost.
#pragma once

#include <array>
#include <cstddef>
#include <utility>
#include <vector>

namespace sluice::detail {

template <class T, size_t N>
class InlineVec {
 public:
  InlineVec() = default;
  explicit InlineVec(size_t n) { resize(n); }

  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  T* data() { return heap_.empty() ? inline_.data() : heap_.data(); }
  const T* data() const { return heap_.empty() ? inline_.data() : heap_.data(); }
  T* begin() { return data(); }
  T* end() { return data() + n_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + n_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  T& front() { return data()[0]; }
  T& back() { return data()[n_ - 1]; }
  const T& front() const { return data()[0]; }
  const T& back() const { return data()[n_ - 1]; }

  void push_back(T v) {
    if (heap_.empty() && n_ < N) {
      inline_[n_++] = std::move(v);
      return;
    }
    spill();
    heap_.push_back(std::move(v));
    ++n_;
  }
  void resize(size_t n) {
    if (heap_.empty() && n <= N) {
      for (size_t i = n; i < n_; ++i) inline_[i] = T();
      n_ = n;
      return;
    }
    spill();
    heap_.resize(n);
    n_ = n;
  }
  void clear() {
    for (size_t i = 0; i < N; ++i) inline_[i] = T();
    heap_.clear();
    n_ = 0;
  }

 private:
  // Moves the inline elements to the heap (once): afterwards every element lives there.
  void spill() {
    if (!heap_.empty() || n_ == 0) return;
    heap_.reserve(2 * N + 2);
    for (size_t i = 0; i < n_; ++i) heap_.push_back(std::move(inline_[i]));
    for (size_t i = 0; i < n_; ++i) inline_[i] = T();
  }

  std::array<T, N> inline_{};
  std::vector<T> heap_;
  size_t n_ = 0;
};

}  // namespace sluice::detail
