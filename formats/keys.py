"""GGUF metadata keys and tensor names, in one table so no module spells them twice."""

# Metadata keys; "{arch}" is general.architecture.
ARCHITECTURE = "general.architecture"
NAME = "general.name"
ALIGNMENT = "general.alignment"
FILE_TYPE = "general.file_type"
QUANTIZATION_VERSION = "general.quantization_version"
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")

CONTEXT_LENGTH = "{arch}.context_length"
EMBEDDING_LENGTH = "{arch}.embedding_length"
FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
BLOCK_COUNT = "{arch}.block_count"
HEAD_COUNT = "{arch}.attention.head_count"
HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
KEY_LENGTH = "{arch}.attention.key_length"
VALUE_LENGTH = "{arch}.attention.value_length"
RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
ROPE_FREQ_BASE = "{arch}.rope.freq_base"
ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"
ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"
ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"
VOCAB_SIZE = "{arch}.vocab_size"
SLIDING_WINDOW = "{arch}.attention.sliding_window"
SLIDING_WINDOW_PATTERN = "{arch}.attention.sliding_window_pattern"
ROPE_FREQ_BASE_SWA = "{arch}.rope.freq_base_swa"
ATTN_SOFTCAP = "{arch}.attn_logit_softcapping"
FINAL_SOFTCAP = "{arch}.final_logit_softcapping"
ROPE_ORIG_CONTEXT = "{arch}.rope.scaling.original_context_length"
ROPE_ATTN_FACTOR = "{arch}.rope.scaling.attn_factor"

TOKENIZER_MODEL = "tokenizer.ggml.model"
TOKENIZER_PRE = "tokenizer.ggml.pre"
TOKENS = "tokenizer.ggml.tokens"
SCORES = "tokenizer.ggml.scores"
TOKEN_TYPE = "tokenizer.ggml.token_type"
MERGES = "tokenizer.ggml.merges"
BOS_ID = "tokenizer.ggml.bos_token_id"
EOS_ID = "tokenizer.ggml.eos_token_id"
EOT_ID = "tokenizer.ggml.eot_token_id"
EOM_ID = "tokenizer.ggml.eom_token_id"
UNK_ID = "tokenizer.ggml.unknown_token_id"
PAD_ID = "tokenizer.ggml.padding_token_id"
ADD_BOS = "tokenizer.ggml.add_bos_token"
ADD_EOS = "tokenizer.ggml.add_eos_token"
ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
CHAT_TEMPLATE = "tokenizer.chat_template"

# Tensor names; "{i}" is the block index.
TOKEN_EMBD = "token_embd.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT = "output.weight"
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"  # phi3: frequency divisors past the original context
ROPE_FACTORS_SHORT = "rope_factors_short.weight"  # phi3: within it
ATTN_NORM = "blk.{i}.attn_norm.weight"
ATTN_Q = "blk.{i}.attn_q.weight"
ATTN_K = "blk.{i}.attn_k.weight"
ATTN_V = "blk.{i}.attn_v.weight"
ATTN_Q_BIAS = "blk.{i}.attn_q.bias"
ATTN_K_BIAS = "blk.{i}.attn_k.bias"
ATTN_V_BIAS = "blk.{i}.attn_v.bias"
ATTN_QKV = "blk.{i}.attn_qkv.weight"  # phi3: Q, K and V rows in one matrix
ATTN_Q_NORM = "blk.{i}.attn_q_norm.weight"
ATTN_K_NORM = "blk.{i}.attn_k_norm.weight"
ATTN_OUTPUT = "blk.{i}.attn_output.weight"
ATTN_POST_NORM = "blk.{i}.post_attention_norm.weight"
FFN_NORM = "blk.{i}.ffn_norm.weight"
FFN_GATE = "blk.{i}.ffn_gate.weight"
FFN_UP = "blk.{i}.ffn_up.weight"
FFN_DOWN = "blk.{i}.ffn_down.weight"
FFN_POST_NORM = "blk.{i}.post_ffw_norm.weight"

# Token types (tokenizer.ggml.token_type), as llama.cpp numbers them.
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6
