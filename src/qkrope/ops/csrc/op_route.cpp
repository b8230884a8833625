// ---------------------------------------------------------------------------------------------
// The registered op's CUDA kernel (docs/design.md, "Compile route"). Inside a compiled graph each
// call of a registered op goes through the dispatcher; with the op's body in Python that meant
// boxing its ~20 arguments into Python objects, running the body, and unpacking them again for
// signature() and launch(). serve_op() registers this C++ kernel for the op on CUDA instead: it
// reads the boxed arguments in place, takes the plan a checked launch remembered for the call's
// signature (add_plan, same key as the eager fast path) and launches it; on any miss it calls
// the op's twin "<op>_checked", whose kernel is the Python body (checks, launch, remember).
// The op's schema must be: the launcher's pointer arguments in per-call order (Tensor or
// Tensor?), its per-call scalars (float), then one str of options, the plan key's first part.
// ---------------------------------------------------------------------------------------------
namespace {

struct Route {
  std::string rules;                  // as in disjoint()
  size_t n_tensors = 0, n_scalars = 0;
  std::optional<c10::OperatorHandle> checked;
  std::mutex mu;                      // guards plans
  std::unordered_map<std::string, PlanRef> plans;  // options '\0' signature -> plan
  std::atomic<uint64_t> launched{0}, handed_on{0};  // calls through a plan / to the twin
};

constexpr size_t kMaxRoutePlans = 4096;  // as KernelLauncher.MAX_PLANS
constexpr size_t kMaxKinds = 256;

// The served ops (by name) and their registrations, for the life of the process: never
// destroyed, so no kernel is deregistered from the dispatcher during static destruction at exit,
// whatever the order in which libraries tear down.
std::mutex& routes_mu = *new std::mutex;
auto& routes = *new std::unordered_map<std::string, std::shared_ptr<Route>>;
auto& route_libraries = *new std::vector<std::unique_ptr<torch::Library>>;

std::shared_ptr<Route> route_of(const std::string& op) {
  std::lock_guard<std::mutex> g(routes_mu);
  auto it = routes.find(op);
  return it == routes.end() ? nullptr : it->second;
}

// The plan for this call and its per-call values, or null (the checked twin then takes it).
PlanRef find_plan(Route& route, c10::ArrayRef<c10::IValue> args, uint64_t* values) {
  const size_t nt = route.n_tensors, ns = route.n_scalars;
  if (args.size() != nt + ns + 1 || nt > static_cast<size_t>(kMaxTensors) || !args.back().isString())
    return nullptr;
  View views[kMaxTensors];
  int64_t buf[kKeyWords];
  size_t n = 0;
  try {
    for (size_t i = 0; i < nt; ++i) {
      const c10::IValue& a = args[i];
      if (a.isNone()) {
        if (n + 1 > kKeyWords) return nullptr;
        buf[n++] = -1;
        values[i] = 0;
        continue;
      }
      if (!a.isTensor() || !pack_tensor(a.toTensor(), buf, n, kKeyWords, views[i])) return nullptr;
      values[i] = views[i].ptr;
    }
  } catch (const std::exception&) {  // no strides: the checked path names it
    return nullptr;
  }
  for (size_t j = 0; j < ns; ++j) {  // 0 or a positive normal float32, as KernelLauncher.fast_call
    const c10::IValue& a = args[nt + j];
    if (!a.isDouble()) return nullptr;
    const double x = a.toDouble();
    if (!(x == 0.0 || (x >= 0x1p-126 && x <= 3.4028234663852886e38))) return nullptr;
    const float f = static_cast<float>(x);
    values[nt + j] = 0;
    std::memcpy(&values[nt + j], &f, 4);
  }
  if (!disjoint(route.rules.data(), static_cast<Py_ssize_t>(route.rules.size()), views,
                static_cast<Py_ssize_t>(nt)))
    return nullptr;
  const std::string& options = args.back().toStringRef();
  std::string key;
  key.reserve(options.size() + 1 + n * sizeof(int64_t));
  key.append(options).push_back('\0');
  key.append(reinterpret_cast<const char*>(buf), n * sizeof(int64_t));
  std::lock_guard<std::mutex> g(route.mu);
  auto it = route.plans.find(key);
  return it == route.plans.end() ? nullptr : it->second;
}

// The raw handle (cudaStream_t) of a current stream: c10::Stream::native_handle() where the
// installed torch has it, else what Python's launchers call (torch._C._cuda_getCurrentRawStream).
template <typename S, typename = void>
struct HasNativeHandle : std::false_type {};
template <typename S>
struct HasNativeHandle<S, std::void_t<decltype(std::declval<const S&>().native_handle())>>
    : std::true_type {};

template <typename S>
void* current_stream(const S& stream) {
  if constexpr (HasNativeHandle<S>::value) {
    return stream.native_handle();
  } else {
    pybind11::gil_scoped_acquire gil;
    THPObjectPtr torch_c(PyImport_ImportModule("torch._C"));
    THPObjectPtr handle(torch_c ? PyObject_CallMethod(torch_c.get(), "_cuda_getCurrentRawStream",
                                                      "i", int(stream.device_index()))
                                : nullptr);
    if (!handle) throw python_error();
    const unsigned long long raw = PyLong_AsUnsignedLongLong(handle.get());
    if (PyErr_Occurred()) throw python_error();
    return reinterpret_cast<void*>(raw);
  }
}

// The plan takes the route's per-call values: pointers, then float32 scalars.
bool matches(const LaunchPlan& plan, size_t nt, size_t ns) {
  if (plan.kinds.size() > kMaxKinds || plan.varying.size() != nt + ns) return false;
  for (size_t i = 0; i < nt + ns; ++i)
    if (plan.kinds[plan.varying[i]] != (i < nt ? 'p' : 'f')) return false;
  return true;
}

struct RouteKernel final : c10::OperatorKernel {
  explicit RouteKernel(std::shared_ptr<Route> r) : route(std::move(r)) {}
  std::shared_ptr<Route> route;

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t nargs = op.schema().arguments().size();
    uint64_t values[kMaxTensors + 8];
    // (serve_op bounds n_scalars by 8; add_plan keeps only plans that match the route)
    const PlanRef plan = find_plan(*route, torch::jit::last(*stack, nargs), values);
    if (!plan) {
      route->handed_on.fetch_add(1, std::memory_order_relaxed);
      route->checked->callBoxed(stack);  // the Python body: checks, launch, remember
      return;
    }
    // The plan's own slots are filled by Python's launch() under the GIL; this call, which may
    // run without it, fills a copy.
    uint64_t slots[kMaxKinds];
    void* params[kMaxKinds];
    size_t np = 0;
    std::copy(plan->slots.begin(), plan->slots.end(), slots);
    for (size_t i = 0; i < plan->varying.size(); ++i) slots[plan->varying[i]] = values[i];
    for (size_t i = 0; i < plan->kinds.size(); ++i)
      if (kind_size(plan->kinds[i]) != 0) params[np++] = &slots[i];
    if (plan->grid[0] && plan->grid[1] && plan->grid[2]) {
      TORCH_CHECK(driver().ok, "qkrope: libcuda.so.1 is not available");
      const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(plan->device));
      c10::DeviceGuard guard(device);
      void* stream = current_stream(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA)
                                        .getStream(device));
      const CUresult_t r = launch_kernel(*plan, stream, params);
      TORCH_CHECK(r == kSuccess, "qkrope: ", launch_error(r));
    }
    // As the Python body does: what the kernel wrote gets a new version.
    auto args = torch::jit::last(*stack, nargs);
    const size_t W = route->rules.empty() ? 0 : static_cast<unsigned char>(route->rules[0]);
    for (size_t i = 0; i < W && 1 + i < route->rules.size(); ++i) {
      const size_t w = static_cast<unsigned char>(route->rules[1 + i]);
      if (w < args.size() && args[w].isTensor())
        torch::autograd::impl::bump_version(args[w].toTensor());
    }
    torch::jit::drop(*stack, nargs);
    route->launched.fetch_add(1, std::memory_order_relaxed);
  }
};

}  // namespace

// serve_op(op, checked_op, rules, n_tensors, n_scalars, dispatch_key="CUDA"): register the
// route's kernel for op (e.g. "qkrope::qknorm_rope") on dispatch_key; checked_op takes every
// call without a plan. Once per op and process (later calls return False).
static PyObject* qk_serve_op(PyObject*, PyObject* args) {
  const char* op;
  const char* checked;
  const char* key = "CUDA";
  Py_buffer rules;
  Py_ssize_t nt, ns;
  if (!PyArg_ParseTuple(args, "ssy*nn|s", &op, &checked, &rules, &nt, &ns, &key)) return nullptr;
  std::string rule_bytes(static_cast<const char*>(rules.buf), rules.len);
  PyBuffer_Release(&rules);
  HANDLE_TH_ERRORS
  if (nt < 0 || nt > kMaxTensors || ns < 0 || ns > 8) {
    PyErr_SetString(PyExc_ValueError, "serve_op: at most 32 tensors and 8 scalars");
    return nullptr;
  }
  const std::string name(op);
  const auto sep = name.find("::");
  TORCH_CHECK(sep != std::string::npos, "serve_op: a qualified op name, got ", name);
  std::lock_guard<std::mutex> g(routes_mu);
  if (routes.count(name)) Py_RETURN_FALSE;
  auto route = std::make_shared<Route>();
  route->rules = std::move(rule_bytes);
  route->n_tensors = static_cast<size_t>(nt);
  route->n_scalars = static_cast<size_t>(ns);
  route->checked = c10::Dispatcher::singleton().findSchemaOrThrow(checked, "");
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, name.substr(0, sep),
                                               c10::parseDispatchKey(key), __FILE__, __LINE__);
  lib->impl(name.substr(sep + 2).c_str(),
            torch::CppFunction::makeFromBoxedFunctor(std::make_unique<RouteKernel>(route)));
  route_libraries.push_back(std::move(lib));
  routes.emplace(name, std::move(route));
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// add_plan(op, options, signature, plan): the plan for calls of op with these options (str)
// and signature (bytes, as signature() packs it). False when op is not served or the plan's
// per-call parameters are not the route's (pointers, then float32 scalars).
static PyObject* qk_add_plan(PyObject*, PyObject* args) {
  const char* op;
  PyObject* options;
  PyObject* signature;
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "sUSO", &op, &options, &signature, &capsule)) return nullptr;
  PlanRef* ref = plan_ref(capsule);
  if (!ref) return nullptr;
  auto route = route_of(op);
  if (!route || !matches(**ref, route->n_tensors, route->n_scalars)) Py_RETURN_FALSE;
  Py_ssize_t len = 0;
  const char* text = PyUnicode_AsUTF8AndSize(options, &len);
  if (!text) return nullptr;
  std::string key(text, len);
  key.push_back('\0');
  key.append(PyBytes_AS_STRING(signature), PyBytes_GET_SIZE(signature));
  std::lock_guard<std::mutex> g(route->mu);
  if (route->plans.size() >= kMaxRoutePlans) route->plans.clear();
  route->plans[key] = *ref;
  Py_RETURN_TRUE;
}

// route_stats(op) -> (plans, calls launched from a plan, calls handed to the twin), or None
// when op is not served.
static PyObject* qk_route_stats(PyObject*, PyObject* args) {
  const char* op;
  if (!PyArg_ParseTuple(args, "s", &op)) return nullptr;
  auto route = route_of(op);
  if (!route) Py_RETURN_NONE;
  size_t plans;
  {
    std::lock_guard<std::mutex> g(route->mu);
    plans = route->plans.size();
  }
  return Py_BuildValue("(nKK)", static_cast<Py_ssize_t>(plans),
                       static_cast<unsigned long long>(route->launched.load()),
                       static_cast<unsigned long long>(route->handed_on.load()));
}

// clear_plans(op=None): forget op's plans (every served op's when None): its calls take the
// checked twin until a checked launch adds a plan again.
static PyObject* qk_clear_plans(PyObject*, PyObject* args) {
  const char* op = nullptr;
  if (!PyArg_ParseTuple(args, "|z", &op)) return nullptr;
  std::vector<std::shared_ptr<Route>> targets;
  {
    std::lock_guard<std::mutex> g(routes_mu);
    for (auto& [name, route] : routes)
      if (op == nullptr || name == op) targets.push_back(route);
  }
  for (auto& route : targets) {
    std::lock_guard<std::mutex> g(route->mu);
    route->plans.clear();
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_signature)),
     METH_FASTCALL, "signature(rules, *tensors) -> (bytes, list of addresses) | None"},
    {"overlap_ok", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_overlap_ok)),
     METH_FASTCALL, "overlap_ok(rules, *tensors) -> bool (the signature's overlap rule alone)"},
    {"outputs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_outputs)),
     METH_FASTCALL, "outputs(like_1..like_n, given_1..given_n) -> (out_1..out_n, int_1..int_n)"},
    {"bump", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_bump)),
     METH_FASTCALL, "bump(written: bytes, inputs, outputs)"},
    {"keep_scalar",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_keep_scalar)),
     METH_FASTCALL, "keep_scalar(value: float, tensor): what a float stands for in signature()"},
    {"make_launch", qk_make_launch, METH_VARARGS,
     "make_launch(function, gx, gy, gz, block, shared, device, kinds, values, varying"
     "[, check_driver]) -> plan | None"},
    {"launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_launch)),
     METH_FASTCALL, "launch(plan, stream, *per_call_arguments)"},
    {"params", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_params)),
     METH_FASTCALL, "params(plan, *per_call_arguments) -> bytes"},
    {"serve_op", qk_serve_op, METH_VARARGS,
     "serve_op(op, checked_op, rules, n_tensors, n_scalars[, dispatch_key]) -> bool"},
    {"add_plan", qk_add_plan, METH_VARARGS, "add_plan(op, options, signature, plan) -> bool"},
    {"route_stats", qk_route_stats, METH_VARARGS,
     "route_stats(op) -> (plans, launched, handed_on) | None"},
    {"clear_plans", qk_clear_plans, METH_VARARGS, "clear_plans(op=None)"},
    {nullptr, nullptr, 0, nullptr}};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (PyModule_AddFunctions(m.ptr(), methods) < 0) throw pybind11::error_already_set();
}
