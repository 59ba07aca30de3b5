/* exchange._native: the compiled half of exchange/capsule.py.
 *
 * Why C: a capsule destructor may run while the consumer has an exception set (a
 * consumer that refuses a capsule drops it with its error pending). The DLPack Python
 * spec's destructor saves and restores that exception and checks Py_IsInitialized()
 * before anything else; a ctypes callback cannot (ctypes runs Python code first).
 * The deleter our exports carry is here too, so any thread, including one Python never
 * created, can call it, and after interpreter shutdown it only frees its own block.
 *
 * Everything here has a pure-Python twin in exchange/_capsule_ctypes.py with the same
 * functions; exchange/capsule.py picks one at import time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { uint32_t major, minor; } DLPackVersion;
typedef struct { int32_t device_type, device_id; } DLDevice;
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data; DLDevice device; int32_t ndim; DLDataType dtype;
    int64_t *shape; int64_t *strides; uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor; void *manager_ctx; void (*deleter)(struct DLManagedTensor *);
} DLManagedTensor;
typedef struct DLManagedTensorVersioned {
    DLPackVersion version; void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *); uint64_t flags; DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* Capsule names must be static: CPython keeps the pointer. */
static const char NAME[] = "dltensor";
static const char USED_NAME[] = "used_dltensor";
static const char VNAME[] = "dltensor_versioned";
static const char USED_VNAME[] = "used_dltensor_versioned";

#define MAX_NDIM 1024 /* beyond this a DLTensor is taken as corrupt, not read */

static PyObject *release_callback = NULL; /* called as callback(ctx: int) */
static PyObject *known_devices = NULL;    /* {(device_type, device_id): Device}, from exchange.capsule */
static PyObject *known_dtypes = NULL;     /* {(code, bits): DType}, from exchange.dtypes */
static volatile int finalizing = 0;

static void notify_release(void *ctx) {
    if (finalizing || !Py_IsInitialized()) return; /* leak, never call into a dead interpreter */
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (release_callback != NULL) {
        PyObject *r = PyObject_CallFunction(release_callback, "n", (Py_ssize_t)(intptr_t)ctx);
        if (r == NULL) PyErr_WriteUnraisable(release_callback);
        else Py_DECREF(r);
    }
    PyErr_Restore(et, ev, tb);
    PyGILState_Release(g);
}

static void deleter_legacy(DLManagedTensor *self) {
    if (self == NULL) return;
    notify_release(self->manager_ctx);
    free(self);
}

static void deleter_versioned(DLManagedTensorVersioned *self) {
    if (self == NULL) return;
    notify_release(self->manager_ctx);
    free(self);
}

/* Conforming capsule destructor (DLPack python_spec.rst): acts only on an unconsumed
 * capsule, tolerates a NULL deleter, keeps any pending exception. */
static void capsule_destructor(PyObject *capsule) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL) {
        PyErr_Clear();
    } else if (strcmp(name, VNAME) == 0) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, name);
        if (m == NULL) PyErr_WriteUnraisable(capsule);
        else if (m->deleter != NULL) m->deleter(m);
    } else if (strcmp(name, NAME) == 0) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, name);
        if (m == NULL) PyErr_WriteUnraisable(capsule);
        else if (m->deleter != NULL) m->deleter(m);
    }
    PyErr_Restore(et, ev, tb);
}

static int fill_i64s(PyObject *seq, int64_t *out, Py_ssize_t n, const char *what) {
    if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s must be a tuple of %zd ints", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) return -1;
        out[i] = (int64_t)v;
    }
    return 0;
}

/* new_capsule(versioned, ctx, data, device_type, device_id, code, bits, shape, strides, flags)
 * One malloc holds the managed struct, then shape, then strides. byte_offset is 0. */
static PyObject *new_capsule(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "new_capsule takes 10 arguments");
        return NULL;
    }
    int versioned = PyObject_IsTrue(args[0]);
    void *ctx = PyLong_AsVoidPtr(args[1]);
    void *data = PyLong_AsVoidPtr(args[2]);
    long device_type = PyLong_AsLong(args[3]);
    long device_id = PyLong_AsLong(args[4]);
    long code = PyLong_AsLong(args[5]);
    long bits = PyLong_AsLong(args[6]);
    PyObject *shape = args[7], *strides = args[8];
    unsigned long long flags = PyLong_AsUnsignedLongLong(args[9]);
    if (PyErr_Occurred()) return NULL;
    if (!PyTuple_Check(shape)) {
        PyErr_SetString(PyExc_TypeError, "shape must be a tuple");
        return NULL;
    }
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    size_t head = versioned ? sizeof(DLManagedTensorVersioned) : sizeof(DLManagedTensor);
    char *block = malloc(head + 2 * (size_t)ndim * sizeof(int64_t) + 1);
    if (block == NULL) return PyErr_NoMemory();
    int64_t *sh = (int64_t *)(block + head), *st = sh + ndim;
    if (fill_i64s(shape, sh, ndim, "shape") < 0 || fill_i64s(strides, st, ndim, "strides") < 0) {
        free(block);
        return NULL;
    }
    DLTensor *t;
    if (versioned) {
        DLManagedTensorVersioned *m = (DLManagedTensorVersioned *)block;
        m->version.major = 1;
        m->version.minor = 3;
        m->manager_ctx = ctx;
        m->deleter = deleter_versioned;
        m->flags = flags;
        t = &m->dl_tensor;
    } else {
        DLManagedTensor *m = (DLManagedTensor *)block;
        m->manager_ctx = ctx;
        m->deleter = deleter_legacy;
        t = &m->dl_tensor;
    }
    t->data = data;
    t->device.device_type = (int32_t)device_type;
    t->device.device_id = (int32_t)device_id;
    t->ndim = (int32_t)ndim;
    t->dtype.code = (uint8_t)code;
    t->dtype.bits = (uint8_t)bits;
    t->dtype.lanes = 1;
    t->shape = ndim ? sh : NULL;
    t->strides = ndim ? st : NULL;
    t->byte_offset = 0;
    PyObject *cap = PyCapsule_New(block, versioned ? VNAME : NAME, capsule_destructor);
    if (cap == NULL) free(block); /* nothing was taken yet: no release to report */
    return cap;
}

static PyObject *tuple_i64(const int64_t *p, int32_t n) {
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (int32_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(p[i]);
        if (v == NULL) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

/* peek(capsule) -> tuple, reading but never renaming. ValueError for a capsule that is
 * used or of another name. For a versioned capsule of another major, only version is
 * read: (True, ptr, major, minor) and nothing else. */
static PyObject *peek(PyObject *mod, PyObject *capsule) {
    if (!PyCapsule_CheckExact(capsule)) {
        PyErr_SetString(PyExc_TypeError, "expected a DLPack PyCapsule");
        return NULL;
    }
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL) return NULL;
    int versioned;
    if (strcmp(name, VNAME) == 0) versioned = 1;
    else if (strcmp(name, NAME) == 0) versioned = 0;
    else if (strcmp(name, USED_VNAME) == 0 || strcmp(name, USED_NAME) == 0) {
        PyErr_SetString(PyExc_ValueError,
                        "this DLPack capsule was already consumed (its name is used_...); "
                        "a capsule can be consumed once: ask the producer for a new one");
        return NULL;
    } else {
        PyErr_Format(PyExc_ValueError,
                     "capsule named '%s' is not a DLPack tensor; expected 'dltensor' or 'dltensor_versioned'",
                     name);
        return NULL;
    }
    void *ptr = PyCapsule_GetPointer(capsule, name);
    if (ptr == NULL) return NULL;
    DLTensor *t;
    unsigned long long flags = 0;
    unsigned long major = 0, minor = 0;
    if (versioned) {
        DLManagedTensorVersioned *m = ptr;
        major = m->version.major;
        minor = m->version.minor;
        if (major != 1) return Py_BuildValue("(ONkk)", Py_True, PyLong_FromVoidPtr(ptr), major, minor);
        flags = m->flags;
        t = &m->dl_tensor;
    } else {
        t = &((DLManagedTensor *)ptr)->dl_tensor;
    }
    PyObject *shape = Py_None, *strides = Py_None;
    int ok_dims = t->ndim > 0 && t->ndim <= MAX_NDIM;
    if (ok_dims && t->shape != NULL) shape = tuple_i64(t->shape, t->ndim);
    else if (t->ndim == 0) shape = PyTuple_New(0);
    else Py_INCREF(shape);
    if (shape == NULL) return NULL;
    if (ok_dims && t->strides != NULL) strides = tuple_i64(t->strides, t->ndim);
    else Py_INCREF(strides);
    if (strides == NULL) { Py_DECREF(shape); return NULL; }
    return Py_BuildValue("(ONkkKNiiiiiiNNK)", versioned ? Py_True : Py_False, PyLong_FromVoidPtr(ptr),
                         major, minor, flags, PyLong_FromVoidPtr(t->data),
                         (int)t->device.device_type, (int)t->device.device_id, (int)t->ndim,
                         (int)t->dtype.code, (int)t->dtype.bits, (int)t->dtype.lanes, shape, strides,
                         (unsigned long long)t->byte_offset);
}

/* import_info(capsule) -> (versioned, ptr, readonly, element0, address, nbytes, device or None,
 * dtype or None, device_type, device_id, code, bits, shape, strides, own): peek and validate in one call (the import
 * hot path), never renaming. own: the export id of a capsule this library made (its deleter is ours), else 0. Errors as peek, plus BufferError for a malformed tensor. For a
 * versioned capsule of another major: rename it, call its deleter (the only thing the
 * spec allows), raise BufferError. strides come back filled (row-major for NULL). */
static PyObject *import_info(PyObject *mod, PyObject *capsule) {
    const char *name = PyCapsule_CheckExact(capsule) ? PyCapsule_GetName(capsule) : NULL;
    int versioned;
    if (name != NULL && strcmp(name, VNAME) == 0) versioned = 1;
    else if (name != NULL && strcmp(name, NAME) == 0) versioned = 0;
    else { /* not an unconsumed DLPack capsule: peek raises the precise error */
        PyErr_Clear();
        PyObject *r = peek(mod, capsule);
        Py_XDECREF(r);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "not an unconsumed DLPack capsule");
        return NULL;
    }
    void *ptr = PyCapsule_GetPointer(capsule, name);
    if (ptr == NULL) return NULL;
    if (versioned && ((DLManagedTensorVersioned *)ptr)->version.major != 1) { /* another major */
        DLManagedTensorVersioned *m = ptr;
        unsigned long major = m->version.major, minor = m->version.minor;
        if (PyCapsule_SetName(capsule, USED_VNAME) < 0) return NULL;
        if (m->deleter != NULL) m->deleter(m);
        PyErr_Format(PyExc_BufferError,
                     "DLPack version %lu.%lu is not supported (this library reads major version 1); "
                     "ask the producer for max_version=(1, 3)", major, minor);
        return NULL;
    }
    DLTensor *t = versioned ? &((DLManagedTensorVersioned *)ptr)->dl_tensor : &((DLManagedTensor *)ptr)->dl_tensor;
    unsigned long long flags = versioned ? ((DLManagedTensorVersioned *)ptr)->flags : 0;
    int32_t ndim = t->ndim;
    if (ndim < 0 || ndim > MAX_NDIM || (ndim > 0 && t->shape == NULL)) {
        PyErr_Format(PyExc_BufferError,
                     "DLPack tensor has ndim=%d but no readable shape (NULL, or ndim negative or too large)", (int)ndim);
        return NULL;
    }
    if (t->dtype.lanes != 1) {
        PyErr_Format(PyExc_BufferError,
                     "DLPack dtype with lanes=%d (a vector element type) is not supported; lanes must be 1",
                     (int)t->dtype.lanes);
        return NULL;
    }
    int bits = t->dtype.bits;
    if (bits == 0 || bits % 8 != 0) {
        PyErr_Format(PyExc_BufferError,
                     "DLPack dtype (code=%d, bits=%d) is not supported; sub-byte and odd widths cannot be held",
                     (int)t->dtype.code, bits);
        return NULL;
    }
    int64_t itemsize = bits / 8, size = 1, lo = 0, hi = 0;
    for (int32_t i = 0; i < ndim; i++) {
        if (t->shape[i] < 0) {
            PyErr_SetString(PyExc_BufferError, "DLPack tensor has a negative extent in its shape");
            return NULL;
        }
        if (__builtin_mul_overflow(size, t->shape[i], &size)) goto overflow;
    }
    if (size && t->data == NULL) {
        PyErr_Format(PyExc_BufferError,
                     "DLPack tensor has a NULL data pointer but %lld elements; it is malformed (only a zero-size "
                     "tensor may have NULL data)", (long long)size);
        return NULL;
    }
    PyObject *shape = tuple_i64(t->shape, ndim);
    if (shape == NULL) return NULL;
    PyObject *strides = PyTuple_New(ndim);
    if (strides == NULL) { Py_DECREF(shape); return NULL; }
    int64_t step = 1;
    for (int32_t i = ndim - 1; i >= 0; i--) {
        int64_t st = t->strides != NULL ? t->strides[i] : step, reach;
        if (__builtin_mul_overflow(step, t->shape[i] > 1 ? t->shape[i] : 1, &step) ||
            (size && (__builtin_mul_overflow(st, t->shape[i] - 1, &reach) ||
                      (st < 0 ? __builtin_add_overflow(lo, reach, &lo) : __builtin_add_overflow(hi, reach, &hi))))) {
            Py_DECREF(shape);
            Py_DECREF(strides);
            goto overflow;
        }
        PyObject *v = PyLong_FromLongLong(st);
        if (v == NULL) { Py_DECREF(shape); Py_DECREF(strides); return NULL; }
        PyTuple_SET_ITEM(strides, i, v);
    }
    int64_t span = 0;
    if (size && (__builtin_sub_overflow(hi, lo, &span) || __builtin_add_overflow(span, 1, &span) ||
                 __builtin_mul_overflow(span, itemsize, &span) || __builtin_mul_overflow(lo, itemsize, &lo))) {
        Py_DECREF(shape);
        Py_DECREF(strides);
        goto overflow;
    }
    uintptr_t element0 = (uintptr_t)t->data + (uintptr_t)t->byte_offset;
    uintptr_t address = size ? element0 + (uintptr_t)lo : element0;
    long long nbytes = size ? (long long)span : 0;
    /* The Device and DType objects when cached (None otherwise: Python validates). */
    PyObject *device = Py_None, *dtype = Py_None;
    PyObject *key = Py_BuildValue("(ii)", (int)t->device.device_type, (int)t->device.device_id);
    if (key != NULL && known_devices != NULL) {
        PyObject *found = PyDict_GetItemWithError(known_devices, key);
        if (found != NULL) device = found;
    }
    Py_XDECREF(key);
    key = Py_BuildValue("(ii)", (int)t->dtype.code, bits);
    if (key != NULL && known_dtypes != NULL) {
        PyObject *found = PyDict_GetItemWithError(known_dtypes, key);
        if (found != NULL) dtype = found;
    }
    Py_XDECREF(key);
    if (PyErr_Occurred()) { Py_DECREF(shape); Py_DECREF(strides); return NULL; }
    Py_INCREF(device);
    Py_INCREF(dtype);
    PyObject *out = PyTuple_New(15);
    if (out == NULL) { Py_DECREF(shape); Py_DECREF(strides); Py_DECREF(device); Py_DECREF(dtype); return NULL; }
    /* readonly: False, True (READ_ONLY flag), or 2 (a legacy capsule: cannot say; see tensor.py) */
    long readonly = !versioned ? 2 : (flags & 1) ? 1 : 0;
    void *own = NULL; /* our own export coming back: its export id */
    if (versioned && ((DLManagedTensorVersioned *)ptr)->deleter == deleter_versioned)
        own = ((DLManagedTensorVersioned *)ptr)->manager_ctx;
    else if (!versioned && ((DLManagedTensor *)ptr)->deleter == deleter_legacy)
        own = ((DLManagedTensor *)ptr)->manager_ctx;
    PyObject *items[15] = {
        PyBool_FromLong(versioned), PyLong_FromVoidPtr(ptr),
        readonly == 2 ? PyLong_FromLong(2) : PyBool_FromLong(readonly),
        PyLong_FromVoidPtr((void *)element0), PyLong_FromVoidPtr((void *)address), PyLong_FromLongLong(nbytes),
        device, dtype, PyLong_FromLong(t->device.device_type), PyLong_FromLong(t->device.device_id),
        PyLong_FromLong(t->dtype.code), PyLong_FromLong(bits), shape, strides,
        PyLong_FromSsize_t((Py_ssize_t)(intptr_t)own)};
    for (int i = 0; i < 15; i++) {
        if (items[i] == NULL) {
            for (int j = i + 1; j < 15; j++) Py_XDECREF(items[j]);
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, items[i]);
    }
    return out;
overflow:
    PyErr_SetString(PyExc_BufferError,
                    "DLPack tensor's shape or strides overflow 64 bits (size or extent in bytes); it is malformed");
    return NULL;
}

/* mark_used(capsule): rename to the used_ name; from now on the consumer calls the deleter. */
static PyObject *mark_used(PyObject *mod, PyObject *capsule) {
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL) return NULL;
    const char *used = strcmp(name, VNAME) == 0 ? USED_VNAME : strcmp(name, NAME) == 0 ? USED_NAME : NULL;
    if (used == NULL) {
        PyErr_SetString(PyExc_ValueError,
                        "this DLPack capsule was already consumed (its name is used_...); "
                        "a capsule can be consumed once: ask the producer for a new one");
        return NULL;
    }
    if (PyCapsule_SetName(capsule, used) < 0) return NULL;
    Py_RETURN_NONE;
}

/* call_deleter(ptr, versioned): the consumer's one call of the producer's deleter. */
static PyObject *call_deleter(PyObject *mod, PyObject *args) {
    PyObject *addr;
    int versioned;
    if (!PyArg_ParseTuple(args, "Op", &addr, &versioned)) return NULL;
    void *ptr = PyLong_AsVoidPtr(addr);
    if (ptr == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    if (versioned) {
        DLManagedTensorVersioned *m = ptr;
        if (m->deleter != NULL) m->deleter(m);
    } else {
        DLManagedTensor *m = ptr;
        if (m->deleter != NULL) m->deleter(m);
    }
    Py_RETURN_NONE;
}

/* -- the registry's counters -------------------------------------------------------------
 * Bytes per device slot (exchange.device._slot_of), live and pending release, and the
 * peak of live bytes while someone measures it. Each call is one step under the GIL,
 * so counts from many threads add up exactly, with no Python lock on the hot path. */
#define MAX_SLOTS 1024
static long long live_bytes[MAX_SLOTS], pending_bytes[MAX_SLOTS];
static long long total_live = 0, peak_live = 0;
static long peak_users = 0;

static int slot_arg(PyObject *arg, Py_ssize_t *slot) {
    *slot = PyLong_AsSsize_t(arg);
    if (*slot == -1 && PyErr_Occurred()) return -1;
    if (*slot < 0 || *slot >= MAX_SLOTS) {
        PyErr_Format(PyExc_IndexError, "device slot %zd out of range", *slot);
        return -1;
    }
    return 0;
}

/* bytes_add(slot, delta): live bytes of one device change by delta. */
static PyObject *bytes_add(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    if (nargs != 2 || slot_arg(args[0], &slot) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "bytes_add(slot, delta)");
        return NULL;
    }
    long long delta = PyLong_AsLongLong(args[1]);
    if (delta == -1 && PyErr_Occurred()) return NULL;
    live_bytes[slot] += delta;
    total_live += delta;
    if (peak_users && total_live > peak_live) peak_live = total_live;
    Py_RETURN_NONE;
}

/* pending_add(slot, delta): bytes of one device waiting for their release change. */
static PyObject *pending_add(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    if (nargs != 2 || slot_arg(args[0], &slot) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "pending_add(slot, delta)");
        return NULL;
    }
    long long delta = PyLong_AsLongLong(args[1]);
    if (delta == -1 && PyErr_Occurred()) return NULL;
    pending_bytes[slot] += delta;
    Py_RETURN_NONE;
}

/* counts(slots) -> ([live bytes], [pending bytes]) for the first `slots` slots. */
static PyObject *counts(PyObject *mod, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || n > MAX_SLOTS) n = MAX_SLOTS;
    PyObject *live = PyList_New(n), *pending = PyList_New(n);
    if (live == NULL || pending == NULL) { Py_XDECREF(live); Py_XDECREF(pending); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyLong_FromLongLong(live_bytes[i]), *b = PyLong_FromLongLong(pending_bytes[i]);
        if (a == NULL || b == NULL) { Py_XDECREF(a); Py_XDECREF(b); Py_DECREF(live); Py_DECREF(pending); return NULL; }
        PyList_SET_ITEM(live, i, a);
        PyList_SET_ITEM(pending, i, b);
    }
    return Py_BuildValue("(NN)", live, pending);
}

/* peak_begin(): measure the peak of live bytes from now (measurements may nest). */
static PyObject *peak_begin(PyObject *mod, PyObject *unused) {
    if (peak_users++ == 0 || total_live > peak_live) peak_live = total_live;
    Py_RETURN_NONE;
}

/* peak_end() -> the peak in bytes; ends one measurement. */
static PyObject *peak_end(PyObject *mod, PyObject *unused) {
    if (peak_users > 0) peak_users--;
    return PyLong_FromLongLong(peak_live);
}

static PyObject *peak_value(PyObject *mod, PyObject *unused) { return PyLong_FromLongLong(peak_live); }

/* reset_counts(): zero every counter (a forked child starts its own). */
static PyObject *reset_counts(PyObject *mod, PyObject *unused) {
    memset(live_bytes, 0, sizeof live_bytes);
    memset(pending_bytes, 0, sizeof pending_bytes);
    total_live = peak_live = 0;
    peak_users = 0;
    Py_RETURN_NONE;
}

static PyObject *set_release_callback(PyObject *mod, PyObject *fn) {
    Py_XINCREF(fn);
    Py_XSETREF(release_callback, fn);
    Py_RETURN_NONE;
}

/* set_lookups(known_devices, known_dtypes): the dicts import_info consults. */
static PyObject *set_lookups(PyObject *mod, PyObject *args) {
    PyObject *devices, *dtypes;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &devices, &PyDict_Type, &dtypes)) return NULL;
    Py_INCREF(devices);
    Py_XSETREF(known_devices, devices);
    Py_INCREF(dtypes);
    Py_XSETREF(known_dtypes, dtypes);
    Py_RETURN_NONE;
}

static PyObject *set_finalizing(PyObject *mod, PyObject *unused) {
    finalizing = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"new_capsule", (PyCFunction)(void (*)(void))new_capsule, METH_FASTCALL, "Make a DLPack capsule."},
    {"peek", peek, METH_O, "Read a DLPack capsule without consuming it."},
    {"import_info", import_info, METH_O, "Read and validate a DLPack capsule for import."},
    {"mark_used", mark_used, METH_O, "Rename a DLPack capsule to its used_ name."},
    {"call_deleter", call_deleter, METH_VARARGS, "Call a managed tensor's deleter once."},
    {"set_release_callback", set_release_callback, METH_O, "Set the function our deleters notify."},
    {"set_lookups", set_lookups, METH_VARARGS, "Set the Device and DType caches import_info uses."},
    {"set_finalizing", set_finalizing, METH_NOARGS, "From now on deleters only free their block."},
    {"bytes_add", (PyCFunction)(void (*)(void))bytes_add, METH_FASTCALL, "Live bytes of a device slot change."},
    {"pending_add", (PyCFunction)(void (*)(void))pending_add, METH_FASTCALL, "Pending bytes of a device slot change."},
    {"counts", counts, METH_O, "Live and pending bytes of the first N device slots."},
    {"peak_begin", peak_begin, METH_NOARGS, "Start measuring the peak of live bytes."},
    {"peak_end", peak_end, METH_NOARGS, "End one peak measurement; returns the peak."},
    {"peak_value", peak_value, METH_NOARGS, "The peak of live bytes measured so far."},
    {"reset_counts", reset_counts, METH_NOARGS, "Zero every counter."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "exchange._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
