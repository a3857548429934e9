/* capi_check.c -- tests/test_capi.py's C program: every colibri.h call, its results written for the
 * test to compare with the Python Engine's.
 *
 *   capi_check MODEL_DIR BACKEND INPUT OUT_DIR
 *
 * INPUT: int32 batch, seq, then batch * seq ids. Writes OUT_DIR/logits.bin (float32 [batch, seq,
 * vocab]), OUT_DIR/thread0.bin and thread1.bin (two engines, one thread each, the same input), and
 * prints one line per check: `name rc code message` (rc: the call's return, code and message:
 * colibri_last_error_code / colibri_last_error after it), `generated n id...`, `vocab V`,
 * `infer_us T` (mean microseconds of 1-token colibri_infer calls).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri.h"

static const char *model, *backend;
static int32_t *ids;
static int batch, seq, vocab;

static void report(const char *name, int rc) {
    printf("%s %d %d %s\n", name, rc, colibri_last_error_code(), colibri_last_error());
}

static int write_file(const char *dir, const char *name, const void *data, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, bytes, f) != bytes) return 1;
    return fclose(f);
}

struct job { const char *out, *name; int rc; };

static void *one_thread(void *arg) {             /* its own engine, the input, its logits to a file */
    struct job *j = arg;
    colibri_config_t c = {.model_path = model, .backend = backend};
    colibri_engine_t *e = colibri_init(&c);
    if (!e) { j->rc = colibri_last_error_code(); return NULL; }
    float *lg = malloc(sizeof(float) * (size_t)batch * seq * vocab);
    for (int rep = 0; rep < 3 && j->rc == 0; rep++)
        j->rc = colibri_infer(e, ids, lg, batch, seq);
    if (j->rc == 0) j->rc = write_file(j->out, j->name, lg, sizeof(float) * (size_t)batch * seq * vocab);
    free(lg);
    colibri_destroy(e);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: capi_check MODEL_DIR BACKEND INPUT OUT_DIR\n"); return 2; }
    model = argv[1];
    backend = argv[2];
    FILE *f = fopen(argv[3], "rb");
    int32_t head[2];
    if (!f || fread(head, 4, 2, f) != 2) return 2;
    batch = head[0], seq = head[1];
    ids = malloc(4 * (size_t)batch * seq);
    if (fread(ids, 4, (size_t)batch * seq, f) != (size_t)batch * seq) return 2;
    fclose(f);

    /* a path with no model, a NULL config, a check that does not match the model */
    colibri_config_t bad = {.model_path = "/nonexistent/model", .backend = backend};
    report("bad_path", colibri_init(&bad) == NULL ? 0 : 1);          /* rc 0: NULL as it must be */
    report("null_config", colibri_init(NULL) == NULL ? 0 : 1);
    colibri_config_t wrong = {.model_path = model, .backend = backend, .top_k = 99};
    report("wrong_top_k", colibri_init(&wrong) == NULL ? 0 : 1);
    colibri_config_t wrong_e = {.model_path = model, .backend = backend, .num_experts = 7};
    report("wrong_num_experts", colibri_init(&wrong_e) == NULL ? 0 : 1);

    /* top_k as an override: one expert per token, its logits to top1.bin */
    colibri_config_t one = {.model_path = model, .backend = backend, .top_k = 1};
    colibri_engine_t *e1 = colibri_init(&one);
    if (!e1) { report("init_top1", -100); return 1; }
    int v1 = colibri_vocab_size(e1);
    float *lg1 = malloc(sizeof(float) * (size_t)batch * seq * v1);
    report("infer_top1", colibri_infer(e1, ids, lg1, batch, seq));
    write_file(argv[4], "top1.bin", lg1, sizeof(float) * (size_t)batch * seq * v1);
    free(lg1);
    colibri_destroy(e1);

    colibri_config_t config = {.model_path = model, .backend = backend};
    colibri_engine_t *engine = colibri_init(&config);
    if (!engine) { report("init", -100); return 1; }
    vocab = colibri_vocab_size(engine);
    printf("vocab %d\n", vocab);

    float *logits = malloc(sizeof(float) * (size_t)batch * seq * vocab);
    int rc = colibri_infer(engine, ids, logits, batch, seq);
    report("infer", rc);
    if (rc == 0) write_file(argv[4], "logits.bin", logits, sizeof(float) * (size_t)batch * seq * vocab);

    colibri_gen_params_t params = {.max_new_tokens = 12, .temperature = 0.0f, .top_p = 1.0f, .seed = -1};
    int32_t out[64];
    int n = -1;
    rc = colibri_generate(engine, ids, seq, &params, out, 64, &n);
    report("generate", rc);
    printf("generated %d", n);
    for (int i = 0; i < n; i++) printf(" %d", out[i]);
    printf("\n");
    colibri_gen_params_t sampled = {.max_new_tokens = 12, .temperature = 0.9f, .top_p = 0.95f, .top_k = 40,
                                    .seed = 7, .ignore_eos = 1};
    rc = colibri_generate(engine, ids, seq, &sampled, out, 64, &n);
    report("sampled", rc);
    printf("sampled_ids %d", n);
    for (int i = 0; i < n; i++) printf(" %d", out[i]);
    printf("\n");

    /* what a caller gets wrong */
    int32_t bad_ids[2] = {0, vocab};
    report("bad_token", colibri_infer(engine, bad_ids, logits, 1, 2));
    report("zero_batch", colibri_infer(engine, ids, logits, 0, seq));
    report("zero_seq", colibri_infer(engine, ids, logits, batch, 0));
    report("null_logits", colibri_infer(engine, ids, NULL, batch, seq));
    report("small_capacity", colibri_generate(engine, ids, seq, &params, out, 4, &n));
    report("null_handle", colibri_infer(NULL, ids, logits, batch, seq));
    report("forged_handle", colibri_vocab_size((colibri_engine_t *)(intptr_t)0x7));
    report("ok_after_errors", colibri_infer(engine, ids, logits, batch, seq));

    /* the overhead of a call: 1-token infers */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < 50; i++) colibri_infer(engine, ids, logits, 1, 1);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("infer_us %.1f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / 50 / 1e3);

    report("destroy", colibri_destroy(engine));
    report("after_destroy", colibri_infer(engine, ids, logits, batch, seq));
    report("destroy_twice", colibri_destroy(engine));

    /* two engines on two threads */
    pthread_t th[2];
    struct job jobs[2] = {{argv[4], "thread0.bin", 0}, {argv[4], "thread1.bin", 0}};
    for (int t = 0; t < 2; t++) pthread_create(&th[t], NULL, one_thread, &jobs[t]);
    for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
    printf("threads %d %d\n", jobs[0].rc, jobs[1].rc);
    free(logits);
    free(ids);
    return 0;
}
