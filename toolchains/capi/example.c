/* example.c -- Colibri Edge from C: open a model, get logits, generate greedily.
 *
 *   make capi                          # also builds build/capi/example (run path $ORIGIN: any directory)
 *   build/capi/example [MODEL_DIR]     # default: the installed demo model
 *
 * or by hand, in the repository root (an absolute run path: the program then runs from anywhere):
 *   gcc -o example toolchains/capi/example.c -Ibuild/capi -Lbuild/capi -lcolibri -Wl,-rpath,"$PWD/build/capi"
 *   ./example colibri_edge/default_model
 */
#include <stdio.h>
#include <stdlib.h>

#include "colibri.h"

#ifndef COLIBRI_DEFAULT_MODEL       /* make capi (build_capi.py) passes the demo model's absolute path */
#define COLIBRI_DEFAULT_MODEL "colibri_edge/default_model"
#endif

int main(int argc, char **argv) {
    colibri_config_t config = {.model_path = argc > 1 ? argv[1] : COLIBRI_DEFAULT_MODEL,
                               .backend = "cpu", .max_seq_len = 256};
    colibri_engine_t *engine = colibri_init(&config);
    if (!engine) {
        fprintf(stderr, "colibri_init: %s (code %d)\n", colibri_last_error(), colibri_last_error_code());
        return 1;
    }
    int vocab = colibri_vocab_size(engine);
    int32_t ids[4] = {1, 2, 3, 4};
    float *logits = malloc(sizeof(float) * 4 * (size_t)vocab);      /* [batch 1, seq 4, vocab] */
    int rc = colibri_infer(engine, ids, logits, 1, 4);
    if (rc != COLIBRI_OK) {
        fprintf(stderr, "colibri_infer: %s (code %d)\n", colibri_last_error(), rc);
        return 1;
    }
    int best = 0;                                                     /* argmax at the last position */
    for (int v = 1; v < vocab; v++)
        if (logits[3 * vocab + v] > logits[3 * vocab + best]) best = v;
    printf("vocab %d, next token after 1 2 3 4: %d (logit %.4f)\n", vocab, best, logits[3 * vocab + best]);

    colibri_gen_params_t params = {.max_new_tokens = 16, .temperature = 0.0f, .top_p = 1.0f, .seed = -1};
    int32_t out[16];
    int n = 0;
    rc = colibri_generate(engine, ids, 4, &params, out, 16, &n);
    if (rc != COLIBRI_OK) {
        fprintf(stderr, "colibri_generate: %s (code %d)\n", colibri_last_error(), rc);
        return 1;
    }
    printf("generated:");
    for (int i = 0; i < n; i++) printf(" %d", out[i]);
    printf("\n");
    free(logits);
    return colibri_destroy(engine);
}
