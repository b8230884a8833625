// Native helpers of the direct-launch fast path (see ../_native.py): the call's signature, its
// fresh outputs and the kernel launch, each in one C++ call instead of dozens of Python
// attribute reads (or, for the launch, an 80-argument Python tuple parsed per call).
//
// signature(rules, *args) reads, for each argument, what Triton specialises on and what the ops'
// checks look at -- dtype, device, sizes, strides, 16-byte alignment of the data pointer --
// straight from the TensorImpl, and packs them into one bytes object (the lookup key), plus the
// data addresses the launch passes: one call instead of ~60 Python attribute reads. A Python
// float stands for the scale tensor kept for its value (keep_scalar), or gives None. The key is a
// function of shapes and strides, not of addresses, so the memory-overlap rule (../_overlap.py,
// `rules` names the written arguments) runs here on every call. Anything but a plain
// torch.Tensor / nn.Parameter (a subclass, a non-tensor), a tensor without strides, a tensor that
// requires grad while grad mode is on, a negative-bit view, or a written tensor that may overlap
// another argument gives None: the checked path handles (or names) it.

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

// The headers of what is used, not <torch/extension.h> (all of ATen's operators and the C++
// frontend): a build takes a third less time (../_native.py).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

namespace {

// The memory-overlap rules of ../_overlap.py, on the fast path (the same results: tests compare
// them). A view is (address, element size, sizes, strides).
struct View {
  uintptr_t ptr = 0;
  int64_t elsize = 0;
  at::IntArrayRef sizes, strides;
  bool present = false;
  intptr_t lo = 0, hi = 0;  // the byte extent [lo, hi); lo == hi when empty

  View() = default;
  View(uintptr_t p, int64_t e, at::IntArrayRef n, at::IntArrayRef s)
      : ptr(p), elsize(e), sizes(n), strides(s), present(true) {
    intptr_t a = static_cast<intptr_t>(p), b = a;
    for (size_t d = 0; d < n.size(); ++d) {
      if (n[d] == 0) return;  // empty: lo == hi
      const intptr_t step = (n[d] - 1) * s[d] * e;
      if (step < 0) a += step; else b += step;
    }
    lo = a;
    hi = b + e;
  }
};

bool self_overlaps(const View& v) {
  int64_t dims[2][16];
  size_t n = 0;
  for (size_t d = 0; d < v.sizes.size() && n < 16; ++d)
    if (v.sizes[d] > 1) { dims[0][n] = std::abs(v.strides[d]); dims[1][n++] = v.sizes[d]; }
  if (v.sizes.size() > 16) return true;
  for (size_t i = 1; i < n; ++i)  // insertion sort by stride: n <= 16
    for (size_t j = i; j > 0 && dims[0][j - 1] > dims[0][j]; --j) {
      std::swap(dims[0][j - 1], dims[0][j]);
      std::swap(dims[1][j - 1], dims[1][j]);
    }
  int64_t span = 0;
  for (size_t i = 0; i < n; ++i) {
    if (dims[0][i] <= span) return true;
    span += (dims[1][i] - 1) * dims[0][i];
  }
  return false;
}

struct Lattice {
  static constexpr size_t kMax = 40;  // 16 dims of each view, the byte dim, merged strides
  int64_t s[kMax], lo[kMax], hi[kMax], reach[kMax + 1];
  size_t n = 0;
  int budget = 4096;
  // Adds factor range [l, h] to byte stride st (equal strides add their ranges).
  void add(int64_t st, int64_t l, int64_t h) {
    for (size_t i = 0; i < n; ++i)
      if (s[i] == st) { lo[i] += l; hi[i] += h; return; }
    s[n] = st; lo[n] = l; hi[n] = h; ++n;
  }
  // delta == sum j_k s_k with lo_k <= j_k <= hi_k? (true also when out of budget)
  bool hit(size_t k, int64_t rest) {
    if (--budget < 0) return true;
    if (k == n) return rest == 0;
    const int64_t r = reach[k + 1], st = s[k];
    auto floordiv = [](int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); };
    const int64_t first = std::max(lo[k], -floordiv(r - rest, st));
    const int64_t last = std::min(hi[k], floordiv(rest + r, st));
    for (int64_t j = first; j <= last; ++j)
      if (hit(k + 1, rest - j * st)) return true;
    return false;
  }
};

// Whether a's and b's byte extents are apart (either empty): inline, where most pairs end.
inline bool apart(const View& a, const View& b) {
  return a.lo == a.hi || b.lo == b.hi || a.lo >= b.hi || b.lo >= a.hi;
}

// Whether a and b address a common byte, for any strides and element sizes (../_overlap.py,
// may_overlap: the same search over both views' byte lattices).
bool may_overlap(const View& a, const View& b) {
  if (apart(a, b)) return false;
  if (a.sizes.size() > 16 || b.sizes.size() > 16) return true;
  Lattice L;
  const View* views[2] = {&a, &b};
  for (int v = 0; v < 2; ++v) {
    const View& t = *views[v];
    for (size_t d = 0; d < t.sizes.size(); ++d) {
      const int64_t st = t.strides[d], m = t.sizes[d];
      if (st == 0 || m == 1) continue;
      const bool up = (st > 0) == (v == 0);  // a's factors count up, b's down
      L.add(std::abs(st) * t.elsize, up ? 0 : -(m - 1), up ? m - 1 : 0);
    }
  }
  L.add(1, -(b.elsize - 1), a.elsize - 1);  // the bytes within an element
  for (size_t i = 1; i < L.n; ++i)  // strides descending
    for (size_t j = i; j > 0 && L.s[j - 1] < L.s[j]; --j) {
      std::swap(L.s[j - 1], L.s[j]);
      std::swap(L.lo[j - 1], L.lo[j]);
      std::swap(L.hi[j - 1], L.hi[j]);
    }
  L.reach[L.n] = 0;
  for (size_t k = L.n; k-- > 0;) L.reach[k] = L.reach[k + 1] + L.s[k] * std::max(-L.lo[k], L.hi[k]);
  return L.hit(0, static_cast<int64_t>(b.ptr) - static_cast<int64_t>(a.ptr));
}

bool identical(const View& a, const View& b) {
  return a.ptr == b.ptr && a.elsize == b.elsize && a.sizes == b.sizes && a.strides == b.strides;
}

// rules: bytes [W, w_1..w_W, P, (w, r) x P]: argument indices written by the kernel, and pairs
// (written, read) that may be the very same view. False: some written view may share memory
// with another argument or with itself (the checked path then names them).
bool disjoint(const char* rules, Py_ssize_t len, const View* views, Py_ssize_t n) {
  if (len < 1) return true;
  const int W = static_cast<unsigned char>(rules[0]);
  if (len < 2 + W) return false;
  const int P = static_cast<unsigned char>(rules[1 + W]);
  if (len < 2 + W + 2 * P) return false;
  auto pair_ok = [&](int w, int r) {
    for (int p = 0; p < P; ++p) {
      const int pw = static_cast<unsigned char>(rules[2 + W + 2 * p]);
      const int pr = static_cast<unsigned char>(rules[3 + W + 2 * p]);
      if ((pw == w && pr == r) || (pw == r && pr == w)) return true;
    }
    return false;
  };
  for (int i = 0; i < W; ++i) {
    const int w = static_cast<unsigned char>(rules[1 + i]);
    if (w >= n || !views[w].present) continue;
    if (self_overlaps(views[w])) return false;
    const View& a = views[w];
    for (Py_ssize_t o = 0; o < n; ++o) {
      const View& b = views[o];
      // Apart extents first, before the pair rules: most of a call's ~100 pairs end here.
      if (o == w || !b.present || apart(a, b)) continue;
      if (pair_ok(w, static_cast<int>(o)) && identical(a, b)) continue;
      if (may_overlap(a, b)) return false;
    }
  }
  return true;
}

// One tensor of a call into the key: dtype, device, sizes, strides and whether the data pointer
// is 16-byte aligned (what Triton specialises on), plus its View for the overlap rule. False when
// the fast path must not take it (autograd would record it; no room left in the key).
bool pack_tensor(const at::Tensor& t, int64_t* buf, size_t& n, size_t cap, View& view) {
  // The ops have no backward: the checked path refuses what autograd would record.
  if (t.requires_grad() && at::GradMode::is_enabled()) return false;
  // A negative-bit view reads as the negation of its memory: the checked path refuses it.
  if (t.is_neg()) return false;
  const int64_t nd = t.dim();
  if (n + 6 + 2 * static_cast<size_t>(nd) > cap) return false;
  auto sizes = t.sizes();
  auto strides = t.strides();  // throws for tensors without strides (sparse, nested)
  buf[n++] = static_cast<int64_t>(t.scalar_type());
  buf[n++] = static_cast<int64_t>(t.device().type());
  buf[n++] = t.device().index();
  buf[n++] = nd;
  for (int64_t d = 0; d < nd; ++d) buf[n++] = sizes[d];
  for (int64_t d = 0; d < nd; ++d) buf[n++] = strides[d];
  const auto p = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  buf[n++] = (p % 16) == 0;
  view = View(p, static_cast<int64_t>(t.element_size()), sizes, strides);
  return true;
}

constexpr size_t kKeyWords = 512;   // int64 words: 6 + 2 * ndim per tensor, far above 16 tensors
constexpr Py_ssize_t kMaxTensors = 32;

// Python float scales: the float32 [1] device tensor kept for each (value, device) by the ops'
// checks (checks.scalar_on, through _native.keep_scalar), never released, as there. A float
// argument of a call stands for the one kept for its value on the first argument's device, so
// its key and address are that tensor's: turning it into the tensor in Python cost ~0.4 us a
// scale (docs/design.md, "Native launch route").
struct ScalarKey {
  uint64_t bits;
  int type, index;
  bool operator==(const ScalarKey& o) const {
    return bits == o.bits && type == o.type && index == o.index;
  }
};
struct ScalarKeyHash {
  size_t operator()(const ScalarKey& k) const {
    return std::hash<uint64_t>()(k.bits) ^ (static_cast<size_t>(k.type) << 8) ^
           static_cast<size_t>(k.index);
  }
};
// Touched with the GIL held only (every caller is a Python call).
std::unordered_map<ScalarKey, PyObject*, ScalarKeyHash>& kept_scalars() {
  static auto* map = new std::unordered_map<ScalarKey, PyObject*, ScalarKeyHash>();
  return *map;  // never destroyed: its tensors outlive the interpreter's teardown order
}

ScalarKey scalar_key(double value, const c10::Device& device) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return {bits, static_cast<int>(device.type()), static_cast<int>(device.index())};
}

// The tensor kept for float ``obj`` on ``first``'s device (a borrowed reference), or nullptr.
PyObject* kept_scalar(PyObject* obj, PyObject* first) {
  if (!THPVariable_CheckExact(first)) return nullptr;
  const auto& map = kept_scalars();
  if (map.empty()) return nullptr;
  const auto it = map.find(scalar_key(PyFloat_AS_DOUBLE(obj), THPVariable_Unpack(first).device()));
  return it == map.end() ? nullptr : it->second;
}

}  // namespace

// keep_scalar(value: float, tensor): the tensor a float ``value`` stands for in signature()'s
// calls on the tensor's device, kept (a reference held) for the life of the process.
static PyObject* qk_keep_scalar(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || !PyFloat_CheckExact(args[0]) || !THPVariable_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "keep_scalar(value: float, tensor: torch.Tensor)");
    return nullptr;
  }
  const ScalarKey key = scalar_key(PyFloat_AS_DOUBLE(args[0]),
                                   THPVariable_Unpack(args[1]).device());
  auto& map = kept_scalars();
  if (map.find(key) == map.end()) {
    Py_INCREF(args[1]);
    map.emplace(key, args[1]);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// signature(rules, *tensors): see the top of this file; rules as in disjoint(). None also when
// a written tensor may overlap another (the checked path reports which).
static PyObject* qk_signature(PyObject*, PyObject* const* all_args, Py_ssize_t all_n) {
  if (all_n < 1 || !PyBytes_Check(all_args[0]) || all_n - 1 > kMaxTensors) {
    PyErr_SetString(PyExc_TypeError, "signature(rules: bytes, *tensors) (at most 32 tensors)");
    return nullptr;
  }
  PyObject* const* args = all_args + 1;
  const Py_ssize_t nargs = all_n - 1;
  View views[kMaxTensors];
  int64_t buf[kKeyWords];
  size_t n = 0;
  THPObjectPtr addrs(PyList_New(nargs));
  if (!addrs) return nullptr;
  try {
    for (Py_ssize_t i = 0; i < nargs; ++i) {
      PyObject* obj = args[i];
      if (obj == Py_None) {
        if (n + 1 > kKeyWords) Py_RETURN_NONE;
        buf[n++] = -1;
        Py_INCREF(Py_None);
        PyList_SET_ITEM(addrs.get(), i, Py_None);
        continue;
      }
      if (PyFloat_CheckExact(obj) && !(obj = kept_scalar(obj, args[0]))) Py_RETURN_NONE;
      if (!THPVariable_CheckExact(obj)) Py_RETURN_NONE;
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (!pack_tensor(t, buf, n, kKeyWords, views[i])) Py_RETURN_NONE;
      PyObject* a = PyLong_FromUnsignedLongLong(views[i].ptr);
      if (!a) return nullptr;
      PyList_SET_ITEM(addrs.get(), i, a);
    }
  } catch (const std::exception&) {  // e.g. sparse or nested tensors: no strides
    Py_RETURN_NONE;
  }
  if (!disjoint(PyBytes_AS_STRING(all_args[0]), PyBytes_GET_SIZE(all_args[0]), views, nargs))
    Py_RETURN_NONE;
  THPObjectPtr key(
      PyBytes_FromStringAndSize(reinterpret_cast<const char*>(buf), n * sizeof(int64_t)));
  if (!key) return nullptr;
  return PyTuple_Pack(2, key.get(), addrs.get());
}

// outputs(like_1..like_n, given_1..given_n) -> (out_1..out_n, address_1..address_n): each
// output not given (None) is allocated contiguous with the shape and options of its input, as
// torch.empty_like(x, memory_format=torch.contiguous_format) does, in one call with no Python
// argument parsing (docs/design.md, "Native launch route"). The ops declare which input each
// output is shaped like (KernelLauncher's ``outputs``). Called only after signature() accepted
// the given ones, so each is a plain tensor or None.
static PyObject* qk_outputs(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS  // c10 errors (e.g. out of memory) reach Python as torch's own exceptions
  if (nargs < 2 || nargs % 2) {
    PyErr_SetString(PyExc_TypeError, "outputs(like_1..like_n, given_1..given_n)");
    return nullptr;
  }
  const Py_ssize_t n = nargs / 2;
  THPObjectPtr result(PyTuple_New(2 * n));
  if (!result) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* given = args[n + i];
    PyObject* out;
    unsigned long long addr;
    if (given != Py_None) {
      addr = reinterpret_cast<uintptr_t>(THPVariable_Unpack(given).const_data_ptr());
      Py_INCREF(given);
      out = given;
    } else {
      const at::Tensor& like = THPVariable_Unpack(args[i]);
      at::Tensor t = at::empty(like.sizes(), like.options());
      addr = reinterpret_cast<uintptr_t>(t.const_data_ptr());
      out = THPVariable_Wrap(std::move(t));
      if (!out) return nullptr;
    }
    PyObject* a = PyLong_FromUnsignedLongLong(addr);
    if (!a) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(result.get(), i, out);  // steals the references
    PyTuple_SET_ITEM(result.get(), n + i, a);
  }
  return result.release();
  END_HANDLE_TH_ERRORS
}



// bump(written, inputs, outputs): the version bump of a fast call, as torch's in-place ops do
// it (a tensor saved for backward and overwritten makes that backward raise): inputs[i] for
// each index i in bytes ``written`` (None and inference tensors skipped), then every output
// (tuples or lists). One C++ call instead of a Python tuple built for
// torch._C._increment_version (docs/design.md, "Native launch route").
static PyObject* qk_bump(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 3 || !PyBytes_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "bump(written: bytes, inputs, outputs)");
    return nullptr;
  }
  THPObjectPtr inputs(PySequence_Fast(args[1], "bump: inputs must be a tuple or list"));
  THPObjectPtr outputs(PySequence_Fast(args[2], "bump: outputs must be a tuple or list"));
  if (!inputs || !outputs) return nullptr;
  auto one = [](PyObject* obj) -> bool {
    if (obj == Py_None) return true;
    if (!THPVariable_Check(obj)) {
      PyErr_SetString(PyExc_TypeError, "bump: tensors or None");
      return false;
    }
    // Inference tensors have no version counter: skipped, as torch._C._increment_version
    // does (bumping one outside inference mode would raise after the launch).
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
    return true;
  };
  const char* w = PyBytes_AS_STRING(args[0]);
  const Py_ssize_t n_in = PySequence_Fast_GET_SIZE(inputs.get());
  for (Py_ssize_t k = 0; k < PyBytes_GET_SIZE(args[0]); ++k) {
    const Py_ssize_t i = static_cast<unsigned char>(w[k]);
    if (i < n_in && !one(PySequence_Fast_GET_ITEM(inputs.get(), i))) return nullptr;
  }
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(outputs.get()); ++i)
    if (!one(PySequence_Fast_GET_ITEM(outputs.get(), i))) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}
