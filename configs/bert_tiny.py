# A Hugging Face BERT (transformers.BertForMaskedLM, 2 layers, the output decoder tied to the word embeddings,
# non-persistent position/token-type buffers) on a synthetic masked-token corpus: distkit's shared loop with a
# real HF encoder, no downloads, no changes. Items are dicts {"input_ids", "attention_mask", "labels"} (labels
# -100 except at the masked positions), so the loss is model(**batch).loss; a custom task reports eval_loss only.
#   distkit train configs/bert_tiny.py --nprocs 2                                  # DDP, grad mode
#   distkit train configs/bert_tiny.py --nprocs 2 ++distributed "{'backend': 'fsdp'}"
#   distkit train configs/bert_tiny.py --nprocs 2 ++distributed "{'backend': 'fsdp', 'reduce_type': 'param', 'param_sync_step': 4}"
#   distkit train configs/bert_tiny.py --nprocs 2 ++distributed "{'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 3}}}"
import torch

_VOCAB, _SEQ_LEN, _MASK_ID = 64, 16, 63  # token 63 is [MASK]; the corpus uses 0..62


def model():
    """BERT, 2 layers x 32 wide, 2 heads; dropout 0 so every run is deterministic."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=_SEQ_LEN, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0, tie_word_embeddings=True)
    return BertForMaskedLM(cfg)


def _corpus(n, seed):
    """n sequences of _SEQ_LEN tokens, x[t+1] = x[t] + stride (mod 63), a random start and stride in 1..3 each;
    3 positions per sequence masked (input [MASK], the label the token there). Deterministic (own generator)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, _MASK_ID, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(_SEQ_LEN)) % _MASK_ID
    where = torch.rand(n, _SEQ_LEN, generator=g).argsort(dim=1)[:, :3]
    masked = torch.zeros(n, _SEQ_LEN, dtype=torch.bool).scatter_(1, where, True)
    inputs = ids.masked_fill(masked, _MASK_ID)
    labels = ids.masked_fill(~masked, -100)
    mask = torch.ones_like(ids)
    return [{"input_ids": inputs[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def train_dataset():
    return _corpus(512, seed=1)


def eval_dataset():
    return _corpus(64, seed=2)


optimizer = {"class": "adamw", "weight_decay": 0.01}
learning_rate = 3e-3
batch_size = 8           # per rank
max_steps = 20
log_every = 5
torch_distributed = {}   # DDP, grad mode; the command line may pick another engine
output_dir = "runs/bert_tiny"
