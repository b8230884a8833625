// Native helpers of the direct-launch fast path (see ../_native.py): the call's signature, its
// fresh outputs and the kernel launch, each in one C++ call instead of dozens of Python
// attribute reads (or, for the launch, an 80-argument Python tuple parsed per call).
//
// signature(rules, *args) reads, for each argument, what Triton specialises on and what the ops'
// checks look at -- dtype, device, sizes, strides, 16-byte alignment of the data pointer --
// straight from the TensorImpl, and packs them into one bytes object (the lookup key), plus the
// data addresses the launch passes: one call instead of ~60 Python attribute reads. The key is a
// function of shapes and strides, not of addresses, so the memory-overlap rule (../_overlap.py,
// `rules` names the written arguments) runs here on every call. Anything but a plain
// torch.Tensor / nn.Parameter (a subclass, a non-tensor), a tensor without strides, a tensor that
// requires grad while grad mode is on, or a written tensor that may overlap another argument
// gives None: the checked path handles (or names) it.

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <torch/extension.h>
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
  int64_t s[16], lo[16], hi[16], reach[17];
  size_t n = 0;
  int budget = 4096;
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

bool may_overlap(const View& a, const View& b) {
  if (a.lo == a.hi || b.lo == b.hi || a.lo >= b.hi || b.lo >= a.hi) return false;
  const intptr_t diff = static_cast<intptr_t>(b.ptr) - static_cast<intptr_t>(a.ptr);
  if (a.sizes.size() != b.sizes.size() || a.strides != b.strides || a.elsize != b.elsize ||
      diff % a.elsize != 0 || a.sizes.size() > 16)
    return true;
  Lattice L;
  for (size_t d = 0; d < a.sizes.size(); ++d) {
    const int64_t st = a.strides[d], n = a.sizes[d], m = b.sizes[d];
    if (st == 0 || (n == 1 && m == 1)) continue;
    size_t i = L.n++;
    L.s[i] = std::abs(st);
    L.lo[i] = st > 0 ? -(m - 1) : -(n - 1);
    L.hi[i] = st > 0 ? n - 1 : m - 1;
    for (; i > 0 && L.s[i - 1] < L.s[i]; --i) {  // keep strides descending
      std::swap(L.s[i - 1], L.s[i]);
      std::swap(L.lo[i - 1], L.lo[i]);
      std::swap(L.hi[i - 1], L.hi[i]);
    }
  }
  L.reach[L.n] = 0;
  for (size_t k = L.n; k-- > 0;) L.reach[k] = L.reach[k + 1] + L.s[k] * std::max(-L.lo[k], L.hi[k]);
  return L.hit(0, diff / a.elsize);
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
    for (Py_ssize_t o = 0; o < n; ++o) {
      if (o == w || !views[o].present) continue;
      if (pair_ok(w, static_cast<int>(o)) && identical(views[w], views[o])) continue;
      if (may_overlap(views[w], views[o])) return false;
    }
  }
  return true;
}

}  // namespace

// signature(rules, *tensors): see the top of this file; rules as in disjoint(). None also when
// a written tensor may overlap another (the checked path reports which).
static PyObject* qk_signature(PyObject*, PyObject* const* all_args, Py_ssize_t all_n) {
  constexpr size_t CAP = 512;  // int64 words: 6 + 2 * ndim per tensor, far above 16 tensors
  constexpr Py_ssize_t MAX_TENSORS = 32;
  if (all_n < 1 || !PyBytes_Check(all_args[0]) || all_n - 1 > MAX_TENSORS) {
    PyErr_SetString(PyExc_TypeError, "signature(rules: bytes, *tensors) (at most 32 tensors)");
    return nullptr;
  }
  PyObject* const* args = all_args + 1;
  const Py_ssize_t nargs = all_n - 1;
  View views[MAX_TENSORS];
  int64_t buf[CAP];
  size_t n = 0;
  PyObject* addrs = PyList_New(nargs);
  if (!addrs) return nullptr;
  try {
    for (Py_ssize_t i = 0; i < nargs; ++i) {
      PyObject* obj = args[i];
      if (obj == Py_None) {
        if (n + 1 > CAP) { Py_DECREF(addrs); Py_RETURN_NONE; }
        buf[n++] = -1;
        Py_INCREF(Py_None);
        PyList_SET_ITEM(addrs, i, Py_None);
        continue;
      }
      if (!THPVariable_CheckExact(obj)) { Py_DECREF(addrs); Py_RETURN_NONE; }
      const at::Tensor& t = THPVariable_Unpack(obj);
      // The ops have no backward: the checked path refuses what autograd would record.
      if (t.requires_grad() && at::GradMode::is_enabled()) { Py_DECREF(addrs); Py_RETURN_NONE; }
      const int64_t nd = t.dim();
      if (n + 6 + 2 * static_cast<size_t>(nd) > CAP) { Py_DECREF(addrs); Py_RETURN_NONE; }
      auto sizes = t.sizes();
      auto strides = t.strides();
      buf[n++] = static_cast<int64_t>(t.scalar_type());
      buf[n++] = static_cast<int64_t>(t.device().type());
      buf[n++] = t.device().index();
      buf[n++] = nd;
      for (int64_t d = 0; d < nd; ++d) buf[n++] = sizes[d];
      for (int64_t d = 0; d < nd; ++d) buf[n++] = strides[d];
      const auto p = reinterpret_cast<uintptr_t>(t.const_data_ptr());
      buf[n++] = (p % 16) == 0;
      views[i] = View(p, static_cast<int64_t>(t.element_size()), sizes, strides);
      PyObject* a = PyLong_FromUnsignedLongLong(p);
      if (!a) { Py_DECREF(addrs); return nullptr; }
      PyList_SET_ITEM(addrs, i, a);
    }
  } catch (const std::exception&) {  // e.g. sparse or nested tensors: no strides
    Py_DECREF(addrs);
    Py_RETURN_NONE;
  }
  if (!disjoint(PyBytes_AS_STRING(all_args[0]), PyBytes_GET_SIZE(all_args[0]), views, nargs)) {
    Py_DECREF(addrs);
    Py_RETURN_NONE;
  }
  PyObject* key =
      PyBytes_FromStringAndSize(reinterpret_cast<const char*>(buf), n * sizeof(int64_t));
  if (!key) { Py_DECREF(addrs); return nullptr; }
  PyObject* out = PyTuple_Pack(2, key, addrs);
  Py_DECREF(key);
  Py_DECREF(addrs);
  return out;
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


// ---------------------------------------------------------------------------------------------
// Launch plans. make_launch(...) packs a compiled kernel's parameters once; launch(plan, stream,
// *varying) writes the per-call ones (addresses, eps) into their slots and calls cuLaunchKernel.
// The plan knows nothing of Triton: Python describes each parameter with one kind character
// (_launch.param_kinds), and the driver's own parameter table (cuFuncGetParamInfo)
// must agree with it, count and sizes, or no plan is made (the caller keeps Triton's launcher).
// libcuda is opened at run time, so this file builds on machines without CUDA (CI) too.
// ---------------------------------------------------------------------------------------------
namespace {

using CUresult_t = int;
constexpr CUresult_t kSuccess = 0;
constexpr CUresult_t kInvalidContext = 201;  // CUDA_ERROR_INVALID_CONTEXT
using LaunchKernel = CUresult_t (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, unsigned, void*, void**, void**);
using FuncGetParamInfo = CUresult_t (*)(void*, size_t, size_t*, size_t*);
using GetErrorString = CUresult_t (*)(CUresult_t, const char**);
using DeviceGet = CUresult_t (*)(int*, int);
using PrimaryCtxRetain = CUresult_t (*)(void**, int);
using CtxSetCurrent = CUresult_t (*)(void*);

struct Driver {
  LaunchKernel launch = nullptr;
  FuncGetParamInfo param_info = nullptr;
  GetErrorString error_string = nullptr;
  DeviceGet device_get = nullptr;
  PrimaryCtxRetain ctx_retain = nullptr;
  CtxSetCurrent ctx_set = nullptr;
  bool ok = false;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return r;
    r.launch = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
    r.param_info = reinterpret_cast<FuncGetParamInfo>(dlsym(lib, "cuFuncGetParamInfo"));
    r.error_string = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
    r.device_get = reinterpret_cast<DeviceGet>(dlsym(lib, "cuDeviceGet"));
    r.ctx_retain = reinterpret_cast<PrimaryCtxRetain>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    r.ctx_set = reinterpret_cast<CtxSetCurrent>(dlsym(lib, "cuCtxSetCurrent"));
    r.ok = r.launch && r.param_info && r.error_string && r.device_get && r.ctx_retain && r.ctx_set;
    return r;
  }();
  return d;
}

size_t kind_size(char k) {
  switch (k) {
    case 'p': case 'l': case 'L': case 'd': return 8;
    case 'i': case 'I': case 'f': return 4;
    case 'h': case 'H': return 2;
    case 'b': case 'B': return 1;
    case 'c': return 0;  // a constexpr: not a kernel parameter
    default: return SIZE_MAX;
  }
}

// Writes obj, as kind k, into an 8-byte slot; false (with a Python error set) if it does not fit.
bool store(char k, PyObject* obj, uint64_t* slot) {
  *slot = 0;
  if (k == 'f' || k == 'd') {
    const double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred()) return false;
    if (k == 'f') {
      const float f = static_cast<float>(v);  // as Triton's launcher packs an fp32 scalar
      std::memcpy(slot, &f, 4);
    } else {
      std::memcpy(slot, &v, 8);
    }
    return true;
  }
  if (k == 'p' && obj == Py_None) return true;  // a null pointer
  if (k == 'p' || k == 'L' || k == 'I' || k == 'H' || k == 'B') {
    const unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return false;
    const size_t n = kind_size(k);
    if (n < 8 && v >> (8 * n)) {
      PyErr_SetString(PyExc_OverflowError, "kernel argument out of range");
      return false;
    }
    std::memcpy(slot, &v, n);  // little-endian: the low bytes
    return true;
  }
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) return false;
  const size_t n = kind_size(k);
  const long long lim = n < 8 ? (1LL << (8 * n - 1)) : 0;
  if (n < 8 && (v < -lim || v >= lim)) {
    PyErr_SetString(PyExc_OverflowError, "kernel argument out of range");
    return false;
  }
  std::memcpy(slot, &v, n);
  return true;
}

struct LaunchPlan {
  void* function;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  int device;
  std::string kinds;              // one per argument, constexprs included
  std::vector<uint64_t> slots;    // one per argument (constexpr slots unused)
  std::vector<void*> params;      // the kernel parameters: the non-constexpr slots, in order
  std::vector<size_t> varying;    // the arguments that come with each call, in call order
};

void free_plan(PyObject* capsule) {
  delete static_cast<LaunchPlan*>(PyCapsule_GetPointer(capsule, "qkrope.LaunchPlan"));
}

LaunchPlan* plan_of(PyObject* capsule) {
  return static_cast<LaunchPlan*>(PyCapsule_GetPointer(capsule, "qkrope.LaunchPlan"));
}

// Fills the per-call slots from args[0..nargs); false with a Python error set on a bad call.
bool fill(LaunchPlan* plan, PyObject* const* args, Py_ssize_t nargs) {
  if (static_cast<size_t>(nargs) != plan->varying.size()) {
    PyErr_Format(PyExc_TypeError, "expected %zu per-call arguments, got %zd",
                 plan->varying.size(), nargs);
    return false;
  }
  for (size_t i = 0; i < plan->varying.size(); ++i) {
    const size_t slot = plan->varying[i];
    if (!store(plan->kinds[slot], args[i], &plan->slots[slot])) return false;
  }
  return true;
}

}  // namespace

// make_launch(function, grid_x, grid_y, grid_z, block_x, shared_bytes, device, kinds, values,
//             varying, check_driver=True) -> plan capsule | None
// values: one per kind; varying: the indices of the arguments each call passes, in call order
// (their entries in values are ignored);
// None when libcuda is missing or its parameter table disagrees with ``kinds``
// (check_driver=False skips both: for tests of the packing on machines without a GPU).
static PyObject* qk_make_launch(PyObject*, PyObject* args) {
  unsigned long long function;
  unsigned gx, gy, gz, block, shared;
  int device, check = 1;
  PyObject* kinds_obj;
  PyObject* values;
  PyObject* varying;
  if (!PyArg_ParseTuple(args, "KIIIIIiUOO|p", &function, &gx, &gy, &gz, &block, &shared,
                        &device, &kinds_obj, &values, &varying, &check))
    return nullptr;
  Py_ssize_t n_kinds = 0;
  const char* kinds = PyUnicode_AsUTF8AndSize(kinds_obj, &n_kinds);
  if (!kinds) return nullptr;
  if (!PyTuple_Check(values) || PyTuple_GET_SIZE(values) != n_kinds || !PyTuple_Check(varying)) {
    PyErr_SetString(PyExc_ValueError,
                    "values must be a tuple with one value per kind, varying a tuple");
    return nullptr;
  }
  auto plan = std::make_unique<LaunchPlan>();
  plan->function = reinterpret_cast<void*>(function);
  plan->grid[0] = gx; plan->grid[1] = gy; plan->grid[2] = gz;
  plan->block = block;
  plan->shared = shared;
  plan->device = device;
  plan->kinds.assign(kinds, n_kinds);
  plan->slots.assign(n_kinds, 0);
  std::vector<bool> per_call(n_kinds, false);
  for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(varying); ++j) {
    const Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(varying, j));
    if (i == -1 && PyErr_Occurred()) return nullptr;
    if (i < 0 || i >= n_kinds || kind_size(kinds[i]) == 0 || kind_size(kinds[i]) == SIZE_MAX ||
        per_call[i]) {
      PyErr_SetString(PyExc_ValueError, "varying must name distinct non-constexpr arguments");
      return nullptr;
    }
    per_call[i] = true;
    plan->varying.push_back(static_cast<size_t>(i));
  }
  for (Py_ssize_t i = 0; i < n_kinds; ++i) {
    const size_t size = kind_size(kinds[i]);
    if (size == SIZE_MAX) {
      PyErr_Format(PyExc_ValueError, "unknown parameter kind %c", kinds[i]);
      return nullptr;
    }
    if (size == 0) continue;
    plan->params.push_back(&plan->slots[i]);
    if (!per_call[i] && !store(kinds[i], PyTuple_GET_ITEM(values, i), &plan->slots[i]))
      return nullptr;
  }
  if (check) {
    const Driver& d = driver();
    if (!d.ok) Py_RETURN_NONE;
    size_t p = 0;
    for (Py_ssize_t i = 0; i < n_kinds; ++i) {
      const size_t size = kind_size(kinds[i]);
      if (size == 0) continue;
      size_t offset = 0, driver_size = 0;
      if (d.param_info(plan->function, p++, &offset, &driver_size) != kSuccess ||
          driver_size != size)
        Py_RETURN_NONE;
    }
    // And no parameter beyond ours: CUDA 13.0's driver (580) exports no parameter count, so
    // describing parameter p must fail, an API error that compute-sanitizer reports as such.
    size_t offset = 0, driver_size = 0;
    if (d.param_info(plan->function, p, &offset, &driver_size) == kSuccess) Py_RETURN_NONE;
  }
  return PyCapsule_New(plan.release(), "qkrope.LaunchPlan", free_plan);
}

// launch(plan, stream, *varying): one cuLaunchKernel, GIL held (a few µs; it also keeps two
// threads from filling the plan's slots at once).
static PyObject* qk_launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, "launch(plan, stream, *per_call_arguments)");
    return nullptr;
  }
  LaunchPlan* plan = plan_of(args[0]);
  if (!plan) return nullptr;
  const unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
  if (stream == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
  if (!fill(plan, args + 2, nargs - 2)) return nullptr;
  if (plan->grid[0] == 0 || plan->grid[1] == 0 || plan->grid[2] == 0) Py_RETURN_NONE;
  const Driver& d = driver();
  if (!d.ok) {
    PyErr_SetString(PyExc_RuntimeError, "libcuda.so.1 is not available");
    return nullptr;
  }
  auto go = [&] {
    return d.launch(plan->function, plan->grid[0], plan->grid[1], plan->grid[2], plan->block, 1,
                    1, plan->shared, reinterpret_cast<void*>(stream), plan->params.data(),
                    nullptr);
  };
  CUresult_t r = go();
  if (r == kInvalidContext) {  // a thread that never used CUDA: make the primary context current
    int dev = 0;
    void* ctx = nullptr;
    if (d.device_get(&dev, plan->device) == kSuccess && d.ctx_retain(&ctx, dev) == kSuccess &&
        d.ctx_set(ctx) == kSuccess)
      r = go();
  }
  if (r != kSuccess) {
    const char* msg = nullptr;
    d.error_string(r, &msg);
    PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed: %s (%d)", msg ? msg : "?", r);
    return nullptr;
  }
  Py_RETURN_NONE;
}

// params(plan, *varying) -> bytes: the kernel parameters a launch would pass, each at its own
// size, concatenated (what the tests compare with struct.pack).
static PyObject* qk_params(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "params(plan, *per_call_arguments)");
    return nullptr;
  }
  LaunchPlan* plan = plan_of(args[0]);
  if (!plan || !fill(plan, args + 1, nargs - 1)) return nullptr;
  std::string out;
  for (size_t i = 0; i < plan->kinds.size(); ++i)
    out.append(reinterpret_cast<const char*>(&plan->slots[i]), kind_size(plan->kinds[i]));
  return PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
}

// overlap_ok(rules, *tensors) -> bool: signature()'s overlap rule alone, for the tests.
static PyObject* qk_overlap_ok(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr Py_ssize_t MAX_TENSORS = 32;
  if (nargs < 1 || !PyBytes_Check(args[0]) || nargs - 1 > MAX_TENSORS) {
    PyErr_SetString(PyExc_TypeError, "overlap_ok(rules: bytes, *tensors)");
    return nullptr;
  }
  View views[MAX_TENSORS];
  for (Py_ssize_t i = 1; i < nargs; ++i) {
    if (args[i] == Py_None) continue;
    if (!THPVariable_Check(args[i])) {
      PyErr_SetString(PyExc_TypeError, "overlap_ok: tensors or None");
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(args[i]);
    views[i - 1] = View(reinterpret_cast<uintptr_t>(t.const_data_ptr()),
                        static_cast<int64_t>(t.element_size()), t.sizes(), t.strides());
  }
  return PyBool_FromLong(disjoint(PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]), views,
                                  nargs - 1));
}

static PyMethodDef methods[] = {
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_signature)),
     METH_FASTCALL, "signature(rules, *tensors) -> (bytes, list of addresses) | None"},
    {"overlap_ok", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_overlap_ok)),
     METH_FASTCALL, "overlap_ok(rules, *tensors) -> bool (the signature's overlap rule alone)"},
    {"outputs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_outputs)),
     METH_FASTCALL, "outputs(like_1..like_n, given_1..given_n) -> (out_1..out_n, int_1..int_n)"},
    {"make_launch", qk_make_launch, METH_VARARGS,
     "make_launch(function, gx, gy, gz, block, shared, device, kinds, values, varying"
     "[, check_driver]) -> plan | None"},
    {"launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_launch)),
     METH_FASTCALL, "launch(plan, stream, *per_call_arguments)"},
    {"params", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_params)),
     METH_FASTCALL, "params(plan, *per_call_arguments) -> bytes"},
    {nullptr, nullptr, 0, nullptr}};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (PyModule_AddFunctions(m.ptr(), methods) < 0) throw pybind11::error_already_set();
}
