"""Accelerate's LocalSGD example (``examples/by_feature/local_sgd.py`` in huggingface/accelerate, Apache-2.0: BERT
fine-tuned on GLUE MRPC, parameters averaged every K batches), written again here with two kinds of change:

- the conversion to distkit, lines marked ``# distkit:``: ``from accelerate.local_sgd import LocalSGD`` becomes
  ``from distkit.hf import ParamSync`` and ``LocalSGD(`` becomes ``ParamSync(`` with the same keywords (2 lines);
  passing ``config=args`` and adding distkit's flags to the parser (2 more lines, optional) lets the command line
  turn on distkit's extras (``++param_outer_optimizer "{'class': 'nesterov', 'lr': 0.7, 'momentum': 0.9}"``,
  ``++distributed.param_sync_fragments 2``, ``++distributed.param_sync_compression int8`` ...);
- the no-download substitution, lines marked ``# no-download:``: GLUE MRPC, the bert-base-cased tokenizer and
  weights, and ``evaluate``'s metric are replaced by a tiny ``BertConfig`` model, random token ids of the shapes a
  tokenized MRPC batch has (``input_ids``/``token_type_ids``/``attention_mask`` of (batch, length), ``labels`` of
  (batch,)), and a hand-computed accuracy. Nothing else of the training loop changes.

Run on 2 CPU ranks (either launcher)::

    accelerate launch --cpu --num_processes 2 examples/hf_local_sgd.py --cpu --local_sgd_steps 4
    torchrun --nproc_per_node 2 examples/hf_local_sgd.py --cpu --local_sgd_steps 4 ++param_outer_optimizer \\
        "{'class': 'nesterov', 'lr': 0.7, 'momentum': 0.9}"

At LocalSGD's settings the result is LocalSGD's, bit for bit (tests/test_hf.py runs both).
"""
import argparse

import torch
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import BatchEncoding, BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup, set_seed

from accelerate import Accelerator, DistributedType

import distkit  # distkit: its flags (--config, ++key value) on the example's parser
from distkit.hf import ParamSync  # distkit: was `from accelerate.local_sgd import LocalSGD`

MAX_GPU_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 32
#: no-download: MRPC's splits are 3,668 / 408 pairs; a few batches of the same shapes are enough here
TRAIN_PAIRS, EVAL_PAIRS, SEQ_LEN, VOCAB = 96, 32, 64, 128


def get_dataloaders(accelerator: Accelerator, batch_size: int = 16):
    """Train and validation loaders of tokenized sentence pairs (no-download: random ids of the real shapes)."""
    generator = torch.Generator().manual_seed(1234)  # no-download: the same "dataset" on every rank

    def pairs(n):  # no-download: what tokenizer(sentence1, sentence2) gives, one dict per example
        length = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (n,), generator=generator)
        return [{"input_ids": torch.randint(1, VOCAB, (int(k),), generator=generator),
                 "token_type_ids": (torch.arange(int(k)) >= int(k) // 2).long(),
                 "attention_mask": torch.ones(int(k), dtype=torch.long),
                 "labels": int(torch.randint(0, 2, (1,), generator=generator))} for k in length]

    def collate_fn(examples):  # no-download: tokenizer.pad(padding="longest"), by hand
        longest = max(len(e["input_ids"]) for e in examples)
        batch = {key: torch.stack([torch.nn.functional.pad(e[key], (0, longest - len(e[key]))) for e in examples])
                 for key in ("input_ids", "token_type_ids", "attention_mask")}
        batch["labels"] = torch.tensor([e["labels"] for e in examples])
        return BatchEncoding(batch)

    train_dataloader = DataLoader(pairs(TRAIN_PAIRS), shuffle=True, collate_fn=collate_fn, batch_size=batch_size)
    eval_dataloader = DataLoader(pairs(EVAL_PAIRS), shuffle=False, collate_fn=collate_fn, batch_size=EVAL_BATCH_SIZE)
    return train_dataloader, eval_dataloader


def training_function(config, args):
    gradient_accumulation_steps = int(args.gradient_accumulation_steps)
    local_sgd_steps = int(args.local_sgd_steps)
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps
    )
    if accelerator.distributed_type not in [DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU]:
        raise NotImplementedError("LocalSGD is supported only for CPUs and GPUs (no DeepSpeed or MegatronLM)")
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    # no-download: a tiny BERT from its config, instead of from_pretrained("bert-base-cased")
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ_LEN, type_vocab_size=2, num_labels=2))
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=100,
        num_training_steps=(len(train_dataloader) * num_epochs),
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    for epoch in range(num_epochs):
        model.train()
        with ParamSync(  # distkit: was `LocalSGD(`
            accelerator=accelerator, model=model, local_sgd_steps=local_sgd_steps, enabled=local_sgd_steps is not None,
            config=args,  # distkit: distkit's flags from the command line (optional)
        ) as local_sgd:
            for step, batch in enumerate(train_dataloader):
                batch.to(accelerator.device)
                with accelerator.accumulate(model):
                    output = model(**batch)
                    loss = output.loss
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                    local_sgd.step()

        model.eval()
        correct = total = 0  # no-download: accuracy by hand instead of evaluate.load("glue", "mrpc")
        for step, batch in enumerate(eval_dataloader):
            batch.to(accelerator.device)
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += int((predictions == references).sum())
            total += len(references)
        eval_metric = {"accuracy": correct / total}
        accelerator.print(f"epoch {epoch}:", eval_metric)
    return accelerator.unwrap_model(model), eval_metric  # (for tests/test_hf.py; the original returns nothing)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"],
                        help="Whether to use mixed precision.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1,
                        help="The number of minibatches to be ran before gradients are accumulated.")
    parser.add_argument("--local_sgd_steps", type=int, default=8, help="Number of local SGD steps")
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    distkit.add_arguments(parser)  # distkit: --config FILE, ++key value
    args = parser.parse_args(argv)
    config = {"lr": 2e-5, "num_epochs": 3, "seed": 42, "batch_size": 16}
    return training_function(config, args)


if __name__ == "__main__":
    main()
