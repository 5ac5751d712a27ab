// Greedy decoding from token ids through libllama, with no tokenizer: the same prompt ids that
// ft decodes, so the two engines' outputs compare id for id.
//   llamacpp_greedy MODEL.gguf N_PREDICT NGL ID,ID,...   -> one line: {"ids": [...]}
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static std::vector<llama_token> parse_ids(const char * text) {
    std::vector<llama_token> ids;
    std::string s(text);
    size_t start = 0;
    while (start < s.size()) {
        size_t end = s.find(',', start);
        if (end == std::string::npos) end = s.size();
        if (end > start) ids.push_back(std::atoi(s.substr(start, end - start).c_str()));
        start = end + 1;
    }
    return ids;
}

static void quiet(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);  // keep stdout one JSON line
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf N_PREDICT NGL ID,ID,...\n", argv[0]);
        return 1;
    }
    const int n_predict = std::atoi(argv[2]);
    std::vector<llama_token> prompt = parse_ids(argv[4]);
    if (prompt.empty() || n_predict < 1) {
        fprintf(stderr, "error: need prompt ids and N_PREDICT >= 1\n");
        return 1;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = std::atoi(argv[3]);
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (model == nullptr) {
        fprintf(stderr, "error: cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = prompt.size() + n_predict;
    cparams.n_batch = prompt.size();
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        fprintf(stderr, "error: cannot create a context\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<llama_token> out;
    llama_batch batch = llama_batch_get_one(prompt.data(), prompt.size());
    llama_token next = 0;
    for (int i = 0; i < n_predict; i++) {
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "error: llama_decode failed at step %d\n", i);
            return 1;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        next = 0;
        for (int v = 1; v < n_vocab; v++) {
            if (logits[v] > logits[next]) next = v;  // first maximum, as torch.argmax
        }
        out.push_back(next);
        batch = llama_batch_get_one(&next, 1);
    }
    printf("{\"ids\": [");
    for (size_t i = 0; i < out.size(); i++) printf(i ? ", %d" : "%d", out[i]);
    printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
