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

// A capsule holds a shared reference: the registered ops' table (below) may keep a plan that
// Python has dropped.
using PlanRef = std::shared_ptr<LaunchPlan>;

void free_plan(PyObject* capsule) {
  delete static_cast<PlanRef*>(PyCapsule_GetPointer(capsule, "qkrope.LaunchPlan"));
}

PlanRef* plan_ref(PyObject* capsule) {
  return static_cast<PlanRef*>(PyCapsule_GetPointer(capsule, "qkrope.LaunchPlan"));
}

LaunchPlan* plan_of(PyObject* capsule) {
  PlanRef* ref = plan_ref(capsule);
  return ref ? ref->get() : nullptr;
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

// One cuLaunchKernel of ``plan`` with ``params`` (one pointer per kernel parameter); a thread
// that never used CUDA gets the device's primary context made current first.
CUresult_t launch_kernel(const LaunchPlan& plan, void* stream, void** params) {
  const Driver& d = driver();
  auto go = [&] {
    return d.launch(plan.function, plan.grid[0], plan.grid[1], plan.grid[2], plan.block, 1, 1,
                    plan.shared, stream, params, nullptr);
  };
  CUresult_t r = go();
  if (r == kInvalidContext) {
    int dev = 0;
    void* ctx = nullptr;
    if (d.device_get(&dev, plan.device) == kSuccess && d.ctx_retain(&ctx, dev) == kSuccess &&
        d.ctx_set(ctx) == kSuccess)
      r = go();
  }
  return r;
}

std::string launch_error(CUresult_t r) {
  const char* msg = nullptr;
  driver().error_string(r, &msg);
  return std::string("cuLaunchKernel failed: ") + (msg ? msg : "?") + " (" + std::to_string(r) +
         ")";
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
  auto* ref = new PlanRef(std::move(plan));
  PyObject* capsule = PyCapsule_New(ref, "qkrope.LaunchPlan", free_plan);
  if (!capsule) delete ref;
  return capsule;
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
  const CUresult_t r = launch_kernel(*plan, reinterpret_cast<void*>(stream), plan->params.data());
  if (r != kSuccess) {
    PyErr_SetString(PyExc_RuntimeError, launch_error(r).c_str());
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
