/* exchange._native: the module, its setup from Python, and the registry's counters.
 * See native.h for what lives where. */
#include "native.h"

#include <string.h>

NativeState S;

/* -- the registry's counters -------------------------------------------------------------
 * Bytes per device slot (exchange.device._slot_of), live and pending release, and the
 * peak of live bytes while someone measures it. Each call is one step under the GIL. */
#define MAX_SLOTS 1024
static long long live_bytes[MAX_SLOTS], pending_bytes[MAX_SLOTS];
static long long total_live = 0, peak_live = 0;
static long peak_users = 0;

void bytes_add(Py_ssize_t slot, long long delta) {
    if (slot < 0 || slot >= MAX_SLOTS) return;
    live_bytes[slot] += delta;
    total_live += delta;
    if (peak_users && total_live > peak_live) peak_live = total_live;
}

Py_ssize_t device_slot(PyObject *device) {
    PyObject *slot = PyObject_GetAttr(device, S.str_slot);
    if (slot == NULL) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(slot);
    Py_DECREF(slot);
    return n;
}

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
static PyObject *py_bytes_add(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "bytes_add(slot, delta)");
        return NULL;
    }
    if (slot_arg(args[0], &slot) < 0) return NULL;
    long long delta = PyLong_AsLongLong(args[1]);
    if (delta == -1 && PyErr_Occurred()) return NULL;
    bytes_add(slot, delta);
    Py_RETURN_NONE;
}

/* pending_add(slot, delta): bytes of one device waiting for their release change. */
static PyObject *py_pending_add(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t slot;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pending_add(slot, delta)");
        return NULL;
    }
    if (slot_arg(args[0], &slot) < 0) return NULL;
    long long delta = PyLong_AsLongLong(args[1]);
    if (delta == -1 && PyErr_Occurred()) return NULL;
    pending_bytes[slot] += delta;
    Py_RETURN_NONE;
}

/* counts(slots) -> ([live bytes], [pending bytes]) for the first `slots` slots. */
static PyObject *py_counts(PyObject *mod, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || n > MAX_SLOTS) n = MAX_SLOTS;
    PyObject *live = PyList_New(n), *pending = PyList_New(n);
    if (live == NULL || pending == NULL) {
        Py_XDECREF(live);
        Py_XDECREF(pending);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyLong_FromLongLong(live_bytes[i]), *b = PyLong_FromLongLong(pending_bytes[i]);
        if (a == NULL || b == NULL) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_DECREF(live);
            Py_DECREF(pending);
            return NULL;
        }
        PyList_SET_ITEM(live, i, a);
        PyList_SET_ITEM(pending, i, b);
    }
    return Py_BuildValue("(NN)", live, pending);
}

static PyObject *py_peak_begin(PyObject *mod, PyObject *unused) {
    if (peak_users++ == 0 || total_live > peak_live) peak_live = total_live;
    Py_RETURN_NONE;
}

static PyObject *py_peak_end(PyObject *mod, PyObject *unused) {
    if (peak_users > 0) peak_users--;
    return PyLong_FromLongLong(peak_live);
}

static PyObject *py_peak_value(PyObject *mod, PyObject *unused) { return PyLong_FromLongLong(peak_live); }

/* reset_counts(): zero the byte counters (a forked child recounts its records). */
static PyObject *py_reset_counts(PyObject *mod, PyObject *unused) {
    memset(live_bytes, 0, sizeof live_bytes);
    memset(pending_bytes, 0, sizeof pending_bytes);
    total_live = peak_live = 0;
    peak_users = 0;
    Py_RETURN_NONE;
}

/* totals() -> dict of the registry's running counts. */
static PyObject *py_totals(PyObject *mod, PyObject *unused) {
    return Py_BuildValue("{s:n,s:L,s:L,s:L,s:L}", "live_records", S.live, "created_total", S.next_id - 1,
                         "released_total", S.released, "imports_outstanding", S.imports - S.imports_gone,
                         "exports_outstanding", S.exports);
}

void warn_message(const char *message) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (S.warn != NULL && !S.finalizing) {
        PyObject *r = PyObject_CallFunction(S.warn, "s", message);
        if (r == NULL) PyErr_Clear();
        Py_XDECREF(r);
    }
    PyErr_Restore(et, ev, tb);
}

/* setup(**hooks): the Python objects the compiled core calls (see NativeState). */
static PyObject *py_setup(PyObject *mod, PyObject *args, PyObject *kwargs) {
    static const char *names[] = {"tensor_type", "record_type", "begin_release", "warn", "note_tracked", "where",
                                  "slow_from_dlpack", "validate_device", "validate_dtype", "lifetime_error", "cpu",
                                  "allocate", "adopt_device", "debug", NULL};
    PyObject *o[13];
    int debug = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OOOOOOOOOOOOOp", (char **)names, &o[0], &o[1], &o[2], &o[3],
                                     &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &o[11], &o[12], &debug))
        return NULL;
    PyObject **slots[] = {&S.tensor_type, &S.record_type, &S.begin_release, &S.warn, &S.note_tracked, &S.where,
                          &S.slow_from_dlpack, &S.validate_device, &S.validate_dtype, &S.lifetime_error, &S.cpu,
                          &S.allocate, &S.adopt_device};
    Py_ssize_t cpu_slot = device_slot(o[10]);
    if (cpu_slot < 0) return NULL;
    PyObject *cpu_type = PyObject_GetAttrString(o[10], "type");
    if (cpu_type == NULL) return NULL;
    PyObject *cpu_dlpack_device = Py_BuildValue("(Ni)", cpu_type, 0);
    if (cpu_dlpack_device == NULL) return NULL;
    Py_XSETREF(S.cpu_dlpack_device, cpu_dlpack_device);
    for (int i = 0; i < 13; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*slots[i], o[i]);
    }
    S.cpu_slot = cpu_slot;
    S.debug = debug;
    Py_RETURN_NONE;
}

/* make_type("tensor" | "record") -> the public class over TensorBase / RecordBase: a heap
 * type made here (not by a class statement), so a Tensor is not tracked by the garbage
 * collector (a Python class's instances always are) and both deallocate without
 * subtype_dealloc. Python attaches the methods (exchange/_core/_compiled.py, with the views of
 * exchange/tensor.py, exporting.py and registry.py). */
static PyObject *py_make_type(PyObject *mod, PyObject *arg) {
    if (PyUnicode_Check(arg) && PyUnicode_CompareWithASCIIString(arg, "tensor") == 0) return tensor_heap_type();
    if (PyUnicode_Check(arg) && PyUnicode_CompareWithASCIIString(arg, "record") == 0) return record_heap_type();
    PyErr_SetString(PyExc_ValueError, "make_type('tensor') or make_type('record')");
    return NULL;
}

/* set_note_gone(fn | None): tx.trace's note of each record leaving the live set. */
static PyObject *py_set_note_gone(PyObject *mod, PyObject *arg) {
    Py_XSETREF(S.note_gone, arg == Py_None ? NULL : Py_NewRef(arg));
    Py_RETURN_NONE;
}

static PyObject *py_set_tracking(PyObject *mod, PyObject *arg) {
    S.tracking = PyObject_IsTrue(arg);
    if (S.tracking < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_set_finalizing(PyObject *mod, PyObject *unused) {
    S.finalizing = 1;
    Py_RETURN_NONE;
}

static PyObject *py_set_debug(PyObject *mod, PyObject *arg) {
    S.debug = PyObject_IsTrue(arg);
    if (S.debug < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"bytes_add", (PyCFunction)(void (*)(void))py_bytes_add, METH_FASTCALL, "Live bytes of a device slot change."},
    {"pending_add", (PyCFunction)(void (*)(void))py_pending_add, METH_FASTCALL, "Pending bytes of a slot change."},
    {"counts", py_counts, METH_O, "Live and pending bytes of the first N device slots."},
    {"peak_begin", py_peak_begin, METH_NOARGS, "Start measuring the peak of live bytes."},
    {"peak_end", py_peak_end, METH_NOARGS, "End one peak measurement; returns the peak."},
    {"peak_value", py_peak_value, METH_NOARGS, "The peak of live bytes measured so far."},
    {"reset_counts", py_reset_counts, METH_NOARGS, "Zero the byte counters."},
    {"totals", py_totals, METH_NOARGS, "The registry's running counts."},
    {"setup", (PyCFunction)(void (*)(void))py_setup, METH_VARARGS | METH_KEYWORDS, "Give the core its hooks."},
    {"set_tracking", py_set_tracking, METH_O, "Whether a tx.track() block is open anywhere."},
    {"set_note_gone", py_set_note_gone, METH_O, "tx.trace's note of records leaving the live set (None: off)."},
    {"make_type", py_make_type, METH_O, "The public Tensor or Record class."},
    {"set_finalizing", py_set_finalizing, METH_NOARGS, "From now on deleters only free their block."},
    {"set_debug", py_set_debug, METH_O, "EXCHANGE_DEBUG: keep where each record was made."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "exchange._native", NULL, -1, NULL};

static int add_methods(PyObject *m, PyMethodDef *defs) {
    for (PyMethodDef *d = defs; d->ml_name != NULL; d++) {
        PyObject *f = PyCFunction_NewEx(d, m, NULL);
        if (f == NULL || PyModule_AddObject(m, d->ml_name, f) < 0) {
            Py_XDECREF(f);
            return -1;
        }
    }
    return 0;
}

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    S.next_id = S.next_token = S.next_export = 1;
    S.cpu_slot = -1;
    S.str_tensor = PyUnicode_InternFromString("tx.Tensor");
    S.str_slot = PyUnicode_InternFromString("_slot");
    S.str_streams = PyUnicode_InternFromString("_streams");
    S.str_more = PyUnicode_InternFromString("_more");
    S.str_dlpack = PyUnicode_InternFromString("__dlpack__");
    S.str_exchange_api = PyUnicode_InternFromString("__dlpack_c_exchange_api__");
    S.kw_max_version = Py_BuildValue("(s)", "max_version");
    S.max_version = Py_BuildValue("(ii)", 1, 3);
    S.api_cache = PyDict_New();
    if (S.str_tensor == NULL || S.str_slot == NULL || S.str_streams == NULL || S.str_more == NULL || S.str_dlpack == NULL || S.str_exchange_api == NULL || S.kw_max_version == NULL ||
        S.max_version == NULL || S.api_cache == NULL || add_methods(m, module_methods) < 0 ||
        add_methods(m, capsule_methods) < 0 || add_methods(m, copy_methods) < 0 || add_methods(m, registry_methods) < 0 ||
        add_methods(m, tensor_methods) < 0 || registry_types_ready(m) < 0 || tensor_types_ready(m) < 0 ||
        hostqueue_type_ready(m) < 0 || add_methods(m, stagetask_methods) < 0 || stagetask_type_ready() < 0) {
        Py_DECREF(m);
        return NULL;
    }
    S.call_deleter = PyObject_GetAttrString(m, "call_deleter");
    if (S.call_deleter == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
