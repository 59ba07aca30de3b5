/* Records: the registry's entries, their holders, the live list, and the release of a
 * record no stream used (the hot path). The stream-ordered release of a record some
 * stream used is Python's (registry._begin_release, the reaper): it waits anyway.
 *
 * The Python class exchange.registry.Record derives from RecordBase and adds the
 * read-only views (origin, holders, streams, describe); the pure-Python path has a
 * Python RecordBase with the same attributes. */
#include "native.h"

#include <structmember.h>

static const char *STATE_NAMES[] = {"live", "releasing", "released"};
static const char *KIND_NAMES[] = {"allocated", "imported", "borrowed"};
static PyObject *state_str[3], *kind_str[3];

/* -- the live list ------------------------------------------------------------------------ */
static void link_record(RecordObject *r) {
    Py_INCREF(r);
    r->prev = S.tail;
    r->next = NULL;
    if (S.tail) S.tail->next = r;
    else S.head = r;
    S.tail = r;
    S.live++;
}

/* The record leaves the live set and the counts (once: a record not linked is left). */
void record_gone(RecordObject *r) {
    int linked = r->prev != NULL || S.head == r;
    r->state = RELEASED;
    if (!linked) return;
    if (r->prev) r->prev->next = r->next;
    else S.head = r->next;
    if (r->next) r->next->prev = r->prev;
    else S.tail = r->prev;
    r->prev = r->next = NULL;
    S.live--;
    S.released++;
    bytes_add(r->slot, -r->nbytes);
    if (r->kind == KIND_IMPORTED) S.imports_gone++;
    Py_DECREF(r); /* the list's reference */
}

RecordObject *record_new(PyObject *device, int32_t dev_type, int32_t dev_id, uintptr_t address, long long nbytes,
                         PyObject *origin, int kind, PyObject *release, void *managed, int versioned, PyObject *owner,
                         long long *token_out) {
    PyTypeObject *type = (PyTypeObject *)(S.record_type ? S.record_type : (PyObject *)&RecordBase_Type);
    Py_ssize_t slot = device_slot(device);
    if (slot < 0) return NULL;
    RecordObject *r = (RecordObject *)type->tp_alloc(type, 0);
    if (r == NULL) return NULL;
    Py_INCREF(device);
    r->device = device;
    r->address = address;
    r->nbytes = nbytes;
    Py_INCREF(origin);
    r->origin = origin;
    r->kind = kind;
    r->state = LIVE;
    r->versioned = versioned;
    r->slot = slot;
    r->dev_type = dev_type;
    r->dev_id = dev_id;
    Py_XINCREF(release);
    r->release = release == Py_None ? (Py_XDECREF(release), NULL) : release;
    r->managed = managed;
    Py_XINCREF(owner);
    r->owner = owner;
    if (token_out != NULL) {
        long long token = S.next_token++;
        r->holders[0].token = token;
        r->holders[0].desc = NULL; /* "tx.Tensor" */
        r->nholders = 1;
        *token_out = token;
    }
    r->id = S.next_id++;
    link_record(r);
    bytes_add(slot, nbytes);
    if (kind == KIND_IMPORTED) S.imports++;
    if (S.tracking && S.note_tracked != NULL) {
        PyObject *res = PyObject_CallOneArg(S.note_tracked, (PyObject *)r);
        if (res == NULL) PyErr_WriteUnraisable(S.note_tracked);
        Py_XDECREF(res);
    }
    if (S.debug && S.where != NULL) {
        PyObject *where = PyObject_CallNoArgs(S.where);
        if (where == NULL || PyObject_SetAttrString((PyObject *)r, "where", where) < 0) PyErr_WriteUnraisable(S.where);
        Py_XDECREF(where);
    }
    return r;
}

/* -- holders ------------------------------------------------------------------------------- */
long long record_add_holder(RecordObject *r, long long ctx, PyObject *desc) {
    if (r->state != LIVE) {
        PyErr_Format(S.lifetime_error ? S.lifetime_error : PyExc_RuntimeError,
                     "record #%lld is already %s; it cannot get a new holder", r->id, STATE_NAMES[r->state]);
        return -1;
    }
    long long token = S.next_token++;
    for (int i = 0; i < INLINE_HOLDERS; i++) {
        if (r->holders[i].token == 0) {
            r->holders[i].token = token;
            r->holders[i].ctx = ctx;
            Py_XINCREF(desc);
            r->holders[i].desc = desc;
            r->nholders++;
            return token;
        }
    }
    if (r->more == NULL && (r->more = PyDict_New()) == NULL) return -1;
    PyObject *key = PyLong_FromLongLong(token);
    PyObject *value = desc != NULL ? (Py_INCREF(desc), desc) : ctx ? PyLong_FromLongLong(ctx) : (Py_INCREF(S.str_tensor), S.str_tensor);
    int rc = key && value ? PyDict_SetItem(r->more, key, value) : -1;
    Py_XDECREF(key);
    Py_XDECREF(value);
    if (rc < 0) return -1;
    r->nholders++;
    return token;
}

static int take_holder(RecordObject *r, long long token) {
    for (int i = 0; i < INLINE_HOLDERS; i++) {
        if (r->holders[i].token == token) {
            r->holders[i].token = 0;
            r->holders[i].ctx = 0;
            Py_CLEAR(r->holders[i].desc);
            return 1;
        }
    }
    if (r->more == NULL) return 0;
    PyObject *key = PyLong_FromLongLong(token);
    if (key == NULL) { PyErr_Clear(); return 0; }
    int found = PyDict_Contains(r->more, key);
    if (found == 1 && PyDict_DelItem(r->more, key) < 0) found = 0;
    if (found < 0) found = 0;
    PyErr_Clear();
    Py_DECREF(key);
    return found;
}

static void run_release(RecordObject *r, PyObject *release, void *managed, int versioned) {
    if (S.finalizing) return; /* a late release must not call into a finalising interpreter */
    if (managed != NULL) {
        call_managed_deleter(managed, versioned);
        return;
    }
    if (release == NULL) return;
    PyObject *res;
    if (PyTuple_CheckExact(release) && PyTuple_GET_SIZE(release) >= 1) {
        PyObject *args = PyTuple_GetSlice(release, 1, PyTuple_GET_SIZE(release));
        res = args ? PyObject_Call(PyTuple_GET_ITEM(release, 0), args, NULL) : NULL;
        Py_XDECREF(args);
    } else {
        res = PyObject_CallNoArgs(release);
    }
    if (res != NULL) {
        Py_DECREF(res);
        return;
    }
    /* a release never raises into a deleter: it becomes a warning */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *text = ev ? PyObject_Str(ev) : NULL;
    const char *name = et ? ((PyTypeObject *)et)->tp_name : "error";
    PyObject *msg = PyUnicode_FromFormat("release of record #%lld failed (%s: %U); the memory may have leaked",
                                         r->id, name, text ? text : Py_None);
    if (text == NULL || msg == NULL) PyErr_Clear();
    if (msg != NULL) warn_message(PyUnicode_AsUTF8(msg));
    Py_XDECREF(msg);
    Py_XDECREF(text);
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
}

/* Drop a holder; the last one starts the release: stream-ordered through Python when
 * a stream used the memory, else at once, here. Never fails (errors are warnings). */
int record_remove_holder(RecordObject *r, long long token) {
    if (!take_holder(r, token)) return 0;
    if (--r->nholders > 0 || r->state != LIVE) return 0;
    Py_INCREF(r);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb); /* a deleter may run with an exception pending */
    if (r->streams != NULL && PyDict_GET_SIZE(r->streams) > 0) {
        r->state = RELEASING;
        PyObject *streams = PyDict_Values(r->streams);
        PyObject *res = streams ? PyObject_CallFunctionObjArgs(S.begin_release, (PyObject *)r, streams, NULL) : NULL;
        if (res == NULL) PyErr_WriteUnraisable(S.begin_release);
        Py_XDECREF(res);
        Py_XDECREF(streams);
    } else {
        PyObject *release = r->release, *owner = r->owner;
        void *managed = r->managed;
        r->release = NULL;
        r->owner = NULL;
        r->managed = NULL;
        record_gone(r);
        run_release(r, release, managed, r->versioned);
        Py_XDECREF(release);
        Py_XDECREF(owner); /* dropping a producer's object may release one of our exports */
    }
    PyErr_Restore(et, ev, tb);
    Py_DECREF(r);
    return 0;
}

/* -- the Python face ------------------------------------------------------------------------ */
static PyObject *Record_new_refused(PyTypeObject *t, PyObject *a, PyObject *k) {
    PyErr_SetString(PyExc_TypeError, "records are made by the registry (tx.empty, tx.from_dlpack, tx.borrow)");
    return NULL;
}

/* Instances are of the Python subclass, whose traverse visits the type itself. */
static int Record_traverse(RecordObject *r, visitproc visit, void *arg) {
    Py_VISIT(r->owner);
    Py_VISIT(r->release);
    Py_VISIT(r->streams);
    Py_VISIT(r->dict);
    Py_VISIT(r->more);
    for (int i = 0; i < INLINE_HOLDERS; i++) Py_VISIT(r->holders[i].desc);
    return 0;
}

static int Record_clear(RecordObject *r) {
    Py_CLEAR(r->owner);
    Py_CLEAR(r->release);
    Py_CLEAR(r->streams);
    Py_CLEAR(r->dict);
    Py_CLEAR(r->more);
    for (int i = 0; i < INLINE_HOLDERS; i++) Py_CLEAR(r->holders[i].desc);
    return 0;
}

/* The Python subclass's dealloc calls this, then drops its reference to the type. */
static void Record_dealloc(RecordObject *r) {
    PyObject_GC_UnTrack(r);
    if (r->weaklist) PyObject_ClearWeakRefs((PyObject *)r);
    Record_clear(r);
    Py_CLEAR(r->device);
    Py_CLEAR(r->origin);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *get_state(RecordObject *r, void *c) { return Py_NewRef(state_str[r->state]); }

static int set_state(RecordObject *r, PyObject *v, void *c) {
    for (int i = 0; i < 3; i++) {
        if (v != NULL && PyUnicode_Check(v) && PyUnicode_CompareWithASCIIString(v, STATE_NAMES[i]) == 0) {
            r->state = i;
            return 0;
        }
    }
    PyErr_SetString(PyExc_ValueError, "state must be 'live', 'releasing' or 'released'");
    return -1;
}

static PyObject *get_kind(RecordObject *r, void *c) { return Py_NewRef(kind_str[r->kind]); }

static PyObject *get_release(RecordObject *r, void *c) {
    if (r->release) return Py_NewRef(r->release);
    if (r->managed)
        return Py_BuildValue("(ONO)", S.call_deleter, PyLong_FromVoidPtr(r->managed), r->versioned ? Py_True : Py_False);
    Py_RETURN_NONE;
}

static int set_release(RecordObject *r, PyObject *v, void *c) {
    r->managed = NULL;
    if (v == Py_None) v = NULL;
    Py_XINCREF(v);
    Py_XSETREF(r->release, v);
    return 0;
}

static PyObject *get_obj(PyObject **slot) { return Py_NewRef(*slot ? *slot : Py_None); }
static int set_obj(PyObject **slot, PyObject *v) {
    if (v == Py_None) v = NULL;
    Py_XINCREF(v);
    Py_XSETREF(*slot, v);
    return 0;
}
static PyObject *get_owner(RecordObject *r, void *c) { return get_obj(&r->owner); }
static int set_owner(RecordObject *r, PyObject *v, void *c) { return set_obj(&r->owner, v); }
static PyObject *get_streams(RecordObject *r, void *c) { return get_obj(&r->streams); }
static int set_streams(RecordObject *r, PyObject *v, void *c) { return set_obj(&r->streams, v); }
static PyObject *get_address(RecordObject *r, void *c) { return PyLong_FromVoidPtr((void *)r->address); }

/* _holder_items() -> [(token, description)]: description a str, or an int export id. */
static PyObject *Record_holder_items(RecordObject *r, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (int i = 0; i < INLINE_HOLDERS; i++) {
        Holder *h = &r->holders[i];
        if (h->token == 0) continue;
        PyObject *item = h->desc ? Py_BuildValue("(LO)", h->token, h->desc)
                         : h->ctx ? Py_BuildValue("(LL)", h->token, h->ctx)
                                  : Py_BuildValue("(LO)", h->token, S.str_tensor);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    if (r->more != NULL) {
        PyObject *items = PyDict_Items(r->more);
        if (items == NULL) { Py_DECREF(out); return NULL; }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
            if (PyList_Append(out, PyList_GET_ITEM(items, i)) < 0) {
                Py_DECREF(items);
                Py_DECREF(out);
                return NULL;
            }
        }
        Py_DECREF(items);
    }
    return out;
}

static PyMemberDef Record_members[] = {
    {"id", T_LONGLONG, offsetof(RecordObject, id), READONLY, "increasing, from 1"},
    {"device", T_OBJECT, offsetof(RecordObject, device), READONLY, "tx.Device"},
    {"nbytes", T_LONGLONG, offsetof(RecordObject, nbytes), READONLY, "bytes"},
    {"_origin", T_OBJECT, offsetof(RecordObject, origin), READONLY, NULL},
    {"_nholders", T_PYSSIZET, offsetof(RecordObject, nholders), READONLY, NULL},
    {NULL},
};

static PyGetSetDef Record_getset[] = {
    {"state", (getter)get_state, (setter)set_state, "'live', 'releasing' or 'released'", NULL},
    {"kind", (getter)get_kind, NULL, "'allocated', 'imported' or 'borrowed'", NULL},
    {"address", (getter)get_address, NULL, "lowest byte (int)", NULL},
    {"_release", (getter)get_release, (setter)set_release, NULL, NULL},
    {"_owner", (getter)get_owner, (setter)set_owner, NULL, NULL},
    {"_streams", (getter)get_streams, (setter)set_streams, NULL, NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyMethodDef Record_methods[] = {
    {"_holder_items", (PyCFunction)Record_holder_items, METH_NOARGS, "[(token, description)] of the holders"},
    {NULL},
};

PyTypeObject RecordBase_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "exchange._native.RecordBase",
    .tp_basicsize = sizeof(RecordObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Storage of a registry record (exchange.registry.Record adds the views).",
    .tp_new = Record_new_refused,
    .tp_dealloc = (destructor)Record_dealloc,
    .tp_traverse = (traverseproc)Record_traverse,
    .tp_clear = (inquiry)Record_clear,
    .tp_members = Record_members,
    .tp_getset = Record_getset,
    .tp_methods = Record_methods,
    .tp_weaklistoffset = offsetof(RecordObject, weaklist),
    .tp_dictoffset = offsetof(RecordObject, dict),
};

/* -- module functions ------------------------------------------------------------------------ */
static int parse_kind(PyObject *kind) {
    for (int i = 0; i < 3; i++)
        if (PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, KIND_NAMES[i]) == 0) return i;
    PyErr_SetString(PyExc_ValueError, "kind must be 'allocated', 'imported' or 'borrowed'");
    return -1;
}

/* new_record(device, address, nbytes, origin, kind, release, owner, label, holder) -> (record, token) */
static PyObject *py_new_record(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "new_record takes 9 arguments");
        return NULL;
    }
    uintptr_t address = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    long long nbytes = PyLong_AsLongLong(args[2]);
    int kind = parse_kind(args[4]);
    if (PyErr_Occurred()) return NULL;
    PyObject *holder = args[8];
    long long token = 0;
    PyObject *type = PyObject_GetAttrString(args[0], "type"), *id = PyObject_GetAttrString(args[0], "id");
    long dev_type = type ? PyLong_AsLong(type) : -1, dev_id = id ? PyLong_AsLong(id) : -1;
    Py_XDECREF(type);
    Py_XDECREF(id);
    if (PyErr_Occurred()) return NULL;
    RecordObject *r = record_new(args[0], (int32_t)dev_type, (int32_t)dev_id, address, nbytes, args[3], kind, args[5],
                                 NULL, 0, args[6], holder != Py_None ? &token : NULL);
    if (r == NULL) return NULL;
    if (holder != Py_None && PyUnicode_Check(holder) && PyUnicode_Compare(holder, S.str_tensor) != 0) {
        Py_INCREF(holder);
        r->holders[0].desc = holder;
    }
    if (args[7] != Py_None && PyObject_SetAttrString((PyObject *)r, "label", args[7]) < 0) {
        record_gone(r);
        Py_DECREF(r);
        return NULL;
    }
    return Py_BuildValue("(NL)", (PyObject *)r, token);
}

static RecordObject *record_arg(PyObject *o) {
    if (!Record_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "expected a registry Record");
        return NULL;
    }
    return (RecordObject *)o;
}

/* add_holder(record, description) -> token (LifetimeError unless the record is live) */
static PyObject *py_add_holder(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    RecordObject *r = nargs == 2 ? record_arg(args[0]) : NULL;
    if (r == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "add_holder(record, description)");
        return NULL;
    }
    PyObject *desc = args[1];
    long long token = record_add_holder(r, 0, PyUnicode_Check(desc) && PyUnicode_Compare(desc, S.str_tensor) == 0 ? NULL : desc);
    if (token < 0) return NULL;
    return PyLong_FromLongLong(token);
}

/* remove_holder(record, token): the last holder starts the release. */
static PyObject *py_remove_holder(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    RecordObject *r = nargs == 2 ? record_arg(args[0]) : NULL;
    if (r == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "remove_holder(record, token)");
        return NULL;
    }
    long long token = PyLong_AsLongLong(args[1]);
    if (token == -1 && PyErr_Occurred()) return NULL;
    record_remove_holder(r, token);
    Py_RETURN_NONE;
}

/* record_gone(record): it leaves the live set (its release ran, or it was discarded). */
static PyObject *py_record_gone(PyObject *mod, PyObject *arg) {
    RecordObject *r = record_arg(arg);
    if (r == NULL) return NULL;
    record_gone(r);
    Py_RETURN_NONE;
}

/* live_records() -> [records], oldest first. */
static PyObject *py_live_records(PyObject *mod, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (RecordObject *r = S.head; r != NULL; r = r->next) {
        if (PyList_Append(out, (PyObject *)r) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

PyMethodDef registry_methods[] = {
    {"new_record", (PyCFunction)(void (*)(void))py_new_record, METH_FASTCALL, "Register memory (and a first holder)."},
    {"add_holder", (PyCFunction)(void (*)(void))py_add_holder, METH_FASTCALL, "Add a holder; returns its token."},
    {"remove_holder", (PyCFunction)(void (*)(void))py_remove_holder, METH_FASTCALL, "Drop a holder."},
    {"record_gone", py_record_gone, METH_O, "The record leaves the live set."},
    {"live_records", py_live_records, METH_NOARGS, "The records not yet released, oldest first."},
    {NULL, NULL, 0, NULL},
};

int registry_types_ready(PyObject *module) {
    for (int i = 0; i < 3; i++) {
        state_str[i] = PyUnicode_InternFromString(STATE_NAMES[i]);
        kind_str[i] = PyUnicode_InternFromString(KIND_NAMES[i]);
        if (state_str[i] == NULL || kind_str[i] == NULL) return -1;
    }
    if (PyType_Ready(&RecordBase_Type) < 0) return -1;
    Py_INCREF(&RecordBase_Type);
    return PyModule_AddObject(module, "RecordBase", (PyObject *)&RecordBase_Type);
}
