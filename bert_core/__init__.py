"""bertpipe's library: one subpackage per stage of the data flow, no Prefect, no Beam.

    corpus/     Wikipedia dumps and books -> documents of sentences (+ rejects)
    vocab/      word counts -> WordPiece vocab; the tokenizer
    instances/  documents -> masked-LM + next-sentence instances in balanced shards
    model/      BERT, its checkpoints and the transformers-layout export
    pretrain/   DeepSpeed pre-training: loader, loop, config, launcher, metrics log
    finetune/   GLUE, SQuAD, NER, SWAG: readers, heads, official metrics
    config.py   the typed config every stage reads; storage.py fsspec IO and manifests
A stage imports only the stages above it in this list; ``lint-imports`` checks it."""
