/* Tensor storage and the hot paths: the import (from_dlpack of a NumPy array, or of an
 * object publishing the DLPack C exchange API), the export (__dlpack__ of host data with
 * no stream, copy or device change), the release when a Tensor goes (tp_dealloc), and
 * the exchange API this library publishes on its own Tensor.
 *
 * exchange.tensor.Tensor derives from TensorBase and adds everything else in Python
 * (the slow paths, streams, copies); the hot paths here call back into it for any case
 * they do not take (_dlpack_slow, tensor._from_dlpack). Tensors are not GC-tracked: a
 * Tensor refers only to its record, its dtype and its stream, none of which can refer
 * back to it. */
#include "native.h"

#include <string.h>
#include <time.h>
#include <structmember.h>

static PyObject *str_dlpack_slow, *str_check, *kw_names[4], *str_api_producer;

/* -- storage ----------------------------------------------------------------------------- */
PyObject *tensor_new(RecordObject *record, long long token, uintptr_t data_ptr, int ndim, const int64_t *shape,
                     const int64_t *strides, PyObject *dtype, int code, int bits, int readonly, PyObject *stream) {
    PyTypeObject *type = (PyTypeObject *)(S.tensor_type ? S.tensor_type : (PyObject *)&TensorBase_Type);
    TensorObject *t = (TensorObject *)type->tp_alloc(type, ndim);
    if (t == NULL) return NULL;
    Py_INCREF(record);
    t->record = record;
    t->data_ptr = data_ptr;
    Py_INCREF(dtype);
    t->dtype = dtype;
    t->code = (uint8_t)code;
    t->bits = (uint8_t)bits;
    Py_XINCREF(stream);
    t->stream = stream;
    t->readonly = (uint8_t)readonly;
    t->token = token;
    if (ndim) {
        memcpy(t->dims, shape, (size_t)ndim * sizeof(int64_t));
        memcpy(t->dims + ndim, strides, (size_t)ndim * sizeof(int64_t));
    }
    return (PyObject *)t;
}

/* The record's streams get `stream` (its release waits for the work queued on it). */
int tensor_add_stream(RecordObject *record, PyObject *stream) {
    /* as Registry.add_stream: record._streams[id(stream)] = stream (in the __dict__) */
    PyObject *streams = record_streams(record);
    if (streams == NULL) {
        if (PyErr_Occurred()) return -1;
        if (record->dict == NULL && (record->dict = PyDict_New()) == NULL) return -1;
        streams = PyDict_New();
        if (streams == NULL || PyDict_SetItem(record->dict, S.str_streams, streams) < 0) {
            Py_XDECREF(streams);
            return -1;
        }
        Py_DECREF(streams);
    }
    PyObject *key = PyLong_FromVoidPtr(stream);
    if (key == NULL) return -1;
    PyObject *found = PyDict_SetDefault(streams, key, stream);
    Py_DECREF(key);
    return found == NULL ? -1 : 0;
}

/* Tensors are instances of the heap type make_type("tensor") made (or a subclass), which
 * hold a reference to their type. */
static void Tensor_dealloc(TensorObject *t) {
    PyTypeObject *type = Py_TYPE(t);
    if (t->weaklist) PyObject_ClearWeakRefs((PyObject *)t);
    long long token = t->token;
    t->token = 0;
    if (token && t->record) record_remove_holder(t->record, token); /* saves any pending exception */
    Py_CLEAR(t->record);
    Py_CLEAR(t->dtype);
    Py_CLEAR(t->stream);
    type->tp_free((PyObject *)t);
    if (type->tp_flags & Py_TPFLAGS_HEAPTYPE) Py_DECREF(type);
}

static PyObject *Tensor_new_refused(PyTypeObject *t, PyObject *a, PyObject *k) {
    PyErr_SetString(PyExc_TypeError, "tx.Tensor is not made directly: use tx.empty, tx.from_dlpack or tx.borrow");
    return NULL;
}

static int64_t tensor_size(TensorObject *t) {
    int64_t size = 1;
    for (Py_ssize_t i = 0; i < Py_SIZE(t); i++) size *= t->dims[i];
    return size;
}

/* -- attributes (the Python class's private names; its properties check _closed) ----------- */
static PyObject *get_shape(TensorObject *t, void *c) {
    Py_ssize_t n = Py_SIZE(t);
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromLongLong(t->dims[i]);
        if (v == NULL) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *get_strides(TensorObject *t, void *c) {
    Py_ssize_t n = Py_SIZE(t);
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromLongLong(t->dims[n + i]);
        if (v == NULL) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* Bytes of the elements with no closed check: the chain's hop reports, per stage and batch. */
static PyObject *get_nbytes(TensorObject *t, void *c) { return PyLong_FromLongLong(tensor_size(t) * (t->bits / 8)); }

static PyObject *get_data_ptr(TensorObject *t, void *c) { return PyLong_FromVoidPtr((void *)t->data_ptr); }

static PyObject *get_readonly(TensorObject *t, void *c) {
    return t->readonly == 2 ? PyLong_FromLong(2) : PyBool_FromLong(t->readonly);
}

static int set_readonly(TensorObject *t, PyObject *v, void *c) {
    long value = v == Py_True ? 1 : v == Py_False ? 0 : PyLong_AsLong(v);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value < 0 || value > 2) {
        PyErr_SetString(PyExc_ValueError, "_readonly is False, True or 2");
        return -1;
    }
    t->readonly = (uint8_t)value;
    return 0;
}

static PyObject *get_closed(TensorObject *t, void *c) { return PyBool_FromLong(t->closed); }

static int set_closed(TensorObject *t, PyObject *v, void *c) {
    int value = v ? PyObject_IsTrue(v) : 0;
    if (value < 0) return -1;
    t->closed = (uint8_t)value;
    return 0;
}

static PyObject *get_stream(TensorObject *t, void *c) { return Py_NewRef(t->stream ? t->stream : Py_None); }

static int set_stream(TensorObject *t, PyObject *v, void *c) {
    if (v == Py_None) v = NULL;
    Py_XINCREF(v);
    Py_XSETREF(t->stream, v);
    return 0;
}

static PyMemberDef Tensor_members[] = {
    {"_record", T_OBJECT, offsetof(TensorObject, record), READONLY, NULL},
    {"_dtype", T_OBJECT, offsetof(TensorObject, dtype), READONLY, NULL},
    {"_token", T_LONGLONG, offsetof(TensorObject, token), 0, NULL},
    {NULL},
};

static PyGetSetDef Tensor_getset[] = {
    {"_shape", (getter)get_shape, NULL, NULL, NULL},
    {"_strides", (getter)get_strides, NULL, NULL, NULL},
    {"_nbytes", (getter)get_nbytes, NULL, NULL, NULL},
    {"_data_ptr", (getter)get_data_ptr, NULL, NULL, NULL},
    {"_readonly", (getter)get_readonly, (setter)set_readonly, NULL, NULL},
    {"_closed", (getter)get_closed, (setter)set_closed, NULL, NULL},
    {"_stream", (getter)get_stream, (setter)set_stream, NULL, NULL},
    {NULL},
};

/* -- the export hot path ------------------------------------------------------------------- */
static PyObject *last_kwnames; /* the keyword names of the last __dlpack__ call, and their slots */
static int last_slots[4];

static int same_name(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    Py_ssize_t n = PyUnicode_GET_LENGTH(a);
    return n == PyUnicode_GET_LENGTH(b) && PyUnicode_KIND(a) == PyUnicode_KIND(b) &&
           memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n * PyUnicode_KIND(a)) == 0;
}

/* max_version: -1 not an exact 2-tuple of ints (the slow path says why), else whether the
 * capsule is versioned (major >= 1). */
static int versioned_of(PyObject *max_version) {
    if (max_version == Py_None) return 0;
    if (!PyTuple_CheckExact(max_version) || PyTuple_GET_SIZE(max_version) != 2) return -1;
    PyObject *major = PyTuple_GET_ITEM(max_version, 0), *minor = PyTuple_GET_ITEM(max_version, 1);
    if (!PyLong_CheckExact(major) || !PyLong_CheckExact(minor)) return -1;
    long m = PyLong_AsLong(major);
    if (m == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return m >= 1;
}

static PyObject *Tensor_dlpack(TensorObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *values[4] = {Py_None, Py_None, Py_None, Py_None}; /* stream, max_version, dl_device, copy */
    if (nargs != 0) {
        PyErr_SetString(PyExc_TypeError, "__dlpack__() takes keyword arguments only");
        return NULL;
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nkw > 4) {
        PyErr_SetString(PyExc_TypeError, "__dlpack__() takes at most 4 keyword arguments");
        return NULL;
    }
    int slots[4];
    if (kwnames != NULL && kwnames == last_kwnames) {
        memcpy(slots, last_slots, sizeof slots); /* consumers pass the same tuple each call */
    } else {
        for (Py_ssize_t i = 0; i < nkw; i++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, i);
            int k = 0;
            while (k < 4 && !same_name(name, kw_names[k])) k++;
            if (k == 4) {
                PyErr_Format(PyExc_TypeError, "__dlpack__() got an unexpected keyword argument '%U'", name);
                return NULL;
            }
            slots[i] = k;
        }
        if (kwnames != NULL) {
            Py_INCREF(kwnames);
            Py_XSETREF(last_kwnames, kwnames);
            memcpy(last_slots, slots, sizeof slots);
        }
    }
    for (Py_ssize_t i = 0; i < nkw; i++) values[slots[i]] = args[i];
    RecordObject *r = self->record;
    int versioned = versioned_of(values[1]);
    if (values[0] == Py_None && values[2] == Py_None && values[3] == Py_None && versioned >= 0 &&
        self->stream == NULL && !self->closed && r->slot == S.cpu_slot && !(self->readonly == 1 && !versioned)) {
        /* host data, no stream, no copy, no device change: a capsule straight away */
        Py_ssize_t ndim = Py_SIZE(self);
        return export_capsule(r, tensor_size(self) ? self->data_ptr : 0, kDLCPU, 0, self->code, self->bits,
                              (int)ndim, self->dims, self->dims + ndim, versioned,
                              self->readonly ? DLPACK_FLAG_BITMASK_READ_ONLY : 0);
    }
    return PyObject_CallMethodObjArgs((PyObject *)self, str_dlpack_slow, values[0], values[1], values[2], values[3],
                                      NULL);
}

static PyObject *Tensor_dlpack_device(TensorObject *self, PyObject *unused) {
    if (self->closed) return PyObject_CallMethodNoArgs((PyObject *)self, str_check); /* raises LifetimeError */
    /* host data (most consumers ask before every import; NumPy does not): the tuple made
     * at setup, not an attribute lookup and a new tuple per call (about 180 of its 240 ns) */
    if (self->record->slot == S.cpu_slot && S.cpu_dlpack_device != NULL) return Py_NewRef(S.cpu_dlpack_device);
    PyObject *type = PyObject_GetAttrString(self->record->device, "type");
    if (type == NULL) return NULL;
    return Py_BuildValue("(Ni)", type, (int)self->record->dev_id);
}

static PyMethodDef Tensor_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))Tensor_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "Export as a DLPack capsule (see exchange.tensor.Tensor.__dlpack__)."},
    {"__dlpack_device__", (PyCFunction)Tensor_dlpack_device, METH_NOARGS,
     "(device_type, device_id) as DLPack numbers them."},
    {NULL},
};

PyTypeObject TensorBase_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "exchange._native.TensorBase",
    .tp_basicsize = offsetof(TensorObject, dims),
    .tp_itemsize = 2 * sizeof(int64_t),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Storage of a tx.Tensor (exchange.tensor.Tensor adds the rest).",
    .tp_new = Tensor_new_refused,
    .tp_dealloc = (destructor)Tensor_dealloc,
    .tp_members = Tensor_members,
    .tp_getset = Tensor_getset,
    .tp_methods = Tensor_methods,
    .tp_weaklistoffset = offsetof(TensorObject, weaklist),
};

/* -- the DLPack C exchange API, consumed --------------------------------------------------- */
static const char API_NAME[] = "dlpack_exchange_api";

/* A type's exchange API table (major version 1, walking prev_api), cached per type with
 * the producer's name; NULL when it has none or a malformed one (then __dlpack__ serves). */
static const DLPackExchangeAPI *exchange_api_of(PyTypeObject *tp, PyObject **name, PyObject **grad) {
    PyObject *entry = PyDict_GetItemWithError(S.api_cache, (PyObject *)tp);
    if (entry == NULL) {
        if (PyErr_Occurred()) return NULL;
        PyObject *attr = PyObject_GetAttr((PyObject *)tp, S.str_exchange_api);
        const DLPackExchangeAPIHeader *h = NULL;
        if (attr == NULL) PyErr_Clear();
        else if (PyCapsule_CheckExact(attr) && PyCapsule_IsValid(attr, API_NAME)) h = PyCapsule_GetPointer(attr, API_NAME);
        while (h != NULL && h->version.major != 1) h = h->prev_api;
        const DLPackExchangeAPI *api = (const DLPackExchangeAPI *)h;
        if (api != NULL && (api->managed_tensor_from_py_object_no_sync == NULL || api->current_work_stream == NULL))
            api = NULL;
        PyObject *module = api ? PyObject_GetAttrString((PyObject *)tp, "__module__") : NULL;
        PyObject *qualname = api ? PyObject_GetAttrString((PyObject *)tp, "__qualname__") : NULL;
        /* does the type say requires_grad (torch)? then each import asks the object */
        PyObject *grad_name = api != NULL ? PyUnicode_InternFromString("requires_grad") : NULL;
        int has_grad = grad_name != NULL && PyObject_HasAttr((PyObject *)tp, grad_name);
        if (api != NULL && module != NULL && qualname != NULL && grad_name != NULL)
            entry = Py_BuildValue("(NNO)", PyLong_FromVoidPtr((void *)api), PyUnicode_FromFormat("%S.%S", module, qualname),
                                  has_grad ? grad_name : Py_None);
        else
            entry = Py_NewRef(Py_None);
        PyErr_Clear();
        Py_XDECREF(module);
        Py_XDECREF(qualname);
        Py_XDECREF(grad_name);
        Py_XDECREF(attr); /* the table must outlive the process (dlpack.h); the capsule need not */
        if (entry == NULL) return NULL;
        if (PyDict_GET_SIZE(S.api_cache) < 4096 && PyDict_SetItem(S.api_cache, (PyObject *)tp, entry) < 0) PyErr_Clear();
        Py_DECREF(entry); /* the cache holds it (or, when full, the next lookup recomputes) */
        entry = PyDict_GetItemWithError(S.api_cache, (PyObject *)tp);
        if (entry == NULL) {
            PyErr_Clear();
            return NULL;
        }
    }
    if (entry == Py_None) return NULL;
    *name = PyTuple_GET_ITEM(entry, 1);
    *grad = PyTuple_GET_ITEM(entry, 2) != Py_None ? PyTuple_GET_ITEM(entry, 2) : NULL;
    return PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 0));
}

/* torch's __dlpack__ refuses a tensor that requires grad ("use tensor.detach()"); its
 * exchange table exports it anyway. The pure-Python path asks __dlpack__, so such an
 * object is left to __dlpack__ here too: both paths give the producer's own refusal. */
static int leave_to_dunder(PyObject *x, PyObject *grad_name) {
    if (grad_name == NULL) return 0; /* the type has no requires_grad */
    PyObject *grad = PyObject_GetAttr(x, grad_name);
    int yes = grad != NULL && PyObject_IsTrue(grad) == 1;
    Py_XDECREF(grad);
    PyErr_Clear();
    return yes;
}

/* PyTorch's table exports a tensor whose conjugate bit is set as its unconjugated data
 * (its __dlpack__ refuses such a tensor, naming the bit): 1 when `x` says it is one, and
 * then __dlpack__ must serve. Only a complex tensor can carry the bit, so only those ask. */
static int lazily_conjugated(PyObject *x, const DLManagedTensorVersioned *m) {
    if (m->dl_tensor.dtype.code != kDLComplex) return 0;
    PyObject *res = PyObject_CallMethod(x, "is_conj", NULL);
    int conj = res != NULL ? PyObject_IsTrue(res) : 0;
    Py_XDECREF(res);
    PyErr_Clear(); /* no is_conj (another producer): nothing to say */
    return conj == 1;
}

/* The hot import through a producer's exchange API: host data is taken here; device
 * data is ordered on the producer's current work stream by Python (adopt_device, which
 * also refuses it where the backend cannot load: the export cost the device nothing).
 * NULL with no error set when the table fails: the caller falls back to __dlpack__. */
static PyObject *import_via_api(PyObject *x, const DLPackExchangeAPI *api, PyObject *name) {
    DLManagedTensorVersioned *m = NULL;
    if (api->managed_tensor_from_py_object_no_sync(x, &m) != 0 || m == NULL) {
        PyErr_Clear();
        return NULL;
    }
    int32_t type = m->dl_tensor.device.device_type, id = m->dl_tensor.device.device_id;
    void *stream = NULL;
    if (lazily_conjugated(x, m) || (type != kDLCPU && api->current_work_stream(type, id, &stream) != 0)) {
        PyErr_Clear();
        call_managed_deleter(m, 1);
        return NULL;
    }
    PyObject *t = consume_managed(m, 1, NULL, name, NULL, NULL);
    if (t == NULL || type == kDLCPU) return t;
    PyObject *handle = PyLong_FromVoidPtr(stream);
    PyObject *adopted = handle ? PyObject_CallFunctionObjArgs(S.adopt_device, t, handle, NULL) : NULL;
    Py_XDECREF(handle);
    Py_DECREF(t);
    return adopted;
}

/* consume_exchange_api(x) -> (Tensor, current work stream handle) or None: the import of
 * device data through the producer's table, for the Python path once it has checked that
 * the backend loads; the caller orders the Tensor on that stream. */
static PyObject *py_consume_exchange_api(PyObject *mod, PyObject *x) {
    PyObject *name = NULL;
    PyObject *grad = NULL;
    const DLPackExchangeAPI *api = exchange_api_of(Py_TYPE(x), &name, &grad);
    if (api == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    if (leave_to_dunder(x, grad)) Py_RETURN_NONE;
    DLManagedTensorVersioned *m = NULL;
    if (api->managed_tensor_from_py_object_no_sync(x, &m) != 0 || m == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_BufferError, "%U's exchange API exported nothing", name);
        return NULL;
    }
    if (lazily_conjugated(x, m)) {
        call_managed_deleter(m, 1);
        Py_RETURN_NONE; /* __dlpack__ serves (and refuses it) */
    }
    void *stream = NULL;
    if (api->current_work_stream(m->dl_tensor.device.device_type, m->dl_tensor.device.device_id, &stream) != 0) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        call_managed_deleter(m, 1);
        PyErr_Restore(et, ev, tb);
        if (!PyErr_Occurred()) PyErr_Format(PyExc_BufferError, "%U's current_work_stream failed", name);
        return NULL;
    }
    PyObject *t = consume_managed(m, 1, NULL, name, NULL, NULL);
    if (t == NULL) return NULL;
    return Py_BuildValue("(NN)", t, PyLong_FromVoidPtr(stream));
}

/* -- the import hot path --------------------------------------------------------------------- */
/* from_dlpack(x, *, device=None, copy=None, stream=None): a NumPy array or an exchange-API
 * producer's host data with nothing else asked is taken here; everything else goes to
 * the Python implementation (exchange.importing._from_dlpack), which documents the call. */
static int is_from_dlpack_keyword(PyObject *name) {
    return PyUnicode_CompareWithASCIIString(name, "device") == 0 || PyUnicode_CompareWithASCIIString(name, "copy") == 0 ||
           PyUnicode_CompareWithASCIIString(name, "stream") == 0;
}

static PyObject *py_from_dlpack(PyObject *mod, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    int plain = nargs == 1;
    for (Py_ssize_t i = 0; plain && i < nkw; i++) /* another keyword: Python's TypeError */
        plain = args[nargs + i] == Py_None && is_from_dlpack_keyword(PyTuple_GET_ITEM(kwnames, i));
    if (plain) {
        PyObject *x = args[0];
        PyTypeObject *tp = Py_TYPE(x);
        if (S.ndarray_type == NULL && strcmp(tp->tp_name, "numpy.ndarray") == 0) {
            S.ndarray_type = Py_NewRef((PyObject *)tp); /* CPU-only by type: no __dlpack_device__ to ask */
            S.ndarray_name = PyUnicode_FromString("numpy.ndarray");
        }
        if ((PyObject *)tp == S.ndarray_type && S.ndarray_name != NULL) {
            PyObject *call[2] = {x, S.max_version};
            PyObject *capsule = PyObject_VectorcallMethod(S.str_dlpack, call, 1, S.kw_max_version);
            if (capsule != NULL) {
                PyObject *t = consume_capsule(capsule, S.ndarray_name, x, NULL);
                Py_DECREF(capsule);
                return t;
            }
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) return NULL;
            PyErr_Clear(); /* refused the keyword: the Python path asks again without it */
        } else if (!PyObject_TypeCheck(x, &TensorBase_Type)) {
            PyObject *name = NULL, *grad = NULL;
            const DLPackExchangeAPI *api = exchange_api_of(tp, &name, &grad);
            if (api != NULL && !leave_to_dunder(x, grad)) {
                PyObject *t = import_via_api(x, api, name);
                if (t != NULL || PyErr_Occurred()) return t;
            } else if (PyErr_Occurred()) {
                return NULL;
            }
        }
    }
    return PyObject_Vectorcall(S.slow_from_dlpack, args, nargs, kwnames);
}

/* -- the DLPack C exchange API, published on TensorBase ---------------------------------------
 * Its consumers (tvm-ffi) can neither be told that a tensor is read-only (tvm-ffi ignores
 * DLPack's READ_ONLY flag, and a DLTensor has no flags at all) nor name a stream: both
 * entry points give them what a legacy __dlpack__() gives, which is what the pure path's
 * tvm-ffi gets. A read-only tensor is refused with BufferError (tvm_ffi.from_dlpack then
 * falls back to __dlpack__(), which refuses it too); device data is ordered before the
 * legacy default stream, which current_work_stream names; host data on a stream of ours,
 * pinned and managed memory are made host-ready. Host data with no stream of its own
 * (the hot path) needs none of that and is exported at once. */
static PyObject *str_for_exchange_api;

/* 0 when `obj`, a tx.Tensor, may be exported through the table now (ordered as above);
 * -1 with TypeError, LifetimeError (a closed borrow) or BufferError (read-only) set. */
static int ready_for_api(void *obj) {
    if (!PyObject_TypeCheck((PyObject *)obj, &TensorBase_Type)) {
        PyErr_SetString(PyExc_TypeError, "the tx exchange API takes tx.Tensor objects only");
        return -1;
    }
    TensorObject *t = obj;
    if (t->closed || t->readonly != 0 || t->stream != NULL || t->record->slot != S.cpu_slot) {
        PyObject *r = PyObject_CallMethodNoArgs((PyObject *)t, str_for_exchange_api); /* Tensor._for_exchange_api */
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

static int api_from_py(void *obj, DLManagedTensorVersioned **out) {
    *out = NULL;
    if (ready_for_api(obj) < 0) return -1;
    TensorObject *t = obj;
    Py_ssize_t ndim = Py_SIZE(t);
    RecordObject *r = t->record;
    *out = export_managed(r, tensor_size(t) ? t->data_ptr : 0, r->dev_type, r->dev_id, t->code, t->bits, (int)ndim,
                          t->dims, t->dims + ndim, t->readonly ? DLPACK_FLAG_BITMASK_READ_ONLY : 0);
    return *out ? 0 : -1;
}

static int api_to_py(DLManagedTensorVersioned *m, void **out) {
    PyObject *t = consume_managed(m, 1, NULL, str_api_producer, NULL, NULL);
    if (t == NULL) return -1;
    *out = t;
    return 0;
}

static int api_dltensor(void *obj, DLTensor *out) {
    if (ready_for_api(obj) < 0) return -1; /* no flags field: a read-only tensor is refused here too */
    TensorObject *t = obj;
    Py_ssize_t ndim = Py_SIZE(t);
    out->data = (void *)(tensor_size(t) ? t->data_ptr : 0);
    out->device.device_type = t->record->dev_type;
    out->device.device_id = t->record->dev_id;
    out->ndim = (int32_t)ndim;
    out->dtype.code = t->code;
    out->dtype.bits = t->bits;
    out->dtype.lanes = 1;
    out->shape = ndim ? t->dims : NULL; /* inline in the Tensor: valid while it lives */
    out->strides = ndim ? t->dims + ndim : NULL;
    out->byte_offset = 0;
    return 0;
}

static int api_current_stream(int32_t device_type, int32_t device_id, void **out) {
    /* No current stream of our own: NULL, the legacy default stream on CUDA (and nothing
     * for the CPU). Every device export through the table is ordered before it. */
    *out = NULL;
    return 0;
}

static int api_allocate(DLTensor *proto, DLManagedTensorVersioned **out, void *error_ctx,
                        void (*set_error)(void *, const char *, const char *)) {
    PyGILState_STATE g = PyGILState_Ensure();
    int rc = -1;
    if (proto->ndim < 0 || proto->ndim > MAX_NDIM || (proto->ndim > 0 && proto->shape == NULL)) {
        set_error(error_ctx, "ValueError",
                  "the prototype DLTensor has no readable shape (ndim negative or above 1024, or a NULL shape "
                  "with ndim > 0); give ndim and a shape array of ndim extents");
        PyGILState_Release(g);
        return -1;
    }
    PyObject *shape = PyTuple_New(proto->ndim);
    for (int32_t i = 0; shape && i < proto->ndim; i++) {
        PyObject *v = PyLong_FromLongLong(proto->shape[i]);
        if (v == NULL) Py_CLEAR(shape);
        else PyTuple_SET_ITEM(shape, i, v);
    }
    PyObject *t = shape ? PyObject_CallFunction(S.allocate, "iiiiO", (int)proto->device.device_type,
                                                (int)proto->device.device_id, (int)proto->dtype.code,
                                                (int)proto->dtype.bits, shape)
                        : NULL;
    if (t != NULL && PyObject_TypeCheck(t, &TensorBase_Type)) rc = api_from_py(t, out);
    else if (t != NULL) PyErr_SetString(PyExc_TypeError, "allocation gave no tx.Tensor");
    Py_XDECREF(t); /* the export holds the record */
    Py_XDECREF(shape);
    if (rc != 0) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *text = ev ? PyObject_Str(ev) : NULL;
        const char *msg = text ? PyUnicode_AsUTF8(text) : NULL;
        set_error(error_ctx, et ? ((PyTypeObject *)et)->tp_name : "RuntimeError", msg ? msg : "allocation failed");
        PyErr_Clear();
        Py_XDECREF(text);
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
    }
    PyGILState_Release(g);
    return rc;
}

static DLPackExchangeAPI api_table = {
    .header = {.version = {1, 3}, .prev_api = NULL},
    .managed_tensor_allocator = api_allocate,
    .managed_tensor_from_py_object_no_sync = api_from_py,
    .managed_tensor_to_py_object_no_sync = api_to_py,
    .dltensor_from_py_object_no_sync = api_dltensor,
    .current_work_stream = api_current_stream,
};

/* new_tensor(record, token, data_ptr, shape, strides, dtype, readonly, stream) -> Tensor:
 * a view over `record`, holding it with `token` (0: none yet; set _token after). */
static PyObject *py_new_tensor(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 || !Record_Check(args[0]) || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "new_tensor(record, token, data_ptr, shape, strides, dtype, readonly, stream)");
        return NULL;
    }
    long long token = PyLong_AsLongLong(args[1]);
    uintptr_t data_ptr = (uintptr_t)PyLong_AsVoidPtr(args[2]);
    long readonly = args[6] == Py_True ? 1 : args[6] == Py_False ? 0 : PyLong_AsLong(args[6]);
    if (!PyErr_Occurred() && (readonly < 0 || readonly > 2)) readonly = 1;
    PyObject *code = PyObject_GetAttrString(args[5], "code"), *bits = PyObject_GetAttrString(args[5], "bits");
    long c = code ? PyLong_AsLong(code) : -1, b = bits ? PyLong_AsLong(bits) : -1;
    Py_XDECREF(code);
    Py_XDECREF(bits);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t ndim = PyTuple_GET_SIZE(args[3]);
    if (ndim > MAX_NDIM) {
        PyErr_SetString(PyExc_ValueError, "more than 1024 dimensions");
        return NULL;
    }
    int64_t buf[16], *dims = ndim <= 8 ? buf : PyMem_Malloc(2 * (size_t)ndim * sizeof(int64_t));
    if (dims == NULL) return PyErr_NoMemory();
    PyObject *t = NULL;
    if (fill_i64s(args[3], dims, ndim, "shape") == 0 && fill_i64s(args[4], dims + ndim, ndim, "strides") == 0)
        t = tensor_new((RecordObject *)args[0], token, data_ptr, (int)ndim, dims, dims + ndim, args[5], (int)c, (int)b,
                       (int)readonly, args[7] == Py_None ? NULL : args[7]);
    if (dims != buf) PyMem_Free(dims);
    return t;
}

/* new_tensors(record, base, entries, readonly) -> list of Tensors: for each entry
 * (offset, shape, strides, dtype) a view at base + offset bytes over `record`, each a new
 * holder of it ("tx.Tensor"). One call makes a set's version of many tensors (a Python
 * loop of new_tensor cost four times as much). On an error the tensors made go again. */
static PyObject *py_new_tensors(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    static PyObject *str_code, *str_bits;
    if (nargs != 4 || !Record_Check(args[0]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "new_tensors(record, base, entries: list, readonly)");
        return NULL;
    }
    if (str_code == NULL && ((str_code = PyUnicode_InternFromString("code")) == NULL ||
                             (str_bits = PyUnicode_InternFromString("bits")) == NULL))
        return NULL;
    RecordObject *record = (RecordObject *)args[0];
    uintptr_t base = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    int readonly = PyObject_IsTrue(args[3]);
    if (readonly < 0 || PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(args[2]);
    PyObject *out = PyList_New(n); /* its empty slots are NULL: freed cleanly on an error */
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(args[2], i);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 4 || !PyTuple_Check(PyTuple_GET_ITEM(e, 1))) {
            PyErr_SetString(PyExc_TypeError, "new_tensors: each entry is (offset, shape: tuple, strides, dtype)");
            goto fail;
        }
        Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(e, 0));
        PyObject *shape = PyTuple_GET_ITEM(e, 1), *strides = PyTuple_GET_ITEM(e, 2), *dtype = PyTuple_GET_ITEM(e, 3);
        if (offset == -1 && PyErr_Occurred()) goto fail;
        PyObject *code = PyObject_GetAttr(dtype, str_code), *bits = code ? PyObject_GetAttr(dtype, str_bits) : NULL;
        long c = code ? PyLong_AsLong(code) : -1, b = bits ? PyLong_AsLong(bits) : -1;
        Py_XDECREF(code);
        Py_XDECREF(bits);
        if (PyErr_Occurred()) goto fail;
        Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
        if (ndim > MAX_NDIM) {
            PyErr_SetString(PyExc_ValueError, "more than 1024 dimensions");
            goto fail;
        }
        int64_t buf[16], *dims = ndim <= 8 ? buf : PyMem_Malloc(2 * (size_t)ndim * sizeof(int64_t));
        if (dims == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        PyObject *t = NULL;
        long long token = 0;
        if (fill_i64s(shape, dims, ndim, "shape") == 0 && fill_i64s(strides, dims + ndim, ndim, "strides") == 0 &&
            (token = record_add_holder(record, 0, NULL)) >= 0) {
            t = tensor_new(record, token, base + (uintptr_t)offset, (int)ndim, dims, dims + ndim, dtype, (int)c, (int)b,
                           readonly, NULL);
            if (t == NULL) record_remove_holder(record, token);
        }
        if (dims != buf) PyMem_Free(dims);
        if (t == NULL) goto fail;
        PyList_SET_ITEM(out, i, t);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* set_method_doc(name, doc): give a TensorBase method the Python side's docstring (the
 * descriptor reads it from the method table each time). */
static PyObject *py_set_method_doc(PyObject *mod, PyObject *args) {
    const char *name, *doc;
    if (!PyArg_ParseTuple(args, "ss", &name, &doc)) return NULL;
    for (PyMethodDef *d = Tensor_methods; d->ml_name != NULL; d++) {
        if (strcmp(d->ml_name, name) != 0) continue;
        char *copy = PyMem_Malloc(strlen(doc) + 1); /* kept for the life of the process */
        if (copy == NULL) return PyErr_NoMemory();
        strcpy(copy, doc);
        d->ml_doc = copy;
        Py_RETURN_NONE;
    }
    PyErr_Format(PyExc_KeyError, "no TensorBase method %s", name);
    return NULL;
}

/* bind_from_dlpack(doc) -> the from_dlpack builtin with the Python implementation's
 * docstring (its first lines the signature, as CPython reads __text_signature__). */
static PyMethodDef from_dlpack_def = {"from_dlpack", (PyCFunction)(void (*)(void))py_from_dlpack,
                                      METH_FASTCALL | METH_KEYWORDS, NULL};

static PyObject *py_bind_from_dlpack(PyObject *mod, PyObject *doc) {
    const char *text = PyUnicode_AsUTF8(doc);
    if (text == NULL) return NULL;
    char *copy = PyMem_Malloc(strlen(text) + 1); /* kept for the life of the process, as ml_doc */
    if (copy == NULL) return PyErr_NoMemory();
    strcpy(copy, text);
    from_dlpack_def.ml_doc = copy;
    return PyCFunction_NewEx(&from_dlpack_def, mod, NULL);
}

/* call_stage(fn, arg, tensor, hops, template, acc, index): a chain stage's call on its
 * hot path. Notes the shared hop of `tensor` into the stage on the list `hops` as
 * (template, nbytes), calls fn(arg), adds the call's milliseconds (CLOCK_MONOTONIC, as
 * time.perf_counter) to the float acc[index]; returns what fn returned and raises what
 * it raised (the hop noted first, the time not added). */
static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* (template, t's nbytes): a shared hop as a chain notes it while batches run */
PyObject *stage_hop(PyObject *template, TensorObject *t) {
    PyObject *nbytes = PyLong_FromLongLong(tensor_size(t) * (t->bits / 8));
    if (nbytes == NULL) return NULL;
    PyObject *hop = PyTuple_Pack(2, template, nbytes);
    Py_DECREF(nbytes);
    return hop;
}

/* call_stage's work, its arguments checked: args = fn, arg, tensor, hops, template, acc */
PyObject *stage_call(PyObject *const *args, Py_ssize_t index) {
    PyObject *fn = args[0], *arg = args[1], *hops = args[3], *acc = args[5];
    PyObject *hop = stage_hop(args[4], (TensorObject *)args[2]);
    if (hop == NULL) return NULL;
    int appended = PyList_Append(hops, hop);
    Py_DECREF(hop);
    if (appended < 0) return NULL;
    double t0 = now_ms();
    PyObject *result = PyObject_CallOneArg(fn, arg);
    if (result == NULL) return NULL;
    double spent = now_ms() - t0;
    if (index >= PyList_GET_SIZE(acc)) return result; /* fn shrank acc: nothing to add to */
    double before = PyFloat_AsDouble(PyList_GET_ITEM(acc, index));
    PyObject *sum = (before == -1.0 && PyErr_Occurred()) ? NULL : PyFloat_FromDouble(before + spent);
    if (sum == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    PyList_SetItem(acc, index, sum); /* steals sum */
    return result;
}

static PyObject *py_call_stage(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "call_stage(fn, arg, tensor, hops, template, acc, index) takes 7 arguments");
        return NULL;
    }
    /* lists, not subclasses (as the twin): their items are read and set here directly */
    if (!PyObject_TypeCheck(args[2], &TensorBase_Type) || !PyList_CheckExact(args[3]) || !PyList_CheckExact(args[5])) {
        PyErr_SetString(PyExc_TypeError, "call_stage: tensor must be a tx.Tensor, hops and acc lists");
        return NULL;
    }
    Py_ssize_t index = PyLong_AsSsize_t(args[6]);
    if (index == -1 && PyErr_Occurred()) return NULL;
    if (index < 0 || index >= PyList_GET_SIZE(args[5])) {
        PyErr_SetString(PyExc_IndexError, "call_stage: index out of range of acc");
        return NULL;
    }
    return stage_call(args, index);
}

PyMethodDef tensor_methods[] = {
    {"call_stage", (PyCFunction)(void (*)(void))py_call_stage, METH_FASTCALL,
     "A chain stage's call: its shared hop noted, fn(arg) called and timed into acc[index]."},
    {"bind_from_dlpack", py_bind_from_dlpack, METH_O, "The from_dlpack builtin, with a docstring."},
    {"new_tensor", (PyCFunction)(void (*)(void))py_new_tensor, METH_FASTCALL, "A Tensor over a record."},
    {"new_tensors", (PyCFunction)(void (*)(void))py_new_tensors, METH_FASTCALL, "Tensors over a record, one per entry."},
    {"set_method_doc", py_set_method_doc, METH_VARARGS, "Give a TensorBase method its docstring."},
    {"from_dlpack", (PyCFunction)(void (*)(void))py_from_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "tx.from_dlpack (the hot paths in C; see exchange.importing._from_dlpack for the rest)."},
    {"consume_exchange_api", py_consume_exchange_api, METH_O, "Import device data through an exchange API."},
    {NULL, NULL, 0, NULL},
};

PyObject *tensor_heap_type(void) {
    /* tp_dealloc given: else PyType_FromSpec puts subtype_dealloc there */
    static PyType_Slot slots[] = {{Py_tp_dealloc, (void *)Tensor_dealloc}, {0, NULL}};
    static PyType_Spec spec = {"exchange.tensor.Tensor", 0, 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, slots};
    return PyType_FromSpecWithBases(&spec, (PyObject *)&TensorBase_Type);
}

int tensor_types_ready(PyObject *module) {
    static const char *names[4] = {"stream", "max_version", "dl_device", "copy"};
    for (int i = 0; i < 4; i++)
        if ((kw_names[i] = PyUnicode_InternFromString(names[i])) == NULL) return -1;
    str_dlpack_slow = PyUnicode_InternFromString("_dlpack_slow");
    str_check = PyUnicode_InternFromString("_check");
    str_api_producer = PyUnicode_InternFromString("a DLPack exchange API tensor");
    str_for_exchange_api = PyUnicode_InternFromString("_for_exchange_api");
    if (str_dlpack_slow == NULL || str_check == NULL || str_api_producer == NULL || str_for_exchange_api == NULL)
        return -1;
    if (PyType_Ready(&TensorBase_Type) < 0) return -1;
    PyObject *capsule = PyCapsule_New(&api_table, API_NAME, NULL);
    if (capsule == NULL || PyDict_SetItemString(TensorBase_Type.tp_dict, "__dlpack_c_exchange_api__", capsule) < 0) {
        Py_XDECREF(capsule);
        return -1;
    }
    Py_DECREF(capsule);
    PyType_Modified(&TensorBase_Type);
    Py_INCREF(&TensorBase_Type);
    return PyModule_AddObject(module, "TensorBase", (PyObject *)&TensorBase_Type);
}
