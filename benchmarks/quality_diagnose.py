"""Why can a pre-trained checkpoint fine-tune worse than random init with few labels? Small
experiments on one instances folder, each answer a line of JSON.

    python -m benchmarks.quality_diagnose --instances DIR --samples DIR --out DIR --steps 7000 --jobs 15

1. Pre-trains the demo preset's tiny model in-process for ``--steps`` steps in each pre-training
   variant of :data:`PRETRAIN` (the product's optimizer: AdamW β 0.9/0.999, ε 1e-6, weight decay
   on matrices only, linear warmup over 10% then linear decay, gradient clipping 1.0, global batch
   64 at 64 tokens, masks drawn anew each epoch), on the accelerator when there is one, all
   variants side by side.
2. Measures each checkpoint against random init: parameter norms, the attention entropy of
   ``[CLS]`` in each layer, and how much the ``[CLS]`` state and the mean token state vary between
   sentences (cosine similarity of two different sentences' vectors).
3. Fine-tunes each checkpoint and random init with the product's loop on 300 (and 1,000) labels
   of each task, 3 stratified subsamples, in each fine-tuning variant of :data:`FINETUNE` at each
   learning rate, scored on dev (macro-F1 and accuracy). Jobs run ``--jobs`` at a time, one
   thread each, most telling first; each result is appended to ``out/finetune.jsonl`` as it ends.
4. ``--compare A,B`` (after 1-3, on the same ``--out``): the 300-label comparison of checkpoints A
   and B on test, 5 subsamples, at the setting both arms shared (pooler over [CLS], rate 1e-3,
   10 epochs) and at each arm's own setting (its best mean dev macro-F1 at 300 labels in
   ``finetune.jsonl``): ``out/compare.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

PRETRAIN = {  # name -> (pre_layer_norm, peak learning rate, weight decay)
    "preln-lr3e-3-wd0.01": (True, 3e-3, 0.01),
    "postln-lr1e-3-wd0.01": (False, 1e-3, 0.01),
    "preln-lr3e-3-wd0.1": (True, 3e-3, 0.1),
    "preln-lr1e-3-wd0.01": (True, 1e-3, 0.01),
}
FINETUNE = {  # name -> setting overrides
    "cls": {},
    "mean": {"pooling": "mean"},
    "cls-reinit1": {"reinit_layers": 1},
    "cls-llrd0.8": {"layerwise_lr_decay": 0.8},
}
LEARNING_RATES = (3e-4, 1e-3, 3e-3)


def model_cfg(pre_layer_norm: bool, vocab_size: int):
    from bert_core.config import ModelConfig

    return ModelConfig(size="tiny", vocab_size=vocab_size, max_position_embeddings=512, pre_layer_norm=pre_layer_norm)


def pretrain(instances: str, name: str, steps: int, out: Path, seed: int = 42) -> str:
    """One pre-training variant, by the product's in-process steps; its transformers folder."""
    import torch

    from bert_core.model.checkpoint import save_pretrained
    from bert_core.pretrain.data import read_vocab, vocab_file_of
    from bert_core.pretrain.in_process import random_init, short_run, train_mlm

    pre_ln, lr, wd = PRETRAIN[name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab_file = vocab_file_of(instances)
    model = random_init(model_cfg(pre_ln, len(read_vocab(vocab_file))), seed)
    log = train_mlm(model, instances, short_run(64, steps, 64, lr, wd, seed), device=device)
    folder = out / name
    save_pretrained(model.cpu(), str(folder), vocab_file=vocab_file)
    (folder / "pretrain-log.json").write_text(json.dumps(log))
    return str(folder)


def baseline(instances: str, out: Path, pre_layer_norm: bool, seed: int = 42) -> str:
    """The product's random init of the variant's model, saved beside the pre-trained ones."""
    from bert_core.model.checkpoint import save_pretrained
    from bert_core.pretrain.data import read_vocab, vocab_file_of
    from bert_core.pretrain.in_process import random_init

    vocab_file = vocab_file_of(instances)
    name = f"random-init-{'preln' if pre_layer_norm else 'postln'}"
    save_pretrained(random_init(model_cfg(pre_layer_norm, len(read_vocab(vocab_file))), seed), str(out / name),
                    vocab_file=vocab_file)
    return str(out / name)


def measure(checkpoint: str, reference: str, sentences: list) -> dict:
    """Norm ratios against ``reference``, [CLS] attention entropy per layer, and the mean cosine
    similarity between different sentences' [CLS] / mean-pooled last states."""
    import torch
    import torch.nn.functional as F

    from bert_core.finetune.glue import encode_pairs
    from bert_core.model.bert import BertModel, Tokens
    from bert_core.vocab.tokenization import load_tokenizer

    model, ref = BertModel.from_pretrained(checkpoint).eval(), BertModel.from_pretrained(reference)
    ref_params = dict(ref.named_parameters())
    norms = {n: round(float(p.detach().norm() / ref_params[n].detach().norm()), 2) for n, p in model.named_parameters()
             if p.ndim >= 2 or "LayerNorm" in n or ".ln." in n}
    tokenizer = load_tokenizer(checkpoint)
    enc = encode_pairs(tokenizer, sentences, 64)
    T = max(len(i) for i in enc["input_ids"])
    ids = torch.tensor([i + [tokenizer.pad_id] * (T - len(i)) for i in enc["input_ids"]])
    mask = (ids != tokenizer.pad_id).long()
    entropy = []
    captured: list = []

    def hook(module, args, output):
        captured.append(args[0])

    handles = [layer.attention.self.register_forward_hook(hook) for layer in model.encoder.layer]
    with torch.no_grad():
        out = model(ids, torch.zeros_like(ids), mask, output_hidden_states=True)
        for layer, x in zip(model.encoder.layer, captured, strict=True):
            # the [CLS] row's attention over the real tokens, recomputed from the layer input
            tokens = Tokens(mask, *ids.shape, x.dtype)
            a = layer.attention.self
            H = x.shape[-1]
            h = layer.attention.output.LayerNorm(x) if layer.pre_layer_norm else x
            w = torch.cat([a.query.weight, a.key.weight])
            b = torch.cat([a.query.bias, a.key.bias])
            qk = tokens.pad(F.linear(h, w, b))  # [B, T, 2H]
            nh = a.num_heads
            q, k = qk.view(*ids.shape, 2, nh, H // nh).permute(2, 0, 3, 1, 4)
            logits = (q[:, :, :1] @ k.transpose(-1, -2)) / math.sqrt(H // nh)  # [B, nh, 1, T]
            logits = logits.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
            p = logits.softmax(-1)
            ent = -(p * p.clamp_min(1e-12).log()).sum(-1).mean()
            uniform = (mask.sum(1).float().log()).mean()
            entropy.append({"cls_entropy": round(float(ent), 3), "uniform_entropy": round(float(uniform), 3)})
    for h in handles:
        h.remove()
    cls = out.last_hidden_state[:, 0]
    mean = (out.last_hidden_state * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)

    def similarity(v):
        v = F.normalize(v, dim=-1)
        s = v @ v.T
        n = len(v)
        return round(float((s.sum() - s.diagonal().sum()) / (n * (n - 1))), 5)

    return {"norm_ratio": norms, "attention": entropy, "cls_similarity": similarity(cls),
            "mean_similarity": similarity(mean), "pooler_similarity": similarity(out.pooler_output)}


SHARED = {"variant": "cls", "learning_rate": 1e-3}  # the setting both arms shared


def own_setting(rows: list[dict], checkpoint: str, task: str) -> dict:
    """The variant and rate with the best mean dev macro-F1 at 300 labels."""
    means: dict[tuple, list[float]] = {}
    for r in rows:
        if (r["size"], r["checkpoint"], r["task"]) == (300, checkpoint, task):
            means.setdefault((r["variant"], r["learning_rate"]), []).append(r["macro_f1"])
    variant, lr = max(means, key=lambda k: sum(means[k]) / len(means[k]))
    return {"variant": variant, "learning_rate": lr}


def compare(out: Path, samples: Path, names: list[str], jobs: int) -> int:
    from benchmarks import quality_tasks as qt
    from benchmarks.quality_finetune import encoded, finetune
    from bert_core.finetune.data import subsample

    rows = [json.loads(line) for line in (out / "finetune.jsonl").read_text().splitlines()]
    work = []
    for task_name, task in qt.TASKS.items():
        parts = qt.load(task, samples)
        for name in names:
            for which, chosen in (("shared", SHARED), ("own", own_setting(rows, name, task_name))):
                setting = FINETUNE[chosen["variant"]] | {"learning_rate": chosen["learning_rate"], "epochs": 10}
                for k in range(5):
                    train = subsample(parts["train"], 300, task_name, k)
                    data, pad = encoded(str(out / name), {"train": train, "test": parts["test"]}, task.labels, 64)
                    key = {"task": task_name, "checkpoint": name, "which": which, **chosen, "subsample": k}
                    work.append((key, (str(out / name), data, "test", len(task.labels), setting, 1 + k, pad)))
    with ProcessPoolExecutor(max(1, jobs)) as pool, (out / "compare.jsonl").open("a") as log:
        running = {pool.submit(finetune, *a): key for key, a in work}
        for n, f in enumerate(as_completed(running), 1):
            log.write(json.dumps(running[f] | f.result()) + "\n")
            log.flush()
            print(f"compare: {n}/{len(work)}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks import quality_tasks as qt
    from benchmarks.quality_finetune import encoded, finetune
    from bert_core.finetune.data import subsample

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", required=True)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=7000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--pretrain", default=",".join(PRETRAIN))
    parser.add_argument("--limit-jobs", type=int, default=None, help="only the first N fine-tuning jobs")
    parser.add_argument("--dev-limit", type=int, default=1000, help="dev examples scored per job (a stratified sample)")
    parser.add_argument("--compare", default=None, help="two checkpoint names: the 300-label test comparison")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        return compare(out, Path(args.samples), args.compare.split(","), args.jobs)
    started = time.perf_counter()
    names = [n for n in args.pretrain.split(",") if n]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        futures = {pool.submit(pretrain, args.instances, n, args.steps, out): n for n in names}
        checkpoints = {"random-init-preln": baseline(args.instances, out, True),
                       "random-init-postln": baseline(args.instances, out, False)}
        for f in as_completed(futures):
            checkpoints[futures[f]] = f.result()
            print(json.dumps({"pretrained": futures[f], "minutes": round((time.perf_counter() - started) / 60, 2),
                              "log": json.loads((Path(f.result()) / "pretrain-log.json").read_text())[-1]}),
                  flush=True)
        samples = Path(args.samples)
        tasks = {name: qt.load(task, samples) for name, task in qt.TASKS.items()}
        for name, ckpt in checkpoints.items():
            if name.startswith("random"):
                continue
            ref = checkpoints["random-init-preln" if PRETRAIN[name][0] else "random-init-postln"]
            m = measure(ckpt, ref, tasks["sentiment"]["dev"][:200])
            (out / f"measure-{name}.json").write_text(json.dumps(m, indent=1))
            short = {k: v for k, v in m["norm_ratio"].items() if "layer.0.attention.self" in k or "word_emb" in k
                     or "pooler" in k}
            print(json.dumps({"measure": name, **{k: m[k] for k in m if k != "norm_ratio"}, "norms": short}),
                  flush=True)
        for name in ("random-init-preln", "random-init-postln"):
            m = measure(checkpoints[name], checkpoints[name], tasks["sentiment"]["dev"][:200])
            print(json.dumps({"measure": name, **{k: m[k] for k in m if k != "norm_ratio"}}), flush=True)

        jobs = []
        for size, variants, lrs in ((300, list(FINETUNE), LEARNING_RATES), (1000, ["cls", "mean"], (1e-3, 3e-3))):
            for task_name, parts in tasks.items():
                task = qt.TASKS[task_name]
                for k in range(3):
                    train = subsample(parts["train"], size, task_name, k)
                    for ck_name, ckpt in checkpoints.items():
                        data, pad = encoded(ckpt, {"train": train, "dev": subsample(parts["dev"], args.dev_limit, task_name)},
                                            task.labels, 64)
                        for variant in variants:
                            for lr in lrs:
                                setting = FINETUNE[variant] | {"learning_rate": lr, "epochs": 10 if size == 300 else 6}
                                key = {"size": size, "task": task_name, "subsample": k, "checkpoint": ck_name,
                                       "variant": variant, "learning_rate": lr}
                                jobs.append((key, (ckpt, data, "dev", len(task.labels), setting, 1 + k, pad)))
        jobs = jobs[:args.limit_jobs]
        print(json.dumps({"finetune_jobs": len(jobs)}), flush=True)
        running = {pool.submit(finetune, *a): key for key, a in jobs}
        with (out / "finetune.jsonl").open("a") as log:
            for f in as_completed(running):
                log.write(json.dumps(running[f] | f.result()) + "\n")
                log.flush()
    print(json.dumps({"minutes": round((time.perf_counter() - started) / 60, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
