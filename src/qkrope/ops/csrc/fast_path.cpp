// Native helpers of the direct-launch fast path (see ../_native.py): the call's signature and
// its fresh outputs, each in one C++ call instead of dozens of Python attribute reads.
//
// signature(*args) reads, for each argument, what Triton specialises on and what the ops' checks
// look at -- dtype, device, sizes, strides, 16-byte alignment of the data pointer -- straight
// from the TensorImpl, and packs them into one bytes object (the lookup key), plus the data
// addresses the launch passes. Python spends ~0.15 us per attribute read on the H200 test host,
// 60 of them per call; this is one call. Anything but a plain torch.Tensor / nn.Parameter (a
// subclass, a non-tensor) or a tensor without strides gives None: the checked path handles it.

#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

static PyObject* qk_signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr size_t CAP = 512;  // int64 words: 6 + 2 * ndim per tensor, far above 16 tensors
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
      PyObject* a = PyLong_FromUnsignedLongLong(p);
      if (!a) { Py_DECREF(addrs); return nullptr; }
      PyList_SET_ITEM(addrs, i, a);
    }
  } catch (const std::exception&) {  // e.g. sparse or nested tensors: no strides
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

// outputs(query, key, query_out, key_out) -> (query_out, key_out, address, address): each
// output not given (None) is allocated contiguous with the shape and options of its input, as
// torch.empty_like(x, memory_format=torch.contiguous_format) does, minus Python's argument
// parsing (~4 us per call on the H200 test host). Called only after signature() accepted all
// four, so each is a plain tensor or None.
static PyObject* qk_outputs(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS  // c10 errors (e.g. out of memory) reach Python as torch's own exceptions
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "outputs(query, key, query_out, key_out)");
    return nullptr;
  }
  THPObjectPtr outs[2];
  unsigned long long addrs[2];
  for (int i = 0; i < 2; ++i) {
    PyObject* given = args[2 + i];
    if (given != Py_None) {
      addrs[i] = reinterpret_cast<uintptr_t>(THPVariable_Unpack(given).const_data_ptr());
      Py_INCREF(given);
      outs[i] = given;
    } else {
      const at::Tensor& like = THPVariable_Unpack(args[i]);
      at::Tensor t = at::empty(like.sizes(), like.options());
      addrs[i] = reinterpret_cast<uintptr_t>(t.const_data_ptr());
      outs[i] = THPVariable_Wrap(std::move(t));
      if (!outs[i]) return nullptr;
    }
  }
  return Py_BuildValue("(NNKK)", outs[0].release(), outs[1].release(), addrs[0], addrs[1]);
  END_HANDLE_TH_ERRORS
}

static PyMethodDef methods[] = {
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_signature)),
     METH_FASTCALL, "signature(*tensors) -> (bytes, list of addresses) | None"},
    {"outputs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(qk_outputs)),
     METH_FASTCALL, "outputs(query, key, query_out, key_out) -> (query_out, key_out, int, int)"},
    {nullptr, nullptr, 0, nullptr}};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (PyModule_AddFunctions(m.ptr(), methods) < 0) throw pybind11::error_already_set();
}
