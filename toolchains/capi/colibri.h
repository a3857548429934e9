/* colibri.h -- the C interface of Colibri Edge (libcolibri.so).
 *
 * A C, C++, Go (cgo) or Java (JNI) program loads libcolibri.so and calls these functions; Python can
 * call them through ctypes. The library embeds the Python runtime (cffi's embedding mode): its first
 * call starts an interpreter and imports the installed colibri_edge package (the paths it was built
 * with; COLIBRI_PYTHONPATH, colon-separated site directories, comes first, for a bundle). Build:
 * `make capi` -> build/capi/libcolibri.so and build/capi/colibri.h.
 *
 * Every function returns one of the codes below (COLIBRI_OK, or negative), except colibri_init (a
 * handle or NULL), colibri_vocab_size (the size, or a negative code) and colibri_last_error. After a
 * failure, colibri_last_error() is the calling thread's message saying what to do, and
 * colibri_last_error_code() its code. Handles are checked: NULL, destroyed or forged handles are
 * COLIBRI_ERR_INVALID_ARGUMENT, never a crash. All functions may be called from several threads;
 * one engine may be shared by threads (its request core batches their calls).
 */
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define COLIBRI_OK                      0
#define COLIBRI_ERR_INVALID_ARGUMENT   -1   /* token id >= vocab, empty input, NULL or destroyed handle */
#define COLIBRI_ERR_INVALID_MODEL      -2   /* missing file, bad JSON, size/offset mismatch */
#define COLIBRI_ERR_BACKEND            -3   /* CUDA / OpenCL failure, or an internal failure */
#define COLIBRI_ERR_OUT_OF_MEMORY      -4   /* arena, KV pool or device memory exhausted */
#define COLIBRI_ERR_INVALID_MODEL_TYPE -5   /* model_type not supported */
#define COLIBRI_ERR_UNAVAILABLE        -6   /* backend asked for but not present */

typedef struct colibri_engine colibri_engine_t;    /* opaque */

typedef struct {
    const char *model_path;   /* a model directory (colibri convert writes one) */
    const char *backend;      /* "auto", "cpu", "opencl", "cuda", "reference"; NULL: COLIBRI_BACKEND or auto */
    int max_seq_len;          /* 0: the model's context */
    int max_batch;            /* sequences decoded together; 0: 8 */
    int num_experts;          /* 0, or a check: must equal the model's experts per layer */
    int top_k;                /* experts per token; 0: the model's (another value: fewer or more experts
                                 read per token, as Engine.open(top_k=...), 1..num_experts) */
} colibri_config_t;

typedef struct {
    int max_new_tokens;       /* >= 1 */
    float temperature;        /* 0: greedy */
    float top_p;              /* (0, 1]; 1: off */
    int top_k;                /* 0: off */
    int64_t seed;             /* < 0: unseeded */
    int ignore_eos;           /* 1: make exactly max_new_tokens */
} colibri_gen_params_t;

/* Open a model. NULL on failure (colibri_last_error says why). */
colibri_engine_t *colibri_init(const colibri_config_t *config);

/* The model's vocabulary size (> 0: size a logits buffer), or a negative code. */
int colibri_vocab_size(colibri_engine_t *engine);

/* input_ids: int32 [batch, seq]; logits: float32 [batch, seq, vocab], written. Row-major. */
int colibri_infer(colibri_engine_t *engine, const int32_t *input_ids, float *logits, int batch, int seq);

/* prompt: int32 [prompt_len]; out_ids: room for out_capacity >= max_new_tokens ids, written with the
 * generated ids (a final end-of-sequence id included, as transformers does); *out_count: how many. */
int colibri_generate(colibri_engine_t *engine, const int32_t *prompt, int prompt_len,
                     const colibri_gen_params_t *params, int32_t *out_ids, int out_capacity, int *out_count);

/* Close an engine; its handle is invalid afterwards. */
int colibri_destroy(colibri_engine_t *engine);

/* The calling thread's last failure: its message ("" when none; valid until this thread's next call)
 * and its code (COLIBRI_OK when none). */
const char *colibri_last_error(void);
int colibri_last_error_code(void);

#ifdef __cplusplus
}
#endif
#endif /* COLIBRI_H */
