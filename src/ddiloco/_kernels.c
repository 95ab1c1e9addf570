/* Fused CPU kernels for the syncer's outer step (ddiloco.algorithm.kernels wraps them).

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

static PyMethodDef methods[] = {
    {"nesterov", py_nesterov, METH_VARARGS,
     "nesterov(theta, b, a, x, theta_out, b_out, n, mu, s, c_u, c_g, c_b, unit) -> all "
     "theta_out finite"},
    {"finite", py_finite, METH_VARARGS, "finite(x, n) -> no NaN/inf in the n floats at x"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Fused CPU kernels for the syncer's outer step.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "FAST", fast_cpu()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
