/* DLPack capsules: our deleters and capsule destructor, making, reading and consuming
 * capsules (DLPack 1.3 python_spec.rst).
 *
 * Why C: a capsule destructor may run while the consumer has an exception set (a
 * consumer that refuses a capsule drops it with its error pending). The spec's
 * destructor saves and restores that exception and checks Py_IsInitialized() before
 * anything else; a ctypes callback cannot. Our deleters take the GIL themselves, so any
 * thread, including one Python never created, can call them, and after interpreter
 * shutdown they only free their own block.
 *
 * Producing: one malloc holds the managed struct, a trailer naming the record and the
 * export's holder token, then shape and strides. manager_ctx is the export id (an
 * integer, never an object pointer). Consuming: read and validate everything and build
 * the result first; rename the capsule to its used_ name last (after checking it is
 * still unconsumed: Python code may have run meanwhile), so any failure leaves the
 * producer's deleter in charge. */
#include "native.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Capsule names must be static: CPython keeps the pointer. */
static const char NAME[] = "dltensor";
static const char USED_NAME[] = "used_dltensor";
static const char VNAME[] = "dltensor_versioned";
static const char USED_VNAME[] = "used_dltensor_versioned";
static const char ALREADY_CONSUMED[] =
    "this DLPack capsule was already consumed (its name is used_...); "
    "a capsule can be consumed once: ask the producer for a new one";

/* -- our deleters ------------------------------------------------------------------------- */
static void release_export(ExportTrailer *tr) {
    if (S.finalizing || !Py_IsInitialized()) return; /* leak, never call into a dead interpreter */
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    RecordObject *r = tr->record;
    tr->record = NULL;
    if (r != NULL) {
        S.exports--;
        record_remove_holder(r, tr->token);
        Py_DECREF(r);
    }
    PyErr_Restore(et, ev, tb);
    PyGILState_Release(g);
}

static void deleter_versioned(DLManagedTensorVersioned *self) {
    if (self == NULL) return;
    release_export((ExportTrailer *)(self + 1));
    free(self);
}

static void deleter_legacy(DLManagedTensor *self) {
    if (self == NULL) return;
    release_export((ExportTrailer *)(self + 1));
    free(self);
}

static ExportTrailer *own_trailer(void *managed, int versioned) {
    if (versioned && ((DLManagedTensorVersioned *)managed)->deleter == deleter_versioned)
        return (ExportTrailer *)((DLManagedTensorVersioned *)managed + 1);
    if (!versioned && ((DLManagedTensor *)managed)->deleter == deleter_legacy)
        return (ExportTrailer *)((DLManagedTensor *)managed + 1);
    return NULL;
}

void call_managed_deleter(void *managed, int versioned) {
    if (managed == NULL) return;
    if (versioned) {
        DLManagedTensorVersioned *m = managed;
        if (m->deleter != NULL) m->deleter(m);
    } else {
        DLManagedTensor *m = managed;
        if (m->deleter != NULL) m->deleter(m);
    }
}

/* Conforming capsule destructor (DLPack python_spec.rst): acts only on an unconsumed
 * capsule, tolerates a NULL deleter, keeps any pending exception. */
static void capsule_destructor(PyObject *capsule) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL) {
        PyErr_Clear();
    } else if (strcmp(name, VNAME) == 0 || strcmp(name, NAME) == 0) {
        void *m = PyCapsule_GetPointer(capsule, name);
        if (m == NULL) PyErr_WriteUnraisable(capsule);
        else call_managed_deleter(m, name[8] == '_');
    }
    PyErr_Restore(et, ev, tb);
}

/* -- producing ---------------------------------------------------------------------------- */
static void *new_block(RecordObject *record, uintptr_t data, int32_t device_type, int32_t device_id, int code,
                       int bits, int ndim, const int64_t *shape, const int64_t *strides, int versioned,
                       unsigned long long flags) {
    size_t head = versioned ? sizeof(DLManagedTensorVersioned) : sizeof(DLManagedTensor);
    char *block = malloc(head + sizeof(ExportTrailer) + 2 * (size_t)ndim * sizeof(int64_t) + 1);
    if (block == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    ExportTrailer *tr = (ExportTrailer *)(block + head);
    int64_t *sh = (int64_t *)(tr + 1), *st = sh + ndim;
    if (ndim) {
        memcpy(sh, shape, (size_t)ndim * sizeof(int64_t));
        memcpy(st, strides, (size_t)ndim * sizeof(int64_t));
    }
    long long ctx = S.next_export++;
    long long token = record_add_holder(record, ctx, NULL);
    if (token < 0) {
        free(block);
        return NULL;
    }
    Py_INCREF(record);
    tr->record = record;
    tr->token = token;
    S.exports++;
    DLTensor *t;
    if (versioned) {
        DLManagedTensorVersioned *m = (DLManagedTensorVersioned *)block;
        m->version.major = 1;
        m->version.minor = 3;
        m->manager_ctx = (void *)(intptr_t)ctx;
        m->deleter = deleter_versioned;
        m->flags = flags;
        t = &m->dl_tensor;
    } else {
        DLManagedTensor *m = (DLManagedTensor *)block;
        m->manager_ctx = (void *)(intptr_t)ctx;
        m->deleter = deleter_legacy;
        t = &m->dl_tensor;
    }
    t->data = (void *)data;
    t->device.device_type = device_type;
    t->device.device_id = device_id;
    t->ndim = ndim;
    t->dtype.code = (uint8_t)code;
    t->dtype.bits = (uint8_t)bits;
    t->dtype.lanes = 1;
    t->shape = ndim ? sh : NULL;
    t->strides = ndim ? st : NULL;
    t->byte_offset = 0;
    return block;
}

/* A capsule over `record`'s memory, counted as a holder until its deleter runs. */
PyObject *export_capsule(RecordObject *record, uintptr_t data, int32_t device_type, int32_t device_id, int code,
                         int bits, int ndim, const int64_t *shape, const int64_t *strides, int versioned,
                         unsigned long long flags) {
    void *block = new_block(record, data, device_type, device_id, code, bits, ndim, shape, strides, versioned, flags);
    if (block == NULL) return NULL;
    PyObject *cap = PyCapsule_New(block, versioned ? VNAME : NAME, capsule_destructor);
    if (cap == NULL) call_managed_deleter(block, versioned); /* the holder goes, the block is freed */
    return cap;
}

DLManagedTensorVersioned *export_managed(RecordObject *record, uintptr_t data, int32_t device_type,
                                         int32_t device_id, int code, int bits, int ndim, const int64_t *shape,
                                         const int64_t *strides, unsigned long long flags) {
    return new_block(record, data, device_type, device_id, code, bits, ndim, shape, strides, 1, flags);
}

/* `seq`, a tuple of `n` ints, into `out`; ValueError naming `what` otherwise. */
int fill_i64s(PyObject *seq, int64_t *out, Py_ssize_t n, const char *what) {
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

/* export(record, data, device_type, device_id, code, bits, shape, strides, versioned, flags) -> capsule */
static PyObject *py_export(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10 || !Record_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "export(record, data, device_type, device_id, code, bits, shape, strides, "
                                         "versioned, flags)");
        return NULL;
    }
    uintptr_t data = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    long device_type = PyLong_AsLong(args[2]), device_id = PyLong_AsLong(args[3]);
    long code = PyLong_AsLong(args[4]), bits = PyLong_AsLong(args[5]);
    int versioned = PyObject_IsTrue(args[8]);
    unsigned long long flags = PyLong_AsUnsignedLongLong(args[9]);
    if (PyErr_Occurred()) return NULL;
    if (!PyTuple_Check(args[6]) || PyTuple_GET_SIZE(args[6]) > MAX_NDIM) {
        PyErr_SetString(PyExc_TypeError, "shape must be a tuple of at most 1024 ints");
        return NULL;
    }
    int ndim = (int)PyTuple_GET_SIZE(args[6]);
    int64_t buf[2 * 8], *dims = ndim <= 8 ? buf : PyMem_Malloc(2 * (size_t)ndim * sizeof(int64_t));
    if (dims == NULL) return PyErr_NoMemory();
    PyObject *cap = NULL;
    if (fill_i64s(args[6], dims, ndim, "shape") == 0 && fill_i64s(args[7], dims + ndim, ndim, "strides") == 0)
        cap = export_capsule((RecordObject *)args[0], data, (int32_t)device_type, (int32_t)device_id, (int)code,
                             (int)bits, ndim, dims, dims + ndim, versioned, flags);
    if (dims != buf) PyMem_Free(dims);
    return cap;
}

/* -- reading ------------------------------------------------------------------------------ */
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

/* The capsule's name: 1 versioned, 0 legacy; -1 with ValueError/TypeError for a consumed
 * capsule, one of another name, or no capsule. */
static int capsule_kind(PyObject *capsule) {
    if (!PyCapsule_CheckExact(capsule)) {
        PyErr_SetString(PyExc_TypeError, "expected a DLPack PyCapsule");
        return -1;
    }
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL) return -1;
    if (strcmp(name, VNAME) == 0) return 1;
    if (strcmp(name, NAME) == 0) return 0;
    if (strcmp(name, USED_VNAME) == 0 || strcmp(name, USED_NAME) == 0) PyErr_SetString(PyExc_ValueError, ALREADY_CONSUMED);
    else PyErr_Format(PyExc_ValueError,
                      "capsule named '%s' is not a DLPack tensor; expected 'dltensor' or 'dltensor_versioned'", name);
    return -1;
}

/* peek(capsule) -> tuple, reading but never renaming. For a versioned capsule of another
 * major, only the version is read: (True, ptr, major, minor). */
static PyObject *py_peek(PyObject *mod, PyObject *capsule) {
    int versioned = capsule_kind(capsule);
    if (versioned < 0) return NULL;
    void *ptr = PyCapsule_GetPointer(capsule, versioned ? VNAME : NAME);
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

/* -- consuming ---------------------------------------------------------------------------- */
/* What a DLTensor says, validated: layout, extent, flags. 0, or -1 with BufferError. */
typedef struct {
    int versioned, ndim, code, bits;
    int readonly;               /* 0, 1 (READ_ONLY), 2 (legacy: cannot say) */
    int64_t *shape, *strides; /* copies: shape, then strides (row-major for NULL) */
    int64_t dims_buf[16];     /* for ndim <= 8; else shape and strides are PyMem_Malloc'ed */
    uintptr_t element0, address;
    long long nbytes;
    int32_t device_type, device_id;
} Layout;

static void free_layout(Layout *L) {
    if (L->shape != NULL && L->shape != L->dims_buf) PyMem_Free(L->shape);
    L->shape = L->strides = NULL;
}

/* -- the one validation of a layout ----------------------------------------------------------
 * exchange/layout.py's check_ndim, check_shape and check_address, check for check and word
 * for word (tests/cpu/test_validation.py runs one table of inputs through both). Every
 * step is exact: an int64 product or sum that would wrap means the exact value is beyond
 * a limit, and the limit's error is the one Python raises for that exact value. Each
 * returns 0, or -1 with `error` set, its message starting with `what`. check_shape fills
 * strides_out (row-major for strides NULL; strides may equal strides_out), the element
 * count, the offset in bytes from element 0 to the lowest byte reached and the extent in
 * bytes. Static, so the import hot path (read_layout) gets them inlined. */

static int layout_error(PyObject *error, const char *fmt, ...) {
    char text[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    PyErr_SetString(error, text);
    return -1;
}

static inline int check_ndim(long long ndim, const char *what, PyObject *error) {
    if (ndim <= MAX_NDIM) return 0;
    return layout_error(error, "%s: %lld dimensions, more than the limit of %d; reshape to at most %d dimensions",
                        what, ndim, MAX_NDIM, MAX_NDIM);
}

static inline int check_shape(int32_t ndim, const int64_t *shape, const int64_t *strides, int64_t *strides_out,
                              int64_t itemsize, const char *what, PyObject *error, int64_t *size_out, int64_t *lo_out,
                              int64_t *nbytes_out) {
    if (check_ndim(ndim, what, error) < 0) return -1;
    int64_t size = 1;
    int zero = 0, over = 0;
    for (int32_t i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return layout_error(error, "%s: negative extent %lld in the shape; extents must be >= 0", what,
                                (long long)shape[i]);
        zero |= shape[i] == 0;
        over |= __builtin_mul_overflow(size, shape[i], &size); /* without a zero, a wrap means >= 2**63 */
    }
    if (zero) size = 0;
    else if (over)
        return layout_error(error, "%s: its element count overflows int64 (2**63 elements or more; the limit "
                            "is 2**63 - 1); no device can address it", what);
    if (strides == NULL) {
        int64_t step = 1;
        int over = 0; /* the exact step is >= 2**63 */
        for (int32_t i = ndim - 1; i >= 0; i--) {
            if (over)
                return layout_error(error, "%s: its row-major stride for dimension %d overflows int64 (the extents "
                                    "after it multiply to 2**63 or more; the limit is 2**63 - 1), even with zero "
                                    "elements; use smaller extents", what, (int)i);
            strides_out[i] = step;
            over = __builtin_mul_overflow(step, shape[i] > 1 ? shape[i] : 1, &step);
        }
    } else if (strides != strides_out && ndim > 0) {
        memcpy(strides_out, strides, (size_t)ndim * sizeof(int64_t)); /* int64 by type: in range */
    }
    *size_out = size;
    *lo_out = *nbytes_out = 0;
    if (size == 0) return 0;
    int64_t lo = 0, hi = 0, reach, span;
    for (int32_t i = 0; i < ndim; i++) { /* lo only falls, hi only rises: a wrap is past the limit */
        int64_t st = strides_out[i];
        if (__builtin_mul_overflow(st, shape[i] - 1, &reach) ||
            (st < 0 ? __builtin_add_overflow(lo, reach, &lo) : __builtin_add_overflow(hi, reach, &hi)))
            goto extent;
    }
    if (__builtin_sub_overflow(hi, lo, &span) || __builtin_add_overflow(span, 1, &span) ||
        __builtin_mul_overflow(span, itemsize, &span))
        goto extent;
    *lo_out = lo * itemsize; /* |lo| < span: no wrap */
    *nbytes_out = span;
    return 0;
extent:
    return layout_error(error, "%s: its extent in bytes overflows int64 (its shape and strides reach 2**63 bytes or "
                        "more; the limit is 2**63 - 1); check the strides (in elements, not bytes)", what);
}

static inline int check_address(uint64_t data, uint64_t byte_offset, int64_t lo, int64_t nbytes, const char *what,
                                PyObject *error, uint64_t *element0_out, uint64_t *address_out) {
    uint64_t element0, last;
    if (__builtin_add_overflow(data, byte_offset, &element0))
        return layout_error(error, "%s: data 0x%llx + byte_offset %llu is outside the address space [0, 2**64)", what,
                            (unsigned long long)data, (unsigned long long)byte_offset);
    *element0_out = *address_out = element0;
    if (nbytes == 0) return 0;
    uint64_t below = (uint64_t)(-lo), reach = (uint64_t)(lo + nbytes); /* 0 <= -lo < nbytes < 2**63 */
    if (below > element0)
        return layout_error(error, "%s: its negative strides reach %llu bytes below element 0 at 0x%llx, below "
                            "address 0 (every byte reached must lie in [0, 2**64))", what,
                            (unsigned long long)below, (unsigned long long)element0);
    if (__builtin_add_overflow(element0, reach - 1, &last))
        return layout_error(error, "%s: it reaches %llu bytes from element 0 at 0x%llx, past the last address "
                            "2**64 - 1 (every byte reached must lie in [0, 2**64))", what,
                            (unsigned long long)reach, (unsigned long long)element0);
    *address_out = element0 - below;
    return 0;
}

static const char DLPACK_TENSOR[] = "DLPack tensor";

static int read_layout(void *managed, int versioned, Layout *L) {
    DLTensor *t = versioned ? &((DLManagedTensorVersioned *)managed)->dl_tensor : &((DLManagedTensor *)managed)->dl_tensor;
    unsigned long long flags = versioned ? ((DLManagedTensorVersioned *)managed)->flags : 0;
    int32_t ndim = t->ndim;
    L->versioned = versioned;
    L->shape = L->strides = NULL;
    if (check_ndim(ndim, DLPACK_TENSOR, PyExc_BufferError) < 0) return -1;
    if (ndim < 0 || (ndim > 0 && t->shape == NULL)) {
        PyErr_Format(PyExc_BufferError, "DLPack tensor has ndim=%d but no readable shape (NULL, or ndim negative)",
                     (int)ndim);
        return -1;
    }
    if (t->dtype.lanes != 1) {
        PyErr_Format(PyExc_BufferError,
                     "DLPack dtype with lanes=%d (a vector element type) is not supported; lanes must be 1",
                     (int)t->dtype.lanes);
        return -1;
    }
    int bits = t->dtype.bits;
    if (bits == 0 || bits % 8 != 0) {
        PyErr_Format(PyExc_BufferError,
                     "DLPack dtype (code=%d, bits=%d) is not supported; sub-byte and odd widths cannot be held",
                     (int)t->dtype.code, bits);
        return -1;
    }
    /* Copied, never pointed into: Python code runs before the Tensor is built (a device's
     * or dtype's first validation, tx.track, EXCHANGE_DEBUG, the GC), and meanwhile
     * another thread may consume this capsule and free the producer's struct. */
    L->shape = ndim <= 8 ? L->dims_buf : PyMem_Malloc(2 * (size_t)ndim * sizeof(int64_t));
    if (L->shape == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    L->strides = L->shape + ndim;
    if (ndim) memcpy(L->shape, t->shape, (size_t)ndim * sizeof(int64_t));
    if (ndim && t->strides != NULL) memcpy(L->strides, t->strides, (size_t)ndim * sizeof(int64_t));
    int64_t size = 0, lo = 0, nbytes = 0;
    uint64_t element0 = 0, address = 0;
    if (check_shape(ndim, L->shape, t->strides != NULL ? L->strides : NULL, L->strides, bits / 8, DLPACK_TENSOR,
                    PyExc_BufferError, &size, &lo, &nbytes) < 0)
        goto fail;
    if (size && t->data == NULL) {
        PyErr_Format(PyExc_BufferError,
                     "DLPack tensor has a NULL data pointer but %lld elements; it is malformed (only a zero-size "
                     "tensor may have NULL data)", (long long)size);
        goto fail;
    }
    if (check_address((uint64_t)(uintptr_t)t->data, t->byte_offset, lo, nbytes, DLPACK_TENSOR, PyExc_BufferError,
                      &element0, &address) < 0)
        goto fail;
    L->ndim = ndim;
    L->code = t->dtype.code;
    L->bits = bits;
    L->element0 = (uintptr_t)element0;
    L->address = (uintptr_t)address;
    L->nbytes = (long long)nbytes;
    L->device_type = t->device.device_type;
    L->device_id = t->device.device_id;
    L->readonly = !versioned ? 2 : (flags & DLPACK_FLAG_BITMASK_READ_ONLY) ? 1 : 0;
    return 0;
fail:
    free_layout(L);
    return -1;
}

/* check_layout(shape, strides or None, itemsize, data, byte_offset, what, error) ->
 * (strides, element0, address, nbytes): the compiled twin of exchange.layout.check_layout
 * over int64 shapes and strides and uint64 addresses, for the tests that compare them. */
static PyObject *py_check_layout(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyTuple_Check(args[0]) || !PyUnicode_Check(args[5]) || !PyExceptionClass_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "check_layout(shape, strides, itemsize, data, byte_offset, what, error)");
        return NULL;
    }
    Py_ssize_t ndim = PyTuple_GET_SIZE(args[0]);
    const char *what = PyUnicode_AsUTF8(args[5]);
    long long itemsize = PyLong_AsLongLong(args[2]);
    unsigned long long data = PyLong_AsUnsignedLongLong(args[3]), byte_offset = PyLong_AsUnsignedLongLong(args[4]);
    if (what == NULL || PyErr_Occurred()) return NULL;
    if (itemsize < 1) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be >= 1");
        return NULL;
    }
    if (check_ndim(ndim, what, args[6]) < 0) return NULL;
    int64_t buf[16], *dims = ndim <= 8 ? buf : PyMem_Malloc(2 * (size_t)ndim * sizeof(int64_t) + 1);
    if (dims == NULL) return PyErr_NoMemory();
    PyObject *result = NULL;
    int64_t size = 0, lo = 0, nbytes = 0;
    uint64_t element0 = 0, address = 0;
    int given = args[1] != Py_None;
    if (fill_i64s(args[0], dims, ndim, "shape") == 0 && (!given || fill_i64s(args[1], dims + ndim, ndim, "strides") == 0) &&
        check_shape((int32_t)ndim, dims, given ? dims + ndim : NULL, dims + ndim, itemsize, what, args[6], &size, &lo,
                    &nbytes) == 0 &&
        check_address(data, byte_offset, lo, nbytes, what, args[6], &element0, &address) == 0) {
        PyObject *strides = tuple_i64(dims + ndim, (int32_t)ndim);
        if (strides != NULL)
            result = Py_BuildValue("(NKKL)", strides, (unsigned long long)element0, (unsigned long long)address,
                                   (long long)nbytes);
    }
    if (dims != buf) PyMem_Free(dims);
    return result;
}

/* Devices and dtypes seen, looked up by their DLPack numbers without a Python call: a
 * few devices searched in order, dtypes by (code, bytes). Filled from the Python
 * validators on a miss (they raise BufferError for what cannot be held). */
#define DEVICE_CACHE 32
static struct { int32_t type, id; PyObject *device; Py_ssize_t slot; } devices[DEVICE_CACHE];
static int ndevices = 0;
static PyObject *dtypes[32][33]; /* [code][bits / 8], for codes < 32 and up to 256 bits */

static PyObject *cached_device(int32_t type, int32_t id, Py_ssize_t *slot) {
    for (int i = 0; i < ndevices; i++) {
        if (devices[i].type == type && devices[i].id == id) {
            *slot = devices[i].slot;
            return Py_NewRef(devices[i].device);
        }
    }
    PyObject *device = PyObject_CallFunction(S.validate_device, "ii", (int)type, (int)id);
    if (device == NULL) return NULL;
    *slot = device_slot(device);
    if (*slot < 0) {
        Py_DECREF(device);
        return NULL;
    }
    if (ndevices < DEVICE_CACHE) {
        devices[ndevices].type = type;
        devices[ndevices].id = id;
        devices[ndevices].device = Py_NewRef(device);
        devices[ndevices].slot = *slot;
        ndevices++;
    }
    return device;
}

static PyObject *cached_dtype(int code, int bits) {
    int cached = code >= 0 && code < 32 && bits / 8 <= 32;
    if (cached && dtypes[code][bits / 8] != NULL) return Py_NewRef(dtypes[code][bits / 8]);
    PyObject *dtype = PyObject_CallFunction(S.validate_dtype, "iii", code, bits, 1);
    if (dtype != NULL && cached) dtypes[code][bits / 8] = Py_NewRef(dtype);
    return dtype;
}

/* Is the capsule still unconsumed? Rename it (one step under the GIL): 0, or -1 with
 * ValueError when another thread consumed it while Python code ran here. */
static int claim(PyObject *capsule, int versioned) {
    if (capsule == NULL) return 0;
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL || strcmp(name, versioned ? VNAME : NAME) != 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, ALREADY_CONSUMED);
        return -1;
    }
    return PyCapsule_SetName(capsule, versioned ? USED_VNAME : USED_NAME);
}

/* A versioned tensor of another major version is refused (DLPack: the consumer calls
 * its deleter): the capsule (if any) marked used, the deleter called, BufferError. 0 for
 * major 1. */
static int refuse_other_major(void *managed, PyObject *capsule) {
    DLManagedTensorVersioned *m = managed;
    if (m->version.major == 1) return 0;
    unsigned long major = m->version.major, minor = m->version.minor;
    if (capsule != NULL && PyCapsule_SetName(capsule, USED_VNAME) < 0) return -1;
    call_managed_deleter(m, 1);
    PyErr_Format(PyExc_BufferError,
                 "DLPack version %lu.%lu is not supported (this library reads major version 1); "
                 "ask the producer for max_version=(1, 3)", major, minor);
    return -1;
}

/* Take a producer's managed tensor as a tx Tensor: validate, make an imported record
 * whose release is one call of its deleter (with the Tensor as first holder), build the
 * Tensor, and only then claim the capsule (if any). A capsule we exported comes back as
 * a view of the same record. Any failure before the claim leaves the deleter the
 * producer's (nothing was taken); for `capsule` NULL (the exchange API, which hands
 * the tensor over) a failure calls the deleter. */
PyObject *consume_managed(void *managed, int versioned, PyObject *capsule, PyObject *producer, PyObject *owner,
                          PyObject *stream) {
    if (versioned && refuse_other_major(managed, capsule) < 0) return NULL;
    Layout L;
    PyObject *device = NULL, *dtype = NULL, *tensor = NULL;
    if (read_layout(managed, versioned, &L) < 0) goto refuse;
    ExportTrailer *own = own_trailer(managed, versioned);
    if (own != NULL && own->record != NULL) {
        /* Ours, coming back (DESIGN.md: re-export shares one record). Claimed first: the
         * deleter call is ours from here on, and it releases the export's holder. */
        RecordObject *r = own->record;
        Py_INCREF(r);
        dtype = cached_dtype(L.code, L.bits);
        if (dtype == NULL || claim(capsule, versioned) < 0) {
            Py_DECREF(r);
            goto refuse;
        }
        long long token = record_add_holder(r, 0, NULL);
        if (token >= 0)
            tensor = tensor_new(r, token, L.element0, L.ndim, L.shape, L.strides, dtype, L.code, L.bits, L.readonly,
                                stream);
        if (tensor != NULL && stream != NULL && tensor_add_stream(r, stream) < 0) Py_CLEAR(tensor);
        if (tensor == NULL && token >= 0) record_remove_holder(r, token);
        Py_DECREF(r);
        Py_DECREF(dtype);
        free_layout(&L);
        call_managed_deleter(managed, versioned);
        return tensor;
    }
    Py_ssize_t slot;
    device = cached_device(L.device_type, L.device_id, &slot);
    if (device == NULL) goto refuse;
    dtype = cached_dtype(L.code, L.bits);
    if (dtype == NULL) goto refuse;
    long long token = 0;
    RecordObject *r = record_new(device, slot, L.device_type, L.device_id, L.address, L.nbytes, producer,
                                 KIND_IMPORTED, NULL, NULL, versioned, owner, &token);
    if (r == NULL) goto refuse;
    tensor = tensor_new(r, token, L.element0, L.ndim, L.shape, L.strides, dtype, L.code, L.bits, L.readonly, stream);
    if (tensor == NULL || (stream != NULL && tensor_add_stream(r, stream) < 0) || claim(capsule, versioned) < 0) {
        /* nothing was taken: forget the record without its release, drop the Tensor */
        if (tensor != NULL) ((TensorObject *)tensor)->token = 0;
        Py_CLEAR(tensor);
        record_gone(r);
        Py_DECREF(r);
        goto refuse;
    }
    r->rel.managed = managed; /* taken: from now on the record's release calls the deleter */
    r->flags |= F_NATIVE;
    Py_DECREF(r);
    Py_DECREF(device);
    Py_DECREF(dtype);
    free_layout(&L);
    return tensor;
refuse:
    Py_XDECREF(device);
    Py_XDECREF(dtype);
    free_layout(&L);
    if (capsule == NULL) { /* handed over to us: the deleter is ours to call */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        call_managed_deleter(managed, versioned);
        PyErr_Restore(et, ev, tb);
    }
    return NULL;
}

PyObject *consume_capsule(PyObject *capsule, PyObject *producer, PyObject *owner, PyObject *stream) {
    int versioned = capsule_kind(capsule);
    if (versioned < 0) return NULL;
    void *ptr = PyCapsule_GetPointer(capsule, versioned ? VNAME : NAME);
    if (ptr == NULL) return NULL;
    return consume_managed(ptr, versioned, capsule, producer, owner, stream);
}

/* consume(capsule, producer, owner, stream) -> Tensor */
static PyObject *py_consume(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "consume(capsule, producer, owner, stream)");
        return NULL;
    }
    return consume_capsule(args[0], args[1], args[2] == Py_None ? NULL : args[2], args[3] == Py_None ? NULL : args[3]);
}

/* import_info(capsule): the pure path's reading of a capsule, for tests comparing both. */
static PyObject *py_import_info(PyObject *mod, PyObject *capsule) {
    int versioned = capsule_kind(capsule);
    if (versioned < 0) return NULL;
    void *ptr = PyCapsule_GetPointer(capsule, versioned ? VNAME : NAME);
    if (ptr == NULL) return NULL;
    if (versioned && refuse_other_major(ptr, capsule) < 0) return NULL;
    Layout L;
    if (read_layout(ptr, versioned, &L) < 0) return NULL;
    ExportTrailer *own = own_trailer(ptr, versioned);
    PyObject *shape = tuple_i64(L.shape, L.ndim), *strides = tuple_i64(L.strides, L.ndim);
    free_layout(&L);
    if (shape == NULL || strides == NULL) {
        Py_XDECREF(shape);
        Py_XDECREF(strides);
        return NULL;
    }
    PyObject *readonly = L.readonly == 2 ? PyLong_FromLong(2) : PyBool_FromLong(L.readonly);
    void *ctx = versioned ? ((DLManagedTensorVersioned *)ptr)->manager_ctx : ((DLManagedTensor *)ptr)->manager_ctx;
    long long own_ctx = own != NULL ? (long long)(intptr_t)ctx : 0;
    return Py_BuildValue("(ONNNNLOOiiiiNNL)", versioned ? Py_True : Py_False, PyLong_FromVoidPtr(ptr), readonly,
                         PyLong_FromVoidPtr((void *)L.element0), PyLong_FromVoidPtr((void *)L.address), L.nbytes,
                         Py_None, Py_None, (int)L.device_type, (int)L.device_id, L.code, L.bits, shape, strides,
                         own_ctx);
}

/* mark_used(capsule): rename to the used_ name (ValueError if it is not unconsumed). */
static PyObject *py_mark_used(PyObject *mod, PyObject *capsule) {
    int versioned = capsule_kind(capsule);
    if (versioned < 0 || claim(capsule, versioned) < 0) return NULL;
    Py_RETURN_NONE;
}

/* call_deleter(ptr, versioned): the consumer's one call of the producer's deleter. */
static PyObject *py_call_deleter(PyObject *mod, PyObject *args) {
    PyObject *addr;
    int versioned;
    if (!PyArg_ParseTuple(args, "Op", &addr, &versioned)) return NULL;
    void *ptr = PyLong_AsVoidPtr(addr);
    if (ptr == NULL && PyErr_Occurred()) return NULL;
    call_managed_deleter(ptr, versioned);
    Py_RETURN_NONE;
}

PyMethodDef capsule_methods[] = {
    {"export", (PyCFunction)(void (*)(void))py_export, METH_FASTCALL, "Make a DLPack capsule over a record."},
    {"consume", (PyCFunction)(void (*)(void))py_consume, METH_FASTCALL, "Take a DLPack capsule as a Tensor."},
    {"peek", py_peek, METH_O, "Read a DLPack capsule without consuming it."},
    {"import_info", py_import_info, METH_O, "Read and validate a DLPack capsule (as the pure path does)."},
    {"mark_used", py_mark_used, METH_O, "Rename a DLPack capsule to its used_ name."},
    {"check_layout", (PyCFunction)(void (*)(void))py_check_layout, METH_FASTCALL,
     "The one validation of a layout (as exchange.layout.check_layout)."},
    {"call_deleter", py_call_deleter, METH_VARARGS, "Call a managed tensor's deleter once."},
    {NULL, NULL, 0, NULL},
};
