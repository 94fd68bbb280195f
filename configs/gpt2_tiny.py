# A Hugging Face GPT-2 (transformers.GPT2LMHeadModel, 2 layers, tied input/output embeddings) on a
# synthetic token corpus: distkit's shared loop with a real HF model, no downloads, no changes.
# Items are dicts {"input_ids", "attention_mask", "labels"}, so the loss is model(**batch).loss
# (the Hugging Face convention); a custom task reports eval_loss only (no accuracy).
#   distkit train configs/gpt2_tiny.py --nprocs 2                                  # DDP, grad mode
#   distkit train configs/gpt2_tiny.py --nprocs 2 ++distributed "{'backend': 'mpi'}"
#   distkit train configs/gpt2_tiny.py --nprocs 2 ++use_horovod True
#   distkit train configs/gpt2_tiny.py --nprocs 2 ++distributed "{'backend': 'deepspeed', 'deepspeed_config': {'zero_optimization': {'stage': 3}}}"
#       (no optimizer block in that DeepSpeed config: this file's AdamW is handed to DeepSpeed)
#   distkit train configs/gpt2_tiny.py --nprocs 2 ++torch_distributed "{'reduce_type': 'param', 'param_sync_step': 4}"
import torch

_VOCAB, _SEQ_LEN = 64, 16


def model():
    """GPT-2, 2 layers x 32 wide, 2 heads; dropout 0 so every run is deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=_VOCAB, n_positions=_SEQ_LEN, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    m = GPT2LMHeadModel(cfg)
    m.loss_type = "ForCausalLM"  # transformers 5 cannot infer it from the class name and warns; the same loss
    return m


def _corpus(n, seed):
    """n sequences of _SEQ_LEN tokens: a random start and a random stride in 1..3 each, then
    x[t+1] = x[t] + stride (mod vocab); learnable in context. Deterministic (own generator)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, _VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(_SEQ_LEN)) % _VOCAB
    mask = torch.ones_like(ids)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i]} for i in range(n)]


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
output_dir = "runs/gpt2_tiny"
