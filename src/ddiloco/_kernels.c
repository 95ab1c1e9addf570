/* Fused CPU kernels for the syncer's outer step and for reading pushes
   (ddiloco.algorithm.kernels wraps them).

   The syncer merges multi-megabyte fragments. Written as torch operations, one Nesterov
   outer step on a learner's push is five or six memory-bound passes, each a separate call
   that releases and retakes the GIL. Here it is one pass (read theta, b and the push, write
   theta' and b') that runs with the GIL released, with the arithmetic of
   OuterNesterov.stepped.

   The functions take raw addresses: the Python wrapper checks that every tensor is a
   contiguous fp32 CPU tensor of n elements before calling. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The kernels are compiled for x86-64 CPUs with AVX2 and FMA (chosen at run time; other
   x86-64 CPUs get FAST = 0 and the caller uses torch) and for aarch64, where FMA is
   baseline. Rounding follows torch's CPU operations step by step: a product then a sum
   where torch multiplies and adds, and a fused multiply-add where torch adds with alpha. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DDILOCO_TARGET __attribute__((target("avx2,fma")))
static int fast_cpu(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#elif defined(__aarch64__)
#define DDILOCO_TARGET
static int fast_cpu(void) { return 1; }
#else
#define DDILOCO_TARGET
static int fast_cpu(void) { return 0; }
#endif

/* NaN exactly when v is NaN or +-inf */
#define DDILOCO_BAD(v) ((v) * 0.0f != (v) * 0.0f)

/* g = a - x (x == NULL: g = a), then OuterNesterov.stepped:
     s == 1 (unit):  b' = mu*b + g;    u = g + mu*b';  theta' = theta - lr*u
     otherwise:      b' = mu*b + s*g;  theta' = theta - lr*s*g - lr*mu*b'
   c_u = -lr, c_g = -lr*s, c_b = -lr*mu (products taken in double by the caller, as torch
   takes a Python float alpha). Returns 1 if every theta' is finite. */
DDILOCO_TARGET
static int nesterov_f32(const float *restrict theta, const float *restrict b,
                        const float *restrict a, const float *restrict x,
                        float *restrict theta_out, float *restrict b_out, Py_ssize_t n,
                        float mu, float s, float c_u, float c_g, float c_b, int unit) {
    int bad = 0;
#define DDILOCO_LOOP(G)                                                      \
    for (Py_ssize_t i = 0; i < n; i++) {                                     \
        float g = (G), mb = mu * b[i], nb, nt;                               \
        if (unit) {                                                          \
            nb = mb + g;                                                     \
            nt = __builtin_fmaf(__builtin_fmaf(nb, mu, g), c_u, theta[i]);   \
        } else {                                                             \
            nb = __builtin_fmaf(g, s, mb);                                   \
            nt = __builtin_fmaf(nb, c_b, __builtin_fmaf(g, c_g, theta[i]));  \
        }                                                                    \
        b_out[i] = nb;                                                       \
        theta_out[i] = nt;                                                   \
        bad |= DDILOCO_BAD(nt);                                              \
    }
    if (x != NULL) {
        DDILOCO_LOOP(a[i] - x[i])
    } else {
        DDILOCO_LOOP(a[i])
    }
#undef DDILOCO_LOOP
    return !bad;
}

DDILOCO_TARGET
static int all_finite_f32(const float *restrict x, Py_ssize_t n) {
    int bad = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        bad |= DDILOCO_BAD(x[i]);
    return !bad;
}

/* The merge of a push read a piece at a time (fp32 or bf16 parameters, Fold.add_pieces):
   x is the push's elements as they arrived, decoded in registers (bf16: the high half of an
   fp32, as torch widens it), never into a tensor. BF16 = 1 selects bf16, else fp32. */
static inline float ddiloco_bf16(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
#define DDILOCO_X(x, i, bf16) \
    ((bf16) ? ddiloco_bf16(((const uint16_t *)(x))[i]) : ((const float *)(x))[i])

/* No NaN or inf among n bf16 values: the exponent bits are all ones exactly then. */
DDILOCO_TARGET
static int all_finite_bf16(const uint16_t *restrict x, Py_ssize_t n) {
    int bad = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        bad |= (x[i] & 0x7f80) == 0x7f80;
    return !bad;
}

/* d = a - x into d (the norm's scratch, a cache-sized piece) where d != NULL; where
   out != NULL also out = out + c*d (a fused multiply-add, as torch's add_ with alpha), or
   with fresh set out = 0 + c*d (out's old values are not read: the fold of a zeroed buffer
   without zeroing it). Returns 1 if every x is finite. */
DDILOCO_TARGET
static int diff_fold(const float *restrict a, const void *restrict x, int bf16,
                     float *restrict d, float *restrict out, float c, int fresh,
                     Py_ssize_t n) {
    int bad = 0;
#define DDILOCO_LOOP(BF16, STORE_D, FOLD)                                                \
    for (Py_ssize_t i = 0; i < n; i++) {                                                 \
        float xi = DDILOCO_X(x, i, BF16), di = a[i] - xi;                                \
        if (STORE_D)                                                                     \
            d[i] = di;                                                                   \
        if (FOLD == 1)                                                                   \
            out[i] = __builtin_fmaf(di, c, out[i]);                                      \
        else if (FOLD == 2)                                                              \
            out[i] = __builtin_fmaf(di, c, 0.0f);                                        \
        bad |= DDILOCO_BAD(xi);                                                          \
    }
#define DDILOCO_LOOPS(BF16)                                                              \
    if (out == NULL) {                                                                   \
        if (d != NULL) { DDILOCO_LOOP(BF16, 1, 0) } else { DDILOCO_LOOP(BF16, 0, 0) }    \
    } else if (fresh) {                                                                  \
        if (d != NULL) { DDILOCO_LOOP(BF16, 1, 2) } else { DDILOCO_LOOP(BF16, 0, 2) }    \
    } else {                                                                             \
        if (d != NULL) { DDILOCO_LOOP(BF16, 1, 1) } else { DDILOCO_LOOP(BF16, 0, 1) }    \
    }
    if (bf16) {
        DDILOCO_LOOPS(1)
    } else {
        DDILOCO_LOOPS(0)
    }
#undef DDILOCO_LOOPS
#undef DDILOCO_LOOP
    return !bad;
}

static PyObject *py_nesterov(PyObject *self, PyObject *args) {
    unsigned long long theta, b, a, x, theta_out, b_out;
    Py_ssize_t n;
    float mu, s, c_u, c_g, c_b;
    int unit;
    if (!PyArg_ParseTuple(args, "KKKKKKnfffffp", &theta, &b, &a, &x, &theta_out, &b_out, &n,
                          &mu, &s, &c_u, &c_g, &c_b, &unit))
        return NULL;
    if (n < 0 || !theta || !b || !a || !theta_out || !b_out) {
        PyErr_SetString(PyExc_ValueError, "nesterov: null address or negative length");
        return NULL;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = nesterov_f32((const float *)(uintptr_t)theta, (const float *)(uintptr_t)b,
                  (const float *)(uintptr_t)a, (const float *)(uintptr_t)x,
                  (float *)(uintptr_t)theta_out, (float *)(uintptr_t)b_out, n, mu, s, c_u,
                      c_g, c_b, unit);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *py_finite(PyObject *self, PyObject *args) {
    unsigned long long x;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Kn", &x, &n))
        return NULL;
    if (n < 0 || (!x && n)) {
        PyErr_SetString(PyExc_ValueError, "finite: null address or negative length");
        return NULL;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = all_finite_f32((const float *)(uintptr_t)x, n);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *py_finite_bf16(PyObject *self, PyObject *args) {
    unsigned long long x;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Kn", &x, &n))
        return NULL;
    if (n < 0 || (!x && n)) {
        PyErr_SetString(PyExc_ValueError, "finite_bf16: null address or negative length");
        return NULL;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = all_finite_bf16((const uint16_t *)(uintptr_t)x, n);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *py_diff_fold(PyObject *self, PyObject *args) {
    unsigned long long a, x, d, out;
    int bf16, fresh;
    float c;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "KKpKKfpn", &a, &x, &bf16, &d, &out, &c, &fresh, &n))
        return NULL;
    if (n < 0 || (n && (!a || !x))) {
        PyErr_SetString(PyExc_ValueError, "diff_fold: null address or negative length");
        return NULL;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = diff_fold((const float *)(uintptr_t)a, (const void *)(uintptr_t)x, bf16,
                   (float *)(uintptr_t)d, (float *)(uintptr_t)out, c, fresh, n);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"nesterov", py_nesterov, METH_VARARGS,
     "nesterov(theta, b, a, x, theta_out, b_out, n, mu, s, c_u, c_g, c_b, unit) -> all "
     "theta_out finite"},
    {"finite", py_finite, METH_VARARGS, "finite(x, n) -> no NaN/inf in the n floats at x"},
    {"finite_bf16", py_finite_bf16, METH_VARARGS,
     "finite_bf16(x, n) -> no NaN/inf in the n bf16 values at x"},
    {"diff_fold", py_diff_fold, METH_VARARGS,
     "diff_fold(a, x, bf16, d, out, c, fresh, n) -> every x finite; d = a - x (d != 0), "
     "out += c*d (out != 0; fresh: out = 0 + c*d)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Fused CPU kernels for the syncer's merge.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "FAST", fast_cpu()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
